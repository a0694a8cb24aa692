"""Paged attention on CUDA through FlashInfer (the ``[gpu]`` extra), beside the torch reference.

What this module does on the host is pure and tested on CPUs (:func:`plan_inputs`): the page
CSR from the layout's host copies (never a device read), which wrapper a pass takes (the decode
wrapper when every row is a lone decode row; the paged prefill wrapper for prefills, chain
verification (``causal=True``: FlashInfer aligns a sequence's ``qo_len`` rows with the last
``qo_len`` of its ``kv_len`` slots, ``prefill.cuh``) and tree verification (a custom mask per
sequence over its whole ``[qo_len, kv_len]``, row-major, concatenated)), and the sliding window
(``window_left = W - 1``: a row at position p keeps keys ``p - window_left .. p``,
``variants.cuh``; for tree passes folded into the custom mask). FlashInfer packs the mask
itself (``segment_packbits(..., bitorder="little")``: one byte-aligned segment per sequence);
:func:`pack_bits_little` is that format's reference. The bool mask is passed, not a packed
one: 0.7.2 leaves ``mask_indptr`` in bits when given ``packed_custom_mask`` (flashinfer#2201).
Facts checked against the flashinfer-python 0.7.2.post1 wheel. FlashInfer itself is imported
only when a :class:`FlashInferBackend` is built.

Per-layer windows (Gemma's sliding and global layers, ``AttentionSpec.layer_windows``) plan each
window on its own set of wrappers, and ``AttentionSpec.logits_soft_cap`` (Gemma 2) is passed
as the wrappers' ``logits_soft_cap``; both are written from FlashInfer's documented API and
are not yet run on a GPU.

Plan lifetime: a plan lives until the next :meth:`FlashInferBackend.plan` call on the same
backend (the wrappers keep one plan each in a shared workspace). The engine plans and runs one
model's pass at a time (target pass, then the proposer's passes, each planned right before its
layers run), so target, draft and heads may share one backend; :meth:`run` refuses a stale plan.
"""

from __future__ import annotations

import enum
import itertools

import attrs
import torch

from specdec.attention.layered import LayeredPlan, plan_layers
from specdec.attention.torch_backend import split_tree_mask, visibility_mask, write_kv
from specdec.interfaces import AttentionSpec
from specdec.types import BatchLayout

__all__ = [
    "FlashInferBackend",
    "FlashInferPlan",
    "PassKind",
    "PlanInputs",
    "pack_bits_little",
    "plan_inputs",
    "segment_pack_bits",
    "unpack_bits_little",
]

WORKSPACE_BYTES = 128 * 1024 * 1024


class PassKind(enum.Enum):
    DECODE = "decode"  # one causal row per sequence: BatchDecodeWithPagedKVCacheWrapper
    CAUSAL = "causal"  # prefill / chain verify rows: paged prefill, causal=True
    TREE = "tree"  # some sequence has a tree mask: paged prefill with a packed custom mask


@attrs.frozen(eq=False)
class PlanInputs:
    """Everything FlashInfer's ``plan`` takes for one pass, as CPU tensors."""

    kind: PassKind
    qo_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indices: torch.Tensor  # [num_used_pages] int32
    kv_last_page_len: torch.Tensor  # [batch] int32
    window_left: int  # -1: no sliding window
    custom_mask: torch.Tensor | None = None  # [sum(q_i * kv_i)] bool, TREE only
    mask_indptr: torch.Tensor | None = None  # [batch + 1] int32 offsets into custom_mask, TREE only


def pack_bits_little(bits: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool -> ``[ceil(n / 8)]`` uint8, bit ``j`` of byte ``b`` = ``bits[8 b + j]``
    (numpy's ``packbits(bitorder="little")``, FlashInfer's mask format).

    Example:
        >>> pack_bits_little(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)).tolist()
        [1, 1]
    """
    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
    padded[:n] = bits.reshape(-1).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits_little(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits_little`: ``[n]`` bool."""
    shifts = torch.arange(8, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(1) >> shifts) & 1  # [bytes, 8]
    return bits.reshape(-1)[:n].to(torch.bool)


def plan_inputs(layout: BatchLayout, spec: AttentionSpec) -> PlanInputs:
    """The host side of a FlashInfer plan for ``layout``, from its host copies only."""
    host = layout.host_copy()
    q_lens, kv_lens = layout.q_lens, layout.kv_lens
    i32 = dict(dtype=torch.int32)
    qo_indptr = torch.tensor([0, *itertools.accumulate(q_lens)], **i32)
    window = spec.sliding_window
    common = dict(
        qo_indptr=qo_indptr,
        kv_page_indptr=torch.tensor(host.kv_page_indptr, **i32),
        kv_page_indices=torch.tensor(host.kv_page_indices, **i32),
        kv_last_page_len=torch.tensor(host.kv_last_page_len, **i32),
    )
    if host.tree_mask is None:
        kind = PassKind.DECODE if max(q_lens) == 1 else PassKind.CAUSAL
        return PlanInputs(kind=kind, window_left=-1 if window is None else window - 1, **common)
    blocks = [
        visibility_mask(q, kv, block, window).reshape(-1)  # [q * kv] bool, row-major
        for q, kv, block in zip(q_lens, kv_lens, split_tree_mask(host.tree_mask, q_lens))
    ]
    mask_indptr = torch.tensor([0, *itertools.accumulate(b.numel() for b in blocks)], **i32)
    return PlanInputs(
        kind=PassKind.TREE,
        window_left=-1,  # folded into the custom mask
        custom_mask=torch.cat(blocks),
        mask_indptr=mask_indptr,
        **common,
    )


def segment_pack_bits(mask: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``segment_packbits(mask, indptr, bitorder="little")`` in torch: each
    segment ``mask[indptr[i]:indptr[i+1]]`` packed on its own (padded to whole bytes).

    Returns:
        ``[sum(ceil(len_i / 8))]`` uint8 and the ``[batch + 1]`` int32 byte offsets.
    """
    bounds = indptr.tolist()
    segments = [pack_bits_little(mask[a:b]) for a, b in zip(bounds, bounds[1:])]
    offsets = torch.tensor([0, *itertools.accumulate(s.numel() for s in segments)], dtype=torch.int32)
    return torch.cat(segments), offsets


@attrs.frozen(eq=False)
class FlashInferPlan:
    """One pass's plan: which wrapper runs it, and the backend generation it belongs to."""

    inputs: PlanInputs
    spec: AttentionSpec
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device, where new K/V rows go
    generation: int
    group: int = 0  # the set of wrappers holding it (one per distinct layer window)


class FlashInferBackend:
    """:class:`~specdec.interfaces.AttentionBackend` over FlashInfer's paged wrappers (NHD
    pages, the KV pools' layout), one workspace allocated once.

    Example:
        >>> backend = FlashInferBackend(torch.device("cuda"), torch.bfloat16)
        >>> plan = backend.plan(layout, model.attention_spec)
        >>> out = backend.run(plan, q, k, v, k_pages, v_pages)   # [num_tokens, Hq, D]
    """

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype,
        workspace_bytes: int = WORKSPACE_BYTES,
        *,
        graph_batch: int | None = None,
        graph_rows: int = 1,
        max_pages: int = 0,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """``graph_batch=B`` (with ``max_pages``, the KV pool's page count) makes a backend for
        CUDA graphs (:mod:`specdec.graphs`): it plans passes of exactly ``B`` sequences of
        ``graph_rows=R`` new rows each (R = 1: decode; R > 1: causal, a padded chain verify
        pass) into fixed buffers (a ``use_cuda_graph=True`` decode or prefill wrapper and a
        fixed slot-mapping buffer), so a graph captured over one plan replays correctly after
        the next. ``workspace``: share another backend's (their passes never overlap)."""
        flashinfer = import_flashinfer()
        self.device = torch.device(device)
        self.dtype = dtype
        # Zeroed before first use (FlashInfer's requirement); one float workspace for every
        # wrapper: their passes never overlap (one stream, one pass at a time).
        if workspace is None:
            workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._workspace = workspace
        self.graph_batch = graph_batch
        self._slots: torch.Tensor | None = None
        self.graph_rows = graph_rows
        if graph_batch is not None:
            if graph_batch < 1 or graph_rows < 1 or max_pages < 1:
                raise ValueError(
                    "graph_batch, graph_rows and max_pages must be >= 1, got "
                    f"{graph_batch}, {graph_rows} and {max_pages}"
                )
            self._slots = torch.zeros(graph_batch * graph_rows, dtype=torch.int64, device=self.device)
        self._flashinfer, self._max_pages = flashinfer, max_pages
        # One set of wrappers per distinct layer window (Gemma's sliding and global layers are
        # planned at once, and a wrapper holds one plan); the first set is made here, the
        # others on the first plan that needs them.
        self._groups: list[dict[PassKind, object]] = [self._new_wrappers()]
        self._generation = 0

    def _new_wrappers(self) -> dict[PassKind, object]:
        """One set of wrappers; each has its own int workspace (its plan), all share the float
        workspace (used only while a pass runs, and passes run one at a time)."""
        flashinfer = self._flashinfer
        if self.graph_batch is not None:
            return _graph_wrappers(flashinfer, self._workspace, self.graph_batch, self.graph_rows,
                                   self._max_pages, self.device)  # fmt: skip
        return {
            PassKind.DECODE: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD"),
            PassKind.CAUSAL: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"),
            # Its own wrapper on FA2: "auto" fixes the backend at the first plan (FA3 on
            # Hopper when unmasked), and FA3 takes no custom mask.
            PassKind.TREE: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", backend="fa2"
            ),
        }

    def plan(self, layout: BatchLayout, spec: AttentionSpec) -> FlashInferPlan | LayeredPlan:
        """Plan ``layout``'s pass on the wrapper its kind takes (host work; stales older plans);
        for a spec with ``layer_windows``, one plan per window, each on its own set of
        wrappers, in a :class:`~specdec.attention.layered.LayeredPlan` (untested on a GPU)."""
        self._generation += 1
        slots = layout.slot_mapping.to(device=self.device, dtype=torch.int64)
        if self._slots is not None:  # a graph reads the slots from this fixed buffer
            slots = self._slots.copy_(slots, non_blocking=True)
        return plan_layers(spec, lambda one, group: self._plan_group(layout, one, group, slots))

    def _plan_group(
        self,
        layout: BatchLayout,
        spec: AttentionSpec,  # one window
        group: int,  # which set of wrappers
        slots: torch.Tensor,  # [num_tokens] int64 on the device
    ) -> FlashInferPlan:
        inputs = plan_inputs(layout, spec)
        while len(self._groups) <= group:
            self._groups.append(self._new_wrappers())
        wrappers = self._groups[group]
        if self.graph_batch is not None and (
            inputs.kind not in wrappers
            or layout.batch_size != self.graph_batch
            or set(layout.q_lens) != {self.graph_rows}
        ):
            raise ValueError(
                f"this backend serves CUDA graphs of {self.graph_batch} sequences of "
                f"{self.graph_rows} rows, got a {inputs.kind.name.lower()} pass of "
                f"{layout.batch_size} sequences of {sorted(set(layout.q_lens))} rows"
            )
        heads = (spec.num_qo_heads, spec.num_kv_heads, spec.head_dim, layout.page_size)
        # FlashInfer caps s = sm_scale * q.k as cap * tanh(s / cap), transformers' Gemma 2 order.
        types = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=spec.sm_scale,
                     logits_soft_cap=spec.logits_soft_cap)  # fmt: skip
        wrapper = wrappers[inputs.kind]
        if inputs.kind is PassKind.DECODE:
            wrapper.plan(
                inputs.kv_page_indptr, inputs.kv_page_indices, inputs.kv_last_page_len, *heads,
                window_left=inputs.window_left, **types,
            )  # fmt: skip
        else:
            wrapper.plan(
                inputs.qo_indptr, inputs.kv_page_indptr, inputs.kv_page_indices,
                inputs.kv_last_page_len, *heads,
                causal=inputs.kind is PassKind.CAUSAL,
                custom_mask=None if inputs.custom_mask is None else inputs.custom_mask.to(self.device),
                window_left=inputs.window_left, **types,
            )  # fmt: skip
        return FlashInferPlan(
            inputs=inputs, spec=spec, slot_mapping=slots, generation=self._generation, group=group
        )

    def run(
        self,
        plan: FlashInferPlan,
        q: torch.Tensor,  # [num_tokens, num_qo_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_qo_heads, head_dim]
        """Write the new rows' K/V (an index copy, no host sync), then attend."""
        if plan.generation != self._generation:
            raise RuntimeError(
                "this FlashInfer plan is stale: the backend planned another pass since; plan "
                "and run one pass at a time (see specdec.attention.flashinfer_backend)"
            )
        write_kv(plan, k, v, k_pages, v_pages)
        return self._groups[plan.group][plan.inputs.kind].run(q.contiguous(), (k_pages, v_pages))


def _graph_wrappers(flashinfer, workspace, batch: int, rows: int, max_pages: int, device) -> dict:
    """The one wrapper of a CUDA-graph backend, over fixed CSR buffers (FA2: its kernels do not
    change with the plan, which a captured graph needs)."""
    i32 = dict(dtype=torch.int32, device=device)
    indptr, indices = torch.zeros(batch + 1, **i32), torch.zeros(max_pages, **i32)
    last = torch.zeros(batch, **i32)
    if rows == 1:
        return {PassKind.DECODE: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, backend="fa2", paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
        )}  # fmt: skip
    return {PassKind.CAUSAL: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, backend="fa2",
        qo_indptr_buf=torch.zeros(batch + 1, **i32), paged_kv_indptr_buf=indptr,
        paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last,
    )}  # fmt: skip


def import_flashinfer() -> object:
    """The ``flashinfer`` module, or ImportError saying how to get it."""
    try:
        import flashinfer
    except ImportError as err:
        raise ImportError(
            "the FlashInfer attention backend needs CUDA and the gpu extra: "
            "pip install 'specdec[gpu]' (flashinfer-python==0.7.2.post1, triton); "
            "use specdec.attention.TorchAttentionBackend() otherwise"
        ) from err
    return flashinfer
