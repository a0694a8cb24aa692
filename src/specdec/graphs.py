"""CUDA graphs of the target's decode and chain-verify passes, per batch bucket and row count.

A decode step of a small model on a GPU is mostly kernel launches: hundreds per forward, each
a few microseconds of host time. Capturing the forward once per (batch bucket, rows per
sequence) and replaying it launches the whole pass at once. A pass qualifies when every
sequence has the same number ``R`` of new rows (decode: 1; a chain verify pass whose drafts
the engine padded to the step's width: ``k + 1``) and there is no tree mask. ``n`` sequences
run in the smallest bucket ``B >= n`` of :data:`BUCKETS`; each of the ``B - n`` padding
sequences decodes token 0 at positions ``0 .. R - 1`` into pages of its own
(:attr:`PassGraphs.pad_pages`), so it touches no real sequence; its logits are dropped.
Larger batches, prefill, tree passes and passes that need hidden states run eagerly.

What a graph freezes: every tensor address it read at capture. So each (bucket, rows) has
static input buffers (token ids, positions; the slot mapping lives in its backend's plan)
copied into before replay, and an attention backend that plans into fixed buffers
(:class:`~specdec.attention.flashinfer_backend.FlashInferBackend` with ``graph_batch=B`` and
``graph_rows=R``: a ``use_cuda_graph=True`` decode or causal prefill wrapper). Plans are built
before every replay, on the host. Graphs are captured on first use of a (bucket, rows) pair.

Capture is pluggable (:class:`CudaCapture` on CUDA; :class:`EagerCapture` re-runs the
function, which tests the padding and buffer logic on a CPU). Greedy output with graphs
equals output without them: the padded rows never meet the real ones (attention is per
sequence, every other op per row), which ``benchmarks/gpu/check.py`` checks on a GPU.

Example:
    >>> gen = Generator.from_pretrained(path, device="cuda", cuda_graphs=True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from specdec.interfaces import AttentionBackend
from specdec.types import BatchLayout, LayoutHost

__all__ = [
    "BUCKETS",
    "CudaCapture",
    "EagerCapture",
    "GraphCapture",
    "PassGraphs",
    "bucket_for",
    "pad_uniform_layout",
    "uniform_rows",
]

BUCKETS = (1, 2, 4, 8, 16, 32)
PAD_SEQ_ID = 2**62  # the page-table entry owning the padding rows' pages (ids count up from 0)
MAX_ROWS = 9  # rows per sequence graphed: decode and chain verification up to k = 8


def bucket_for(batch: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket holding ``batch`` rows; ``None`` when none does (run eagerly)."""
    return next((b for b in sorted(buckets) if b >= batch), None)


def uniform_rows(layout: BatchLayout) -> int | None:
    """The rows per sequence when every sequence has as many and there is no tree mask."""
    rows = set(layout.q_lens)
    return rows.pop() if len(rows) == 1 and layout.tree_mask is None else None


def pad_uniform_layout(layout: BatchLayout, bucket: int, pad_pages: Sequence[int]) -> BatchLayout:
    """``layout`` (``n <= bucket`` sequences of ``R`` new rows each) with ``bucket - n`` padding
    sequences: each decodes token 0 at positions ``0 .. R - 1`` into slots ``0 .. R - 1`` of
    ``pad_pages`` (enough of them for ``R`` slots) and attends to those slots alone. Tensors stay
    on the layout's device; host copies are extended alike."""
    n, rows, ps = layout.batch_size, uniform_rows(layout), layout.page_size
    if rows is None or n > bucket:
        raise ValueError(
            f"pad_uniform_layout takes at most {bucket} sequences of equal rows and no tree mask"
        )
    pages = tuple(pad_pages[: -(-rows // ps)])  # ceil(rows / page_size)
    if len(pages) * ps < rows:
        raise ValueError(f"{rows} padding rows need {-(-rows // ps)} pages, got {len(pad_pages)}")
    pad = bucket - n
    device = layout.token_ids.device
    host = layout.host_copy()

    def extend(t: torch.Tensor, values: list[int]) -> torch.Tensor:
        return torch.cat([t, torch.tensor(values, dtype=t.dtype, device=device)])

    slots = [pages[r // ps] * ps + r % ps for r in range(rows)]
    last_len = rows - (len(pages) - 1) * ps
    last_pages = host.kv_page_indptr[-1]
    indptr_tail = [last_pages + len(pages) * (i + 1) for i in range(pad)]
    return attrs.evolve(
        layout,
        token_ids=extend(layout.token_ids, [0] * (pad * rows)),
        positions=extend(layout.positions, list(range(rows)) * pad),
        qo_indptr=extend(layout.qo_indptr, [(n + 1 + i) * rows for i in range(pad)]),
        kv_page_indptr=extend(layout.kv_page_indptr, indptr_tail),
        kv_page_indices=extend(layout.kv_page_indices, list(pages) * pad),
        kv_last_page_len=extend(layout.kv_last_page_len, [last_len] * pad),
        slot_mapping=extend(layout.slot_mapping, slots * pad),
        q_lens=layout.q_lens + (rows,) * pad,
        kv_lens=layout.kv_lens + (rows,) * pad,
        seq_ids=layout.seq_ids + (PAD_SEQ_ID,) * pad if layout.seq_ids else (),
        host=LayoutHost(
            kv_page_indptr=host.kv_page_indptr + tuple(indptr_tail),
            kv_page_indices=host.kv_page_indices + pages * pad,
            kv_last_page_len=host.kv_last_page_len + (last_len,) * pad,
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
class _Graph:
    """One (bucket, rows) pair's static buffers, its backend and its replay."""

    backend: AttentionBackend
    token_ids: torch.Tensor  # [B * R] int64
    positions: torch.Tensor  # [B * R] int64
    logits: torch.Tensor | None = None  # [B * R, vocab] float32, written by every replay
    plan: object = None  # the plan the next replay uses (its tensors are the backend's buffers)
    replay: Callable[[], None] | None = None


class PassGraphs:
    """The target's uniform passes (decode, padded chain verification) as captured graphs.

    Args:
        model: the target (a :class:`~specdec.models.llama.LlamaModel`).
        kv: the target's :class:`~specdec.kv.paged.ModelKV`; pages of its manager are taken
            for the padding sequences (enough for :data:`MAX_ROWS` rows).
        backend_for: ``(bucket, rows) -> AttentionBackend`` planning into fixed buffers,
            called once per pair on first use.
        capture: how to capture (:class:`CudaCapture` on CUDA).
        buckets: the batch buckets; ``max_rows``: the most rows per sequence graphed.
        head: replaces the model's LM head in every pass (a draft vocabulary).
    """

    def __init__(
        self,
        model,
        kv,
        backend_for: Callable[[int, int], AttentionBackend],
        capture: GraphCapture,
        *,
        buckets: Sequence[int] = BUCKETS,
        max_rows: int = MAX_ROWS,
        head: torch.nn.Module | None = None,
    ) -> None:
        if getattr(getattr(model, "config", None), "moe", None) is not None:
            raise ValueError(
                "cuda_graphs=True is not supported for qwen3_moe (Qwen3-MoE) models: each pass "
                "reads on the host which experts its tokens chose, which a captured graph would "
                "freeze; use cuda_graphs=False"
            )
        self.model, self.kv, self.capture, self.head = model, kv, capture, head
        self.backend_for = backend_for
        self.buckets = tuple(sorted(buckets))
        self.max_rows = max_rows
        manager = kv.manager
        if not manager.has_sequence(PAD_SEQ_ID):  # pools share page ids: one set serves all
            manager.add_sequence(PAD_SEQ_ID)
        manager.reserve(PAD_SEQ_ID, max_rows)
        self.pad_pages = manager.page_table(PAD_SEQ_ID)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def takes(self, batch: int, rows: int) -> bool:
        """Whether a pass of ``batch`` sequences of ``rows`` new rows each replays a graph."""
        return 1 <= rows <= self.max_rows and bucket_for(batch, self.buckets) is not None

    def applies(self, layout: BatchLayout) -> bool:
        """Whether :meth:`run` takes this pass."""
        rows = uniform_rows(layout)
        return rows is not None and self.takes(layout.batch_size, rows)

    def run(self, layout: BatchLayout) -> torch.Tensor:  # [num_tokens, vocab] float32
        """The logits of every row of the pass, through its (bucket, rows) graph."""
        if not self.applies(layout):
            raise ValueError("PassGraphs.run takes uniform passes of at most "
                             f"{self.buckets[-1]} sequences; check applies() first")  # fmt: skip
        rows = uniform_rows(layout)
        size = bucket_for(layout.batch_size, self.buckets)
        graph = self._graphs.get((size, rows)) or self._new(size, rows)
        padded = pad_uniform_layout(layout, size, self.pad_pages)
        graph.token_ids.copy_(padded.token_ids, non_blocking=True)
        graph.positions.copy_(padded.positions, non_blocking=True)
        static = attrs.evolve(padded, token_ids=graph.token_ids, positions=graph.positions)
        graph.plan = graph.backend.plan(static, self.model.attention_spec)
        if graph.replay is None:
            graph.replay = self.capture.capture(lambda: self._forward(graph, static))
        else:
            graph.replay()
        return graph.logits[: layout.num_tokens].clone()  # the next replay overwrites it

    def _new(self, size: int, rows: int) -> _Graph:
        device = self.model.device
        graph = _Graph(
            backend=self.backend_for(size, rows),
            token_ids=torch.zeros(size * rows, dtype=torch.int64, device=device),
            positions=torch.zeros(size * rows, dtype=torch.int64, device=device),
        )
        self._graphs[size, rows] = graph
        return graph

    def _forward(self, graph: _Graph, static: BatchLayout) -> None:
        """The captured function: the model over the pair's buffers and current plan."""
        with torch.inference_mode():  # as the model's own forward: the buffer is one of its tensors
            out = self.model(static, self.kv, graph.backend, graph.plan, head=self.head)
            if graph.logits is None:
                graph.logits = out.logits  # the graph's own output buffer
            else:
                graph.logits.copy_(out.logits)

    def release(self) -> None:
        """Give the padding pages back (the generator is being closed)."""
        if self.kv.manager.has_sequence(PAD_SEQ_ID):
            self.kv.manager.free(PAD_SEQ_ID)
