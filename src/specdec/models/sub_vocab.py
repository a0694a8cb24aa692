"""A draft vocabulary: an LM head over a chosen subset of the tokens, ``-inf`` elsewhere.

Why: the LM head is a large share of a small draft's weights (Qwen2.5-Coder-0.5B: 136M of its
494M parameters), read in full at every draft forward, while the tokens a draft gets accepted on
come from a small part of the vocabulary. Drafting from the ``n`` most frequent tokens (FR-Spec;
EAGLE-3's ``d2t``) reads ``n / vocab`` of the head. Exactness is untouched: the verifier judges
the draft's own distribution, which is zero outside the subset; only acceptance can drop, when
the target's token lies outside it.

Example:
    >>> ids = frequent_token_ids(tokenized_corpus, 32768, model.config.vocab_size, fill=True)
    >>> head = SubVocabHead(model.lm_head, ids, model.config.vocab_size)
    >>> head(hidden).shape  # [rows, vocab], -inf outside ids
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from specdec.models.packed import linear_weights, pack_linears, should_pack

__all__ = ["SubVocabHead", "check_token_ids", "frequent_token_ids"]


def check_token_ids(token_ids: object, vocab_size: int | None, *, name: str = "draft_vocab") -> torch.Tensor:
    """``token_ids`` as a sorted ``[n]`` int64 CPU tensor of distinct ids in ``[0, vocab_size)``
    (``None``: any non-negative id, for a check before the model is known); a clear error naming
    ``name`` otherwise."""
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.detach().cpu()
    else:
        try:
            ids = torch.tensor(list(token_ids), dtype=torch.int64)  # type: ignore[arg-type]
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be a 1-D sequence of token ids, got {type(token_ids).__name__}") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be a non-empty 1-D tensor of integer token ids, got shape {tuple(ids.shape)} {ids.dtype}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
        bound = "..." if vocab_size is None else vocab_size
        raise ValueError(f"{name} must hold token ids in [0, {bound}), got {int(ids.min())}..{int(ids.max())}")
    unique = torch.unique(ids)  # sorted
    if unique.numel() != ids.numel():
        raise ValueError(f"{name} must not repeat a token id ({ids.numel() - unique.numel()} repeats)")
    return unique


def frequent_token_ids(
    sequences: Iterable[Sequence[int]], n: int, vocab_size: int, *, fill: bool = False
) -> torch.Tensor:
    """The ``n`` ids seen most often in ``sequences`` (ties: the lower id), most frequent first:
    ``[min(n, distinct ids seen)]`` int64; with ``fill``, ids never seen complete the ``n`` in id
    order (a byte-level BPE numbers its tokens in merge order, roughly by frequency)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
        counts += torch.bincount(ids, minlength=vocab_size)
    seen = int((counts > 0).sum())
    order = torch.argsort(counts, descending=True, stable=True)  # stable: ties (0 too) by id
    return order[: min(n, vocab_size if fill else seen)]


class SubVocabHead(nn.Module):
    """``lm_head``'s rows for ``token_ids`` only, stored as ``lm_head`` is (bf16 packed for the CPU
    kernel, int8, 4-bit or plain); logits of the other tokens are ``-inf``.

    Args:
        lm_head: the full head (``nn.Linear``, ``PackedLinear`` or a quantized linear).
        token_ids: the draft vocabulary (distinct ids, any order; see :func:`check_token_ids`).
        vocab_size: the full vocabulary.
    """

    def __init__(self, lm_head: nn.Module, token_ids: object, vocab_size: int) -> None:
        super().__init__()
        ids = check_token_ids(token_ids, vocab_size)
        self.vocab_size = vocab_size
        self.linear = _rows_of(lm_head, ids)
        device = next(itertools.chain(self.linear.parameters(), self.linear.buffers())).device
        self.register_buffer("token_ids", ids.to(device), persistent=False)

    def sub_logits(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, n]
        """The draft vocabulary's logits, column j for ``token_ids[j]`` (ids ascending, so a
        row's first maximum here is its first maximum over the full vocabulary)."""
        sub = self.linear(x)
        return sub if sub.dtype == torch.float64 else sub.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        sub = self.sub_logits(x)  # [rows, n]
        full = sub.new_full((sub.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_ids, sub)


def _rows_of(source: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A linear layer of ``source``'s rows ``ids``, stored as ``source`` is: int8 and 4-bit rows
    keep their codes (no re-quantization), bf16 is packed for the CPU kernel where it helps."""
    from specdec.kernels.cpu_int8 import unpack_int8
    from specdec.kernels.cpu_q4 import unpack_q4
    from specdec.models.quantized import Int8Linear, Q4Linear

    if isinstance(source, (Int8Linear, Q4Linear)):
        bias = None if source.bias is None else source.bias[ids]
        shape = torch.empty(ids.numel(), source.in_features, dtype=source.weight_dtype, device="meta")
        if isinstance(source, Q4Linear):
            q, d, c = unpack_q4(source.packed, source.out_features)
            return Q4Linear(shape, bias, source.out_dtype, codes=(q[ids], d[ids], c[ids]))
        q = unpack_int8(source.packed, source.out_features, source.in_features)
        return Int8Linear(shape, bias, source.out_dtype, codes=(q[ids], source.scale[ids]))
    weight, bias = linear_weights(source)  # [vocab, hidden] (a copy unless nn.Linear)
    ids = ids.to(weight.device)
    linear = nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight[ids])
        if bias is not None:
            linear.bias.copy_(bias[ids])
    holder = nn.Sequential(linear).requires_grad_(False)
    if should_pack(holder):
        pack_linears(holder)
    return holder[0]
