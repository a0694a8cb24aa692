"""CUDA graphs of the target's decode pass (one new row per sequence), per batch bucket.

A decode step of a small model on a GPU is mostly kernel launches: hundreds per forward, each
a few microseconds of host time. Capturing the forward once per batch bucket
(:data:`BUCKETS`) and replaying it launches the whole pass at once. A batch of ``n`` rows runs
in the smallest bucket ``B >= n``; the ``B - n`` padding rows decode token 0 at position 0 and
write their K/V to a page of their own (:meth:`DecodeGraphs.pad_page`), so they touch no real
sequence; their logits are dropped. Larger batches, prefill, verification and passes that
need hidden states run eagerly.

What a graph freezes: every tensor address it read at capture. So each bucket has static
input buffers (token ids, positions; the slot mapping lives in its backend's plan) copied
into before replay, and an attention backend that plans into fixed buffers
(:class:`~specdec.attention.flashinfer_backend.FlashInferBackend` with ``graph_batch=B``, a
``use_cuda_graph=True`` decode wrapper). Plans are built before every replay, on the host.

Capture is pluggable (:class:`CudaCapture` on CUDA; :class:`EagerCapture` re-runs the
function, which tests the padding and buffer logic on a CPU). Greedy output with graphs
equals output without them: the padded rows never meet the real ones (attention is per
sequence, every other op per row), which ``benchmarks/gpu/check.py`` checks on a GPU.

Example:
    >>> gen = Generator.from_pretrained(path, device="cuda", cuda_graphs=True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs
import torch

from specdec.interfaces import AttentionBackend
from specdec.types import BatchLayout, LayoutHost

__all__ = [
    "BUCKETS",
    "CudaCapture",
    "DecodeGraphs",
    "EagerCapture",
    "GraphCapture",
    "bucket_for",
    "pad_decode_layout",
]

BUCKETS = (1, 2, 4, 8, 16, 32)
PAD_SEQ_ID = 2**62  # the page-table entry owning the padding rows' page (ids count up from 0)


def bucket_for(batch: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding ``batch`` rows; ``None`` when none does (run eagerly)."""
    return next((b for b in sorted(buckets) if b >= batch), None)


def is_decode(layout: BatchLayout) -> bool:
    """One new row per sequence and no tree mask: the pass the graphs capture."""
    return layout.tree_mask is None and all(q == 1 for q in layout.q_lens)


def pad_decode_layout(layout: BatchLayout, bucket: int, pad_page: int) -> BatchLayout:
    """``layout`` (a decode pass of ``n <= bucket`` rows) with ``bucket - n`` padding rows.

    A padding row decodes token 0 at position 0 into slot 0 of ``pad_page`` and attends to
    that slot alone; tensors stay on the layout's device, host copies are extended alike.
    """
    n = layout.batch_size
    if not is_decode(layout) or n > bucket:
        raise ValueError(f"pad_decode_layout takes a decode layout of at most {bucket} rows")
    pad = bucket - n
    device = layout.token_ids.device
    host = layout.host_copy()

    def extend(t: torch.Tensor, values: list[int]) -> torch.Tensor:
        return torch.cat([t, torch.tensor(values, dtype=t.dtype, device=device)])

    last_pages = host.kv_page_indptr[-1]
    indptr_tail = [last_pages + 1 + i for i in range(pad)]
    return attrs.evolve(
        layout,
        token_ids=extend(layout.token_ids, [0] * pad),
        positions=extend(layout.positions, [0] * pad),
        qo_indptr=extend(layout.qo_indptr, [n + 1 + i for i in range(pad)]),
        kv_page_indptr=extend(layout.kv_page_indptr, indptr_tail),
        kv_page_indices=extend(layout.kv_page_indices, [pad_page] * pad),
        kv_last_page_len=extend(layout.kv_last_page_len, [1] * pad),
        slot_mapping=extend(layout.slot_mapping, [pad_page * layout.page_size] * pad),
        q_lens=layout.q_lens + (1,) * pad,
        kv_lens=layout.kv_lens + (1,) * pad,
        seq_ids=layout.seq_ids + (PAD_SEQ_ID,) * pad if layout.seq_ids else (),
        host=LayoutHost(
            kv_page_indptr=host.kv_page_indptr + tuple(indptr_tail),
            kv_page_indices=host.kv_page_indices + (pad_page,) * pad,
            kv_last_page_len=host.kv_last_page_len + (1,) * pad,
        ),
    )


class GraphCapture(Protocol):
    """Turns a function over static buffers into a replay callable."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class CudaCapture:
    """``torch.cuda.CUDAGraph`` capture after warm-up runs on a side stream; every bucket's
    graph shares one memory pool (only one replays at a time)."""

    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        self.device, self.warmup = device, warmup
        self._pool = None

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # lazy initialisation and autotuning happen here
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        self._pool = graph.pool()
        return graph.replay


class EagerCapture:
    """No graph: replay re-runs the function on the current buffers (CPU tests, debugging)."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        fn()  # a capture runs the function once, as a CUDA capture's warm-up does
        return fn


@attrs.define(eq=False)
class _Bucket:
    """One bucket's static buffers, its backend and its replay."""

    backend: AttentionBackend
    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    logits: torch.Tensor | None = None  # [B, vocab] float32, written by every replay
    plan: object = None  # the plan the next replay uses (its tensors are the backend's buffers)
    replay: Callable[[], None] | None = None


class DecodeGraphs:
    """The target's decode pass as one captured graph per batch bucket.

    Args:
        model: the target (a :class:`~specdec.models.llama.LlamaModel`).
        kv: the target's :class:`~specdec.kv.paged.ModelKV`; one page of its manager is taken
            for the padding rows.
        backends: one attention backend per bucket, planning into fixed buffers.
        capture: how to capture (:class:`CudaCapture` on CUDA).
    """

    def __init__(
        self,
        model,
        kv,
        backends: Mapping[int, AttentionBackend],
        capture: GraphCapture,
    ) -> None:
        self.model, self.kv, self.capture = model, kv, capture
        self.buckets = tuple(sorted(backends))
        manager = kv.manager
        manager.add_sequence(PAD_SEQ_ID)
        manager.reserve(PAD_SEQ_ID, 1)
        (self.pad_page,) = manager.page_table(PAD_SEQ_ID)
        device = model.device
        self._buckets = {
            b: _Bucket(
                backend=backends[b],
                token_ids=torch.zeros(b, dtype=torch.int64, device=device),
                positions=torch.zeros(b, dtype=torch.int64, device=device),
            )
            for b in self.buckets
        }

    def applies(self, layout: BatchLayout) -> bool:
        """Whether :meth:`run` takes this pass (a decode pass no larger than the top bucket)."""
        return is_decode(layout) and bucket_for(layout.batch_size, self.buckets) is not None

    def run(self, layout: BatchLayout) -> torch.Tensor:  # [batch, vocab] float32
        """The logits of every row of a decode pass, through its bucket's graph."""
        size = bucket_for(layout.batch_size, self.buckets)
        if size is None or not is_decode(layout):
            raise ValueError("DecodeGraphs.run takes decode passes of at most "
                             f"{self.buckets[-1]} rows; check applies() first")  # fmt: skip
        bucket = self._buckets[size]
        padded = pad_decode_layout(layout, size, self.pad_page)
        bucket.token_ids.copy_(padded.token_ids, non_blocking=True)
        bucket.positions.copy_(padded.positions, non_blocking=True)
        static = attrs.evolve(padded, token_ids=bucket.token_ids, positions=bucket.positions)
        bucket.plan = bucket.backend.plan(static, self.model.attention_spec)
        if bucket.replay is None:
            bucket.replay = self.capture.capture(lambda: self._forward(bucket, static))
        else:
            bucket.replay()
        return bucket.logits[: layout.batch_size].clone()  # the next replay overwrites it

    def _forward(self, bucket: _Bucket, static: BatchLayout) -> None:
        """The captured function: the model over the bucket's buffers and current plan."""
        with torch.inference_mode():  # as the model's own forward: the buffer is one of its tensors
            out = self.model(static, self.kv, bucket.backend, bucket.plan)
            if bucket.logits is None:
                bucket.logits = out.logits  # the graph's own output buffer
            else:
                bucket.logits.copy_(out.logits)

    def release(self) -> None:
        """Give the padding page back (the generator is being closed)."""
        self.kv.manager.free(PAD_SEQ_ID)
