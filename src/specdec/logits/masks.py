"""The options that forbid tokens: ``allowed_token_ids``, ``bad_words`` and ``min_tokens``.

Each is a function of the row's history and gives the token ids to mask (set to ``-inf``)
there; :mod:`specdec.logits.request_logits` applies them to every verify row.

Example:
    >>> bad_word_bans([7, 8], bad_words=((9,), (8, 4), (3, 8, 5)))
    [9, 4]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["allowed_mask", "bad_word_bans", "bad_word_sequences", "stop_ids_to_hold"]


def bad_word_sequences(words: Sequence[str], encode) -> tuple[tuple[int, ...], ...]:
    """Every token sequence of each word: as written and with a leading space (how a word
    usually appears mid-text), without duplicates; ``encode(text) -> list[int]`` encodes
    without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        variants = [word] if word.startswith(" ") else [word, " " + word]
        for text in variants:
            ids = tuple(encode(text))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def bad_word_bans(history: Sequence[int], bad_words: Sequence[tuple[int, ...]]) -> list[int]:
    """Last tokens of the bad words whose other tokens end ``history`` (one-token words are
    always banned), in ``bad_words`` order."""
    bans = []
    for word in bad_words:
        head = word[:-1]
        if len(head) <= len(history) and tuple(history[len(history) - len(head) :]) == head:
            bans.append(word[-1])
    return bans


def stop_ids_to_hold(
    num_output: int, min_tokens: int, eos_ids: Sequence[int], stop_ids: Sequence[int], ignore_eos: bool
) -> tuple[int, ...]:
    """The ids ``min_tokens`` masks at a row with ``num_output`` tokens generated before it:
    EOS (unless ignored) and the stop token ids, while fewer than ``min_tokens`` are out."""
    if num_output >= min_tokens:
        return ()
    return tuple(stop_ids) + (() if ignore_eos else tuple(eos_ids))


def allowed_mask(allowed: Sequence[int], width: int, device: torch.device | str) -> torch.Tensor:
    """``[width]`` bool: True at the allowed ids (ids past ``width`` are dropped)."""
    mask = torch.zeros(width, dtype=torch.bool, device=device)
    ids = [t for t in allowed if t < width]
    if ids:
        mask[torch.tensor(ids, dtype=torch.int64, device=device)] = True
    return mask
