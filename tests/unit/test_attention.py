"""The torch paged-attention backend against dense attention computed from scratch."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.attention import TorchAttentionBackend
from specdec.attention.torch_backend import visibility_mask
from specdec.interfaces import AttentionSpec
from specdec.kv import KVCacheManager, KVSpec, PageAllocator

HQ, HKV, D = 4, 2, 8


def _dense_reference(q, k, v, visible):
    """Plain softmax attention with GQA: q [q_len, Hq, D], k/v [kv_len, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _fragmented_manager(num_pages: int, page_size: int, seed: int):
    """A manager whose free list hands pages out in a scrambled order."""
    allocator = PageAllocator(num_pages)
    manager = KVCacheManager(allocator, page_size)
    pool = manager.add_pool(KVSpec(name="t", num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.float64))
    # Take every page, then give them back shuffled so later tables are out of order.
    pages = allocator.allocate(num_pages)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    allocator.free([pages[i] for i in perm])
    return manager, pool


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_matches_dense(page_size):
    """Prefill rows, single-token decode rows and multi-token verify rows in one batch."""
    g = torch.Generator().manual_seed(page_size)
    manager, kv = _fragmented_manager(256, page_size, seed=page_size)
    spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, sm_scale=D**-0.5)
    backend = TorchAttentionBackend()
    # (cached prefix length, new rows): a prefill, a decode, a verify pass, another prefill.
    shapes = [(0, 13), (21, 1), (9, 5), (0, 1)]
    history = {}
    for sid, (prefix, _) in enumerate(shapes):
        manager.add_sequence(sid)
        manager.reserve(sid, prefix)
        k_old = torch.randn(prefix, HKV, D, generator=g, dtype=torch.float64)
        v_old = torch.randn(prefix, HKV, D, generator=g, dtype=torch.float64)
        if prefix:
            slots = torch.tensor(manager.slot_ids(sid, list(range(prefix))))
            k_pages, v_pages = kv.layer(0)
            k_pages.view(-1, HKV, D)[slots] = k_old
            v_pages.view(-1, HKV, D)[slots] = v_old
        history[sid] = (k_old, v_old)
    for sid, (prefix, new) in enumerate(shapes):
        manager.reserve(sid, prefix + new)
    layout = kv.layout(
        list(range(len(shapes))), [[0] * n for _, n in shapes], [p for p, _ in shapes]
    )
    total = layout.num_tokens
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    out = backend.run(backend.plan(layout, spec), q, k, v, *kv.layer(0))
    offset = 0
    for sid, (prefix, new) in enumerate(shapes):
        rows = slice(offset, offset + new)
        k_all = torch.cat([history[sid][0], k[rows]])
        v_all = torch.cat([history[sid][1], v[rows]])
        ref = _dense_reference(q[rows], k_all, v_all, visibility_mask(new, prefix + new))
        torch.testing.assert_close(out[rows], ref, rtol=1e-10, atol=1e-10)
        offset += new


def test_tree_mask_and_sliding_window_match_dense():
    g = torch.Generator().manual_seed(7)
    manager, kv = _fragmented_manager(64, 4, seed=3)
    # Root (row 0) with children 1, 2; row 3 is a child of 1.
    tree = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    prefix, window = 10, 6
    for spec_window in (None, window):
        spec = AttentionSpec(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, sm_scale=0.3, sliding_window=spec_window)
        sid = 0 if spec_window is None else 1
        manager.add_sequence(sid)
        manager.reserve(sid, prefix + 4)
        k_pages, v_pages = kv.layer(0)
        slots = torch.tensor(manager.slot_ids(sid, list(range(prefix))))
        k_old = torch.randn(prefix, HKV, D, generator=g, dtype=torch.float64)
        v_old = torch.randn(prefix, HKV, D, generator=g, dtype=torch.float64)
        k_pages.view(-1, HKV, D)[slots] = k_old
        v_pages.view(-1, HKV, D)[slots] = v_old
        layout = kv.layout([sid], [[0] * 4], [prefix], positions=[[10, 11, 11, 12]], tree_masks=[tree])
        q = torch.randn(4, HQ, D, generator=g, dtype=torch.float64)
        k = torch.randn(4, HKV, D, generator=g, dtype=torch.float64)
        v = torch.randn(4, HKV, D, generator=g, dtype=torch.float64)
        backend = TorchAttentionBackend()
        out = backend.run(backend.plan(layout, spec), q, k, v, k_pages, v_pages)
        visible = visibility_mask(4, prefix + 4, tree, spec_window)
        rep = HQ // HKV
        k_all = torch.cat([k_old, k]).repeat_interleave(rep, dim=1)
        v_all = torch.cat([v_old, v]).repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_all) * 0.3
        ref = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v_all
        )
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        # Row 2 must not see its sibling (row 1): the tree mask is really applied.
        assert not visible[2, prefix + 1]


def test_visibility_mask_rules():
    m = visibility_mask(3, 5)
    assert m.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    w = visibility_mask(1, 5, sliding_window=2)
    assert w.tolist() == [[False, False, False, True, True]]


def test_a_window_counts_a_tree_rows_position_not_its_slot():
    """A tree row's position is the prefix length plus its depth, wherever its slot: the second
    child (slot 8) and the grandchild (slot 9) of a 6-slot prefix sit at positions 7 and 8, so a
    window of 4 shows them prefix slots 4-5 and 5 (counted by slot, one fewer each)."""
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    m = visibility_mask(4, 10, tree, sliding_window=4)
    f, t = False, True
    assert m.tolist() == [
        [f, f, f, t, t, t, t, f, f, f],  # root, position 6
        [f, f, f, f, t, t, t, t, f, f],  # first child, position 7
        [f, f, f, f, t, t, t, f, t, f],  # second child, position 7
        [f, f, f, f, f, t, t, f, t, t],  # its child, position 8
    ]
