"""Pure-PyTorch paged attention: the specification every fast backend is tested against.

The ragged batch is padded into ``[batch, max_q]`` query rows and ``[batch, max_kv]`` KV slots
gathered from the pages; one boolean mask carries causality, tree visibility, sliding windows
and padding, and ``scaled_dot_product_attention`` does the rest (:func:`soft_capped_attention`
where the spec caps the scores, which SDPA cannot). All index and mask tensors are built once per
step in :meth:`TorchAttentionBackend.plan` (per window where layers differ, see
:mod:`specdec.attention.layered`), for the whole batch at once
(:mod:`specdec.attention.batched_plan`; :func:`visibility_mask` states the rule for one
sequence); :meth:`run` only indexes and attends.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specdec.attention.batched_plan import (
    batch_visibility,
    gather_slots,
    padded_rows,
    padded_tree_masks,
)
from specdec.attention.layered import LayeredPlan, plan_layers
from specdec.interfaces import AttentionSpec
from specdec.types import BatchLayout

__all__ = [
    "TorchAttentionBackend",
    "TorchAttentionPlan",
    "soft_capped_attention",
    "split_tree_mask",
    "visibility_mask",
]


@attrs.frozen(eq=False)
class TorchAttentionPlan:
    """Precomputed gather/scatter indices and the visibility mask for one step of one model."""

    spec: AttentionSpec
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new row's K/V is written
    kv_gather: torch.Tensor  # [batch, max_kv] int64 flat pool slots (padding reads slot 0)
    q_scatter: torch.Tensor | None  # [num_tokens] int64 into [batch * max_q]; None if unpadded
    mask: torch.Tensor | None  # [batch, 1, max_q, max_kv] bool (True = visible); None = all visible
    batch_size: int
    max_q: int


def visibility_mask(
    q_len: int,
    kv_len: int,
    tree_mask: torch.Tensor | None = None,  # [q_len, q_len] bool
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, kv_len] bool
    """Which KV slots each new row of one sequence may attend to.

    New row ``r`` sits at slot ``kv_len - q_len + r``. Causal rows see every slot up to their
    own; tree rows see the prefix and the new rows their tree mask marks. A sliding window
    hides keys more than ``sliding_window - 1`` positions before the row's own position: a
    slot's position, except for tree rows, whose position is the prefix length plus their
    depth (the tree rows their mask marks, less themselves; a deep node's slot comes later).
    """
    start = kv_len - q_len
    row_slot = torch.arange(start, kv_len).unsqueeze(1)  # [q_len, 1]
    col = torch.arange(kv_len).unsqueeze(0)  # [1, kv_len]
    visible = col <= row_slot
    if tree_mask is not None:
        visible = visible.clone()
        visible[:, start:] = tree_mask.to(torch.bool)
    if sliding_window is not None:
        position = torch.arange(kv_len)  # [kv_len]
        if tree_mask is not None:
            position[start:] = start + tree_mask.to(torch.int64).sum(-1) - 1
        visible &= position.unsqueeze(0) > position[start:].unsqueeze(1) - sliding_window
    return visible


class TorchAttentionBackend:
    """Reference paged attention on any device PyTorch runs on (GQA, ragged, trees, per-layer
    windows, soft-capped scores)."""

    def plan(self, layout: BatchLayout, spec: AttentionSpec) -> TorchAttentionPlan | LayeredPlan:
        """Build indices and masks for one step (host work, once per model per step); a
        :class:`~specdec.attention.layered.LayeredPlan` of one plan per window for a spec with
        ``layer_windows``."""
        return plan_layers(spec, lambda one, _: self.plan_one(layout, one))

    def plan_one(self, layout: BatchLayout, spec: AttentionSpec) -> TorchAttentionPlan:
        """:meth:`plan` for a spec of one attention (its ``sliding_window`` on every layer)."""
        q_lens, kv_lens, page_size = layout.q_lens, layout.kv_lens, layout.page_size
        batch, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)
        device = layout.token_ids.device

        host = layout.host_copy()  # never a device sync for layouts the KV manager built
        needs_mask = (
            batch > 1
            or max_q > 1
            or host.tree_mask is not None
            or (spec.sliding_window is not None and max_kv > spec.sliding_window)
        )
        mask = None
        if batch == 1:
            # One sequence (a batch-1 decode, every draft step): the per-sequence rule itself
            # takes a third of the batched functions' tensor operations (0.07 against 0.12 ms).
            first, end = host.kv_page_indptr[0], host.kv_page_indptr[1]
            pages = torch.tensor(host.kv_page_indices[first:end], dtype=torch.int64)
            gather = (pages.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()[None, :max_kv]
            if needs_mask:
                tree = split_tree_mask(host.tree_mask, q_lens)[0]
                mask = visibility_mask(max_q, max_kv, tree, spec.sliding_window)[None, None].to(device)
        else:
            gather = gather_slots(host.kv_page_indices, host.kv_page_indptr, kv_lens, page_size)
            if needs_mask:
                trees = None if host.tree_mask is None else padded_tree_masks(host.tree_mask, q_lens)
                mask = batch_visibility(q_lens, kv_lens, trees, spec.sliding_window).unsqueeze(1).to(device)

        q_scatter = None
        if batch > 1 and any(q != max_q for q in q_lens):
            q_scatter = padded_rows(q_lens).to(device)
        return TorchAttentionPlan(
            spec=spec,
            slot_mapping=layout.slot_mapping.to(device=device, dtype=torch.int64),
            kv_gather=gather.to(device),
            q_scatter=q_scatter,
            mask=mask,
            batch_size=batch,
            max_q=max_q,
        )

    def run(
        self,
        plan: TorchAttentionPlan,
        q: torch.Tensor,  # [num_tokens, num_qo_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_qo_heads, head_dim]
        """Write the new rows' K/V into the pages, then attend over the visible slots."""
        spec = plan.spec
        k_slots, v_slots = write_kv(plan, k, v, k_pages, v_pages)

        batch, max_q = plan.batch_size, plan.max_q
        keys = k_slots[plan.kv_gather].transpose(1, 2)  # [batch, Hkv, max_kv, D]
        values = v_slots[plan.kv_gather].transpose(1, 2)
        if plan.q_scatter is None:
            queries = q.view(batch, max_q, spec.num_qo_heads, spec.head_dim)
        else:
            padded = q.new_zeros(batch * max_q, spec.num_qo_heads, spec.head_dim)
            queries = padded.index_copy_(0, plan.q_scatter, q).view(
                batch, max_q, spec.num_qo_heads, spec.head_dim
            )
        # Half-precision models attend in float64: CPU SDPA picks different kernels for one
        # row without a mask and several rows with one, and in float32 their roundings differ
        # enough to flip a bf16 near-tie between a verify pass and plain decoding. In float64
        # the result rounds to the same bf16 values whatever the row count (measured: the
        # prompt-lookup mismatch at token 67 of HumanEval/0 disappears).
        compute = torch.float64 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        args = (queries.transpose(1, 2).to(compute), keys.to(compute), values.to(compute))  # [batch, H, rows, D]
        gqa = spec.num_qo_heads != spec.num_kv_heads
        if spec.logits_soft_cap is None:
            out = F.scaled_dot_product_attention(*args, attn_mask=plan.mask, scale=spec.sm_scale, enable_gqa=gqa)
        else:
            out = soft_capped_attention(*args, attn_mask=plan.mask, scale=spec.sm_scale,
                                        soft_cap=spec.logits_soft_cap, enable_gqa=gqa)  # fmt: skip
        out = out.to(q.dtype).transpose(1, 2).reshape(batch * max_q, spec.num_qo_heads, spec.head_dim)
        return out if plan.q_scatter is None else out[plan.q_scatter]


def soft_capped_attention(
    q: torch.Tensor,  # [batch, Hq, max_q, D]
    k: torch.Tensor,  # [batch, Hkv, max_kv, D]
    v: torch.Tensor,  # [batch, Hkv, max_kv, D]
    *,
    attn_mask: torch.Tensor | None,  # [batch, 1, max_q, max_kv] bool (True = visible)
    scale: float,
    soft_cap: float,
    enable_gqa: bool,
) -> torch.Tensor:  # [batch, Hq, max_q, D]
    """Attention whose scores are capped before the mask, as transformers' eager Gemma 2
    attention computes them: ``s = scale * q.k``, ``s = soft_cap * tanh(s / soft_cap)``, then
    the masked softmax (SDPA has no soft cap)."""
    if enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, Hq, max_q, max_kv]
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def write_kv(
    plan: TorchAttentionPlan,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v slots [num_slots, num_kv_heads, head_dim]
    """Write the new rows' K/V at ``plan.slot_mapping``; return the pages as flat slot views."""
    spec = plan.spec
    k_slots = k_pages.view(-1, spec.num_kv_heads, spec.head_dim)
    v_slots = v_pages.view(-1, spec.num_kv_heads, spec.head_dim)
    k_slots.index_copy_(0, plan.slot_mapping, k.to(k_slots.dtype))
    v_slots.index_copy_(0, plan.slot_mapping, v.to(v_slots.dtype))
    return k_slots, v_slots


def split_tree_mask(
    flat: torch.Tensor | None,  # [sum(q_len_i ** 2)] bool on the CPU
    q_lens: tuple[int, ...],
) -> list[torch.Tensor | None]:  # per sequence [q_len, q_len] bool, or None (causal)
    """Cut the flattened per-sequence ``[q_len, q_len]`` tree blocks apart (None if causal)."""
    if flat is None:
        return [None] * len(q_lens)
    blocks, offset = [], 0
    for q_len in q_lens:
        blocks.append(flat[offset : offset + q_len * q_len].view(q_len, q_len))
        offset += q_len * q_len
    return blocks
