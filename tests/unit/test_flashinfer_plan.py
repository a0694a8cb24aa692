"""The FlashInfer backend's host side, on the CPU: its plan inputs describe exactly the batch
the torch reference attends over (CSR, which wrapper, causal alignment, sliding window, packed
tree masks), from host copies only; FlashInfer itself is never imported here."""

from __future__ import annotations

import random
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch

from specdec.attention.flashinfer_backend import (
    FlashInferBackend,
    PassKind,
    pack_bits_little,
    plan_inputs,
    segment_pack_bits,
    unpack_bits_little,
)
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.interfaces import AttentionSpec
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager


def _spec(window=None):
    return AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=8, sm_scale=0.3, sliding_window=window)


def _random_tree(rng, n):
    """A [n, n] ancestor-or-self mask of a random tree (parents before children)."""
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def _layout(rng, kind, batch=4, page_size=4):
    kv = KVCacheManager(PageAllocator(256), page_size=page_size)
    seqs, rows, starts, masks = [], [], [], []
    for s in range(batch):
        kv.add_sequence(s)
        start = rng.randrange(0, 40)
        q = 1 if kind == "decode" else rng.randrange(1, 7)
        kv.reserve(s, start + q)
        seqs.append(s)
        rows.append([rng.randrange(100) for _ in range(q)])
        starts.append(start)
        masks.append(_random_tree(rng, q) if kind == "tree" and rng.random() < 0.75 else None)
    if kind == "tree" and all(m is None for m in masks):
        masks[0] = _random_tree(rng, len(rows[0]))
    return kv.build_layout(seqs, rows, starts, tree_masks=masks if kind == "tree" else None)


def _implied_mask(inputs, i, q, kv):
    """What FlashInfer attends to for sequence ``i``: its custom mask, or causal rows aligned
    with the last ``q`` of ``kv`` slots within ``window_left``."""
    if inputs.kind is PassKind.TREE:
        # As the kernel reads it: FlashInfer's packing of the bool mask, byte offsets per sequence.
        packed, offsets = segment_pack_bits(inputs.custom_mask, inputs.mask_indptr)
        a, b = offsets[i].item(), offsets[i + 1].item()
        return unpack_bits_little(packed[a:b], q * kv).view(q, kv)
    pos = torch.arange(kv - q, kv).unsqueeze(1)
    col = torch.arange(kv).unsqueeze(0)
    visible = col <= pos
    if inputs.window_left >= 0:
        visible &= pos - col <= inputs.window_left
    return visible


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", ["decode", "chain", "tree"])
def test_plan_inputs_describe_the_batch_the_reference_attends_over(kind, window):
    rng = random.Random(hash((kind, window)) % 1000)
    for _ in range(20):
        layout = _layout(rng, kind)
        spec = _spec(window)
        inputs = plan_inputs(layout, spec)
        expected_kind = {"decode": PassKind.DECODE, "chain": PassKind.CAUSAL, "tree": PassKind.TREE}[kind]
        if kind == "chain" and max(layout.q_lens) == 1:
            expected_kind = PassKind.DECODE
        assert inputs.kind is expected_kind
        for name in ("qo_indptr", "kv_page_indptr", "kv_page_indices", "kv_last_page_len"):
            got, want = getattr(inputs, name), getattr(layout, name)
            assert got.dtype == torch.int32 and torch.equal(got, want.cpu()), name
        reference = TorchAttentionBackend().plan(layout, spec)
        for i, (q, kv) in enumerate(zip(layout.q_lens, layout.kv_lens)):
            if reference.mask is None:  # one unmasked row: every slot visible
                want = torch.ones(q, kv, dtype=torch.bool)
            else:
                want = reference.mask[i, 0, :q, :kv]
            assert torch.equal(_implied_mask(inputs, i, q, kv), want), (kind, window, i)


def test_bits_pack_like_numpy_little_endian():
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 63, 200):
        bits = rng.random(n) < 0.5
        packed = pack_bits_little(torch.from_numpy(bits))
        assert packed.dtype == torch.uint8
        assert packed.tolist() == np.packbits(bits, bitorder="little").tolist()
        assert unpack_bits_little(packed, n).tolist() == bits.tolist()
    mask = torch.from_numpy(rng.random(30) < 0.5)
    packed, offsets = segment_pack_bits(mask, torch.tensor([0, 9, 9, 30], dtype=torch.int32))
    assert offsets.tolist() == [0, 2, 2, 5]  # each segment padded to whole bytes
    assert packed.tolist() == [
        *np.packbits(mask[:9].numpy(), bitorder="little"), *np.packbits(mask[9:].numpy(), bitorder="little")
    ]


def test_plans_read_host_copies_never_device_tensors():
    """A layout whose device-side CSR and tree mask are unreadable (meta tensors) still plans:
    on a GPU, reading them would be a host sync per model and step."""
    layout = _layout(random.Random(3), "tree")
    meta = torch.empty(0, device="meta")
    poisoned = attrs.evolve(
        layout, kv_page_indptr=meta, kv_page_indices=meta, kv_last_page_len=meta, tree_mask=meta
    )
    inputs = plan_inputs(poisoned, _spec())
    assert torch.equal(inputs.kv_page_indices, layout.kv_page_indices)
    TorchAttentionBackend().plan(attrs.evolve(poisoned, tree_mask=layout.tree_mask), _spec())


def test_building_the_backend_without_flashinfer_says_how_to_get_it():
    pytest.importorskip("torch")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flashinfer is installed here")
    with pytest.raises(ImportError, match=r"pip install 'specdec\[gpu\]'"):
        FlashInferBackend("cpu", torch.bfloat16)


def test_importing_specdec_and_the_backend_never_imports_gpu_packages():
    code = (
        "import sys, specdec, specdec.attention.flashinfer_backend, specdec.distributed;"
        "bad = [m for m in ('flashinfer', 'triton') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class _RecordingWrapper:
    """A stand-in for FlashInfer's paged wrappers: records what it is planned and run with."""

    def __init__(self, workspace, kv_layout, **kwargs) -> None:
        self.plans: list[dict] = []
        self.runs = 0

    def plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)

    def run(self, q, kv):
        self.runs += 1
        return torch.zeros_like(q)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_per_layer_windows_and_soft_cap_reach_the_wrappers(monkeypatch, graph):
    """A spec with a window per layer (Gemma) plans each window on its own set of wrappers
    (window_left W - 1 and -1), passes the soft cap and the scale to every plan, and each layer's
    run goes to its window's wrapper. FlashInfer itself is replaced by a recorder: this checks
    the arguments as written, not the GPU kernels."""
    import types

    from specdec.attention import flashinfer_backend
    from specdec.attention.layered import LayeredPlan, layer_plan

    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_RecordingWrapper,
        BatchPrefillWithPagedKVCacheWrapper=_RecordingWrapper,
    )
    monkeypatch.setattr(flashinfer_backend, "import_flashinfer", lambda: fake)
    layout = _layout(random.Random(4), "decode")
    extra = dict(graph_batch=layout.batch_size, graph_rows=1, max_pages=256) if graph else {}
    backend = FlashInferBackend("cpu", torch.bfloat16, workspace_bytes=64, **extra)
    windows = (5, None, 5, 5)
    spec = attrs.evolve(_spec(), layer_windows=windows, logits_soft_cap=2.0)
    plan = backend.plan(layout, spec)
    assert isinstance(plan, LayeredPlan) and plan.layer_group == (0, 1, 0, 0)
    groups = [layer_plan(plan, i) for i in range(4)]
    assert [p.inputs.window_left for p in groups] == [4, -1, 4, 4]
    wrappers = [backend._groups[g][PassKind.DECODE] for g in (0, 1)]
    assert wrappers[0] is not wrappers[1]
    for wrapper, window_left in zip(wrappers, (4, -1)):
        (planned,) = wrapper.plans
        assert planned["window_left"] == window_left
        assert planned["logits_soft_cap"] == 2.0 and planned["sm_scale"] == 0.3
    pages = torch.zeros(256, 4, 2, 8, dtype=torch.bfloat16)
    q = torch.zeros(layout.num_tokens, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(layout.num_tokens, 2, 8, dtype=torch.bfloat16)
    for p in groups:
        backend.run(p, q, kv, kv, pages, pages)
    assert [w.runs for w in wrappers] == [3, 1]
    uniform = backend.plan(layout, _spec(window=5))  # a spec of one window: one plan, as before
    assert uniform.group == 0 and uniform.inputs.window_left == 4
    assert wrappers[0].plans[-1]["logits_soft_cap"] is None
