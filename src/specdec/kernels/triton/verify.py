"""Greedy chain verification on the device in one launch: the target's argmax at every verify
row, the accepted prefix and the emitted tokens, with no host sync.

Reference: :func:`specdec.verify.chain.greedy_verify` (``argmax`` then
:func:`~specdec.verify.chain.match_verify`). Ties go to the lowest token id, as
``torch.argmax`` breaks them. One program per sequence: it scans each of its ``width + 1``
rows' logits in blocks of the vocabulary, keeping the running maximum and its first index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.types import PAD_TOKEN_ID

__all__ = ["greedy_chain_verify"]

_BLOCK_V = 1024


@triton.jit
def _greedy_chain(
    logits_ptr,  # [batch, width + 1, vocab]
    drafts_ptr,  # [batch, width] int64
    counts_ptr,  # [batch] int64
    accepted_ptr,  # [batch] int64 (out)
    emitted_ptr,  # [batch, width + 1] int64 (out)
    width,
    vocab,
    pad,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    count = tl.load(counts_ptr + seq)
    accepted = tl.zeros((), dtype=tl.int64)
    matching = count > 0
    final = tl.zeros((), dtype=tl.int64)
    for row in range(0, width + 1):
        base = logits_ptr + (seq * (width + 1) + row) * vocab
        best = tl.full((), float("-inf"), dtype=tl.float32)
        best_id = tl.zeros((), dtype=tl.int64)
        for start in range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            values = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            block_best = tl.max(values, axis=0)
            # The first column holding the block's maximum (ties: lowest id).
            block_id = tl.min(tl.where(values == block_best, cols, vocab), axis=0).to(tl.int64)
            better = block_best > best  # strict: an earlier block keeps a tie
            best_id = tl.where(better, block_id, best_id)
            best = tl.where(better, block_best, best)
        # Row `row` judges draft `row`; the first row that is not accepted emits its argmax.
        # (Masked loads and selects, no branches: the compiled and interpreted kernels agree.)
        final = tl.where(row == accepted, best_id, final)
        draft = tl.load(drafts_ptr + seq * width + row, mask=row < width, other=pad)
        matching = matching & (row < count) & (draft == best_id)
        accepted = tl.where(matching, accepted + 1, accepted)
    tl.store(accepted_ptr + seq, accepted)
    for col in range(0, width + 1):
        draft = tl.load(drafts_ptr + seq * width + col, mask=col < width, other=pad)
        token = tl.where(col < accepted, draft, tl.where(col == accepted, final, pad))
        tl.store(emitted_ptr + seq * (width + 1) + col, token)


def greedy_chain_verify(
    target_logits: torch.Tensor,  # [batch, width + 1, vocab] float
    draft_token_ids: torch.Tensor,  # [batch, width] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64 on the device
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch] int64, [batch, width + 1] int64
    """``(num_accepted, emitted)`` as :func:`~specdec.verify.chain.greedy_verify` returns them,
    computed on the logits' device (the counts stay there too: no host sync)."""
    batch, rows, vocab = target_logits.shape
    accepted = torch.empty(batch, dtype=torch.int64, device=target_logits.device)
    emitted = torch.empty(batch, rows, dtype=torch.int64, device=target_logits.device)
    _greedy_chain[(batch,)](
        target_logits.contiguous(),
        draft_token_ids.to(torch.int64).contiguous(),
        num_draft_tokens.to(torch.int64).contiguous(),
        accepted,
        emitted,
        rows - 1,
        vocab,
        PAD_TOKEN_ID,
        BLOCK_V=_BLOCK_V,
    )
    return accepted, emitted
