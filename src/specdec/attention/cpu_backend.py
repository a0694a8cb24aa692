"""Paged attention on CPUs through a float32 C++ kernel with a batch-invariant reduction order.

The torch reference (:class:`~specdec.attention.torch_backend.TorchAttentionBackend`) attends
for half-precision models in float64: CPU ``scaled_dot_product_attention`` picks different
kernels for one unmasked row and for several masked rows, and in float32 their roundings flip
bf16 near-ties between a verify pass and plain decoding. float64 hides that, slowly. The kernel
in ``kernels/cpu_attention.cpp`` computes each (query row, head) output alone in float32 with a
reduction order fixed by ``head_dim`` and the row's visible slots, so a row of a k+1-row verify
pass is bitwise equal to the same row decoded alone, at any thread count. Measured against
float64 SDPA at Qwen2.5-1.5B's shapes on one thread: 4-13x faster for a decode row, 2-5x for a
5-row verify pass (kv_len 300-1000).

The plan is the torch plan (gather indices, visibility mask) plus each query row's sequence and
index and the per-sequence KV lengths. Where the kernel does not apply (not built, tensors off
the CPU, float64 models such as the tests' tiny references, soft-capped scores: Gemma 2)
:meth:`CpuAttentionBackend.run` is the torch reference. Per-layer windows (Gemma) get one plan
per window (:mod:`specdec.attention.layered`).
"""

from __future__ import annotations

import attrs
import torch

from specdec.attention.batched_plan import row_indices
from specdec.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan, write_kv
from specdec.interfaces import AttentionSpec
from specdec.kernels.cpu_linear import load_kernel
from specdec.types import BatchLayout

__all__ = ["CpuAttentionBackend", "CpuAttentionPlan"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@attrs.frozen(eq=False)
class CpuAttentionPlan:
    """The torch plan of one step plus the per-row metadata the kernel reads."""

    torch_plan: TorchAttentionPlan
    row_seq: torch.Tensor  # [num_tokens] int64, the sequence each query row belongs to
    row_index: torch.Tensor  # [num_tokens] int64, the row's index among its sequence's new rows
    kv_lens: torch.Tensor  # [batch] int64, KV slots of each sequence (new rows included)


class CpuAttentionBackend(TorchAttentionBackend):
    """Batch-invariant float32 paged attention on CPUs (GQA, ragged, trees, sliding windows,
    per layer too).

    Example:
        >>> backend = CpuAttentionBackend()
        >>> plan = backend.plan(layout, model.config.attention_spec)
        >>> out = backend.run(plan, q, k, v, k_pages, v_pages)  # [num_tokens, Hq, D]
    """

    def plan_one(self, layout: BatchLayout, spec: AttentionSpec) -> CpuAttentionPlan:
        """The torch plan plus row/sequence indices (host work, once per model per step and
        window: :meth:`plan` wraps one per window in a ``LayeredPlan`` where layers differ)."""
        q_lens = torch.tensor(layout.q_lens, dtype=torch.int64)  # [batch]
        device = layout.token_ids.device
        return CpuAttentionPlan(
            torch_plan=super().plan_one(layout, spec),
            row_seq=torch.repeat_interleave(torch.arange(len(q_lens)), q_lens).to(device),
            row_index=row_indices(layout.q_lens).to(device),
            kv_lens=torch.tensor(layout.kv_lens, dtype=torch.int64, device=device),
        )

    def run(
        self,
        plan: CpuAttentionPlan,
        q: torch.Tensor,  # [num_tokens, num_qo_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_qo_heads, head_dim]
        """Write the new rows' K/V into the pages, then attend through the kernel."""
        kernel = load_kernel()  # cached after the first call
        tp = plan.torch_plan
        # The kernel has no soft cap (Gemma 2's scores): those layers attend through the
        # reference, in float64 for half-precision models, as batch-invariant as the kernel.
        if kernel is None or tp.spec.logits_soft_cap is not None or not _kernel_applies(q, k_pages):
            return super().run(tp, q, k, v, k_pages, v_pages)
        k_slots, v_slots = write_kv(tp, k, v, k_pages, v_pages)  # [num_slots, Hkv, D]
        return kernel.paged_attention(
            q.contiguous(),
            k_slots,
            v_slots,
            plan.row_seq,
            plan.row_index,
            tp.kv_gather,
            plan.kv_lens,
            tp.mask,
            tp.spec.sm_scale,
        )


def _kernel_applies(
    q: torch.Tensor,  # [num_tokens, num_qo_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
) -> bool:
    """CPU tensors in float32/bf16/f16: float64 keeps the (exact enough) reference."""
    return (
        q.device.type == "cpu"
        and k_pages.device.type == "cpu"
        and q.dtype in _KERNEL_DTYPES
        and k_pages.dtype in _KERNEL_DTYPES
    )
