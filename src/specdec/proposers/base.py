"""A small convenience base for proposers that draft from token histories alone.

Subclass :class:`TokenListProposer`, implement :meth:`draft`, and pass an instance to
``Generator(proposer=...)``. Anything fancier (a model with its own KV pages, target hidden
states, trees) implements :class:`specdec.interfaces.Proposer` directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.config import MAX_SPECULATIVE_TOKENS, check_arg, speculative_tokens
from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.paged import KVSpec
from specdec.types import DraftProposal, ProposalKind, pad_rows

__all__ = ["TokenListProposer"]


class TokenListProposer:
    """Base for model-free chain proposers: one deterministic draft list per sequence.

    Example:
        >>> class RepeatLast(TokenListProposer):
        ...     def draft(self, token_ids, k):
        ...         return [token_ids[-1]] * k
        >>> gen = Generator.from_components(model, tok, proposer=RepeatLast(num_speculative_tokens=3))
    """

    kind = ProposalKind.CHAIN
    needs_target_hidden = False

    def __init__(self, num_speculative_tokens: int = 4) -> None:
        try:
            check_arg(speculative_tokens, "num_speculative_tokens", num_speculative_tokens)
        except TypeError:
            # A width that is no int is out of the range too: one ValueError, showing the value.
            raise ValueError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {num_speculative_tokens!r}"
            ) from None
        self.num_speculative_tokens = num_speculative_tokens

    def draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``token_ids`` (may be empty)."""
        raise NotImplementedError

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return ()

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        k = ctx.num_speculative_tokens
        rows = [list(self.draft(tokens, k))[:k] for tokens in ctx.token_ids]
        # A request's masks (a grammar, bans) cut its drafts where they stop being allowed:
        # the rest could never be accepted.
        for i, transform in enumerate(ctx.logits_transforms):
            if transform is not None:
                rows[i] = transform.allowed(rows[i])[0]
        return DraftProposal(
            kind=ProposalKind.CHAIN,
            draft_token_ids=pad_rows(rows, k, ctx.device),
            num_draft_tokens=tuple(len(r) for r in rows),
            draft_probs=None,  # deterministic drafts: the verifier treats them as one-hot
        )

    def on_target_step(self, step: TargetStep) -> None:
        """Model-free proposers keep no state that follows the target."""

    def release(self, seq_id: int) -> None:
        """Nothing to free."""
