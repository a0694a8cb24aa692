"""Prompt lookup: draft the tokens that followed the latest earlier match of the recent n-gram.

No model and no KV pages. Strong on inputs that repeat themselves (code edits, summaries that
quote, extraction), useless on free text. It is the worked example of a user-defined proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.proposers.base import TokenListProposer

__all__ = ["PromptLookup", "lookup_continuation"]


def lookup_continuation(
    token_ids: Sequence[int], k: int, max_ngram: int, min_ngram: int
) -> list[int]:
    """The ``k`` tokens after the most recent earlier occurrence of the longest suffix n-gram.

    Tries n = max_ngram down to min_ngram; the suffix itself never counts as a match.
    """
    length = len(token_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(token_ids[length - n :])
        # Scan right to left so the most recent (most relevant) occurrence wins.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and list(token_ids[start : start + n]) == suffix:
                follow = list(token_ids[start + n : start + n + k])
                if follow:
                    return follow
    return []


class PromptLookup(TokenListProposer):
    """N-gram lookup in the prompt and the generated text (Saxena, 2023).

    Example:
        >>> gen = Generator.from_pretrained(path, proposer=PromptLookup(num_speculative_tokens=4))
    """

    def __init__(self, num_speculative_tokens: int = 4, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__(num_speculative_tokens)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        return lookup_continuation(token_ids, k, self.max_ngram, self.min_ngram)
