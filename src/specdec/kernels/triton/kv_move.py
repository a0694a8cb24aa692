"""Move KV slots in a page pool: the compaction of an accepted tree path, every layer at once.

Reference: :meth:`specdec.kv.paged.PagePool.copy_slots` (``index_select`` then ``index_copy_``).
The kernel keeps its semantics exactly: every source row is gathered into a scratch buffer
before any destination is written, so overlapping source and destination slots (a path moving
down onto the slots it came from) are safe. Two launches (gather, scatter), each a grid of
``(layer x K/V, moved slot, row block)``; no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["move_slots"]

_BLOCK = 128


@triton.jit
def _copy_rows(src_ptr, src_index_ptr, dst_ptr, dst_index_ptr, src_rows, dst_rows, row, BLOCK: tl.constexpr):
    """``dst[plane, dst_index[j], :] = src[plane, src_index[j], :]`` for one (plane, j, block);
    ``src``/``dst`` are ``[planes, src_rows | dst_rows, row]`` contiguous."""
    plane = tl.program_id(0)
    j = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < row
    s = tl.load(src_index_ptr + j)
    d = tl.load(dst_index_ptr + j)
    values = tl.load(src_ptr + (plane * src_rows + s) * row + cols, mask=keep)
    tl.store(dst_ptr + (plane * dst_rows + d) * row + cols, values, mask=keep)


def move_slots(
    slots: torch.Tensor,  # [L, 2, num_slots, Hkv, D] contiguous: a PagePool's flat-slot view
    src: torch.Tensor,  # [n] int64 flat slot ids to read
    dst: torch.Tensor,  # [n] int64 distinct flat slot ids to write
) -> None:
    """``slots[:, :, dst] = slots[:, :, src]`` for every layer and K/V, all reads first."""
    n = src.numel()
    if n == 0:
        return
    layers, kv, num_slots = slots.shape[:3]
    row = slots[0, 0, 0].numel()  # Hkv * D
    planes = layers * kv
    flat = slots.view(planes, num_slots, row)
    scratch = torch.empty(planes, n, row, dtype=slots.dtype, device=slots.device)  # [L*2, n, Hkv*D]
    order = torch.arange(n, dtype=torch.int64, device=slots.device)
    grid = (planes, n, triton.cdiv(row, _BLOCK))
    _copy_rows[grid](flat, src, scratch, order, num_slots, n, row, BLOCK=_BLOCK)
    _copy_rows[grid](scratch, order, flat, dst, n, num_slots, row, BLOCK=_BLOCK)
