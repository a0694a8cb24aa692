"""The batched gather indices and visibility mask equal the per-sequence rule, sequence by
sequence (ragged batches, trees, sliding windows, shuffled pages)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.attention_plan import random_tree
from specdec.attention.batched_plan import (
    batch_visibility,
    gather_slots,
    padded_rows,
    padded_tree_masks,
    row_indices,
)
from specdec.attention.torch_backend import TorchAttentionBackend, split_tree_mask, visibility_mask
from specdec.interfaces import AttentionSpec
from specdec.types import BatchLayout, LayoutHost


def scene(seed: int, trees: bool):
    rng = random.Random(seed)
    batch, page_size = rng.randint(1, 6), rng.choice([1, 2, 3, 16])
    q_lens = [rng.randint(1, 5) for _ in range(batch)]
    kv_lens = [q + rng.randint(0, 20) for q in q_lens]
    need = [-(-kv // page_size) + rng.randint(0, 1) for kv in kv_lens]  # a spare page at times
    pool = list(range(sum(need) + 5))
    rng.shuffle(pool)
    indptr = [0]
    for n in need:
        indptr.append(indptr[-1] + n)
    pages = pool[: indptr[-1]]
    flat = torch.cat([random_tree(q, rng).flatten() for q in q_lens]) if trees else None
    return q_lens, kv_lens, pages, indptr, page_size, flat


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), trees=st.booleans(), window=st.sampled_from([None, 1, 3, 8]))
def test_the_batched_plan_equals_the_per_sequence_rule(seed, trees, window):
    q_lens, kv_lens, pages, indptr, page_size, flat = scene(seed, trees)
    gather = gather_slots(pages, indptr, kv_lens, page_size)
    blocks = split_tree_mask(flat, tuple(q_lens))
    padded = None if flat is None else padded_tree_masks(flat, q_lens)
    mask = batch_visibility(q_lens, kv_lens, padded, window)
    max_q, max_kv = max(q_lens), max(kv_lens)
    assert gather.shape == (len(q_lens), max_kv) and mask.shape == (len(q_lens), max_q, max_kv)
    for i, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        own = torch.tensor(pages[indptr[i] : indptr[i + 1]])
        slots = (own.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()[:kv]
        assert gather[i, :kv].tolist() == slots.tolist()
        assert not gather[i, kv:].any()
        expected = torch.zeros(max_q, max_kv, dtype=torch.bool)
        expected[:q, :kv] = visibility_mask(q, kv, blocks[i], window)
        expected[q:, 0] = True
        assert torch.equal(mask[i], expected), (i, q, kv)
        if padded is not None:
            assert torch.equal(padded[i, :q, :q], blocks[i]) and not padded[i, q:].any()


def test_row_helpers():
    assert padded_rows((3,)).tolist() == [0, 1, 2]
    assert padded_rows((1, 3, 2)).tolist() == [0, 3, 4, 5, 6, 7]
    assert row_indices((1, 3, 2)).tolist() == [0, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("window", [None, 2])
def test_a_tree_row_is_not_mistaken_for_a_causal_one(window):
    """Negative control on the tree path: row 2 a child of the root (not of row 1) must not
    see row 1, which a causal mask would show it."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = batch_visibility([3], [7], padded_tree_masks(tree.flatten(), [3]), window)
    assert not mask[0, 2, 5] and mask[0, 2, 4] and mask[0, 2, 6]
    causal = batch_visibility([3], [7], None, window)
    assert causal[0, 2, 5]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), trees=st.booleans(), window=st.sampled_from([None, 2, 8]))
def test_plan_one_matches_the_batched_functions_for_any_batch(seed, trees, window):
    """plan_one takes the per-sequence rule for one sequence and the batched functions for
    more: both give the batched functions' tensors."""
    q_lens, kv_lens, pages, indptr, page_size, flat = scene(seed, trees)
    for lo, hi in ((0, 1), (0, len(q_lens))):  # the first sequence alone, then all of them
        q, kv = q_lens[lo:hi], kv_lens[lo:hi]
        ptr = [p - indptr[lo] for p in indptr[lo : hi + 1]]
        used = pages[indptr[lo] : indptr[hi]]
        tree = None if flat is None else flat[: sum(n * n for n in q)]
        layout = BatchLayout(
            token_ids=torch.zeros(sum(q), dtype=torch.int64),
            positions=torch.zeros(sum(q), dtype=torch.int64),
            qo_indptr=torch.zeros(len(q) + 1, dtype=torch.int32),
            kv_page_indptr=torch.tensor(ptr, dtype=torch.int32),
            kv_page_indices=torch.tensor(used, dtype=torch.int32),
            kv_last_page_len=torch.zeros(len(q), dtype=torch.int32),
            slot_mapping=torch.zeros(sum(q), dtype=torch.int64),
            q_lens=tuple(q),
            kv_lens=tuple(kv),
            page_size=page_size,
            tree_mask=tree,
            host=LayoutHost(tuple(ptr), tuple(used), tuple([0] * len(q)), tree),
        )
        spec = AttentionSpec(num_qo_heads=2, num_kv_heads=1, head_dim=4, sm_scale=0.5, sliding_window=window)
        plan = TorchAttentionBackend().plan_one(layout, spec)
        assert torch.equal(plan.kv_gather, gather_slots(used, ptr, kv, page_size))
        trees_padded = None if tree is None else padded_tree_masks(tree, q)
        expected = batch_visibility(q, kv, trees_padded, window)
        if plan.mask is None:  # one causal decode row inside its window: every slot visible
            assert expected.all()
        else:
            assert torch.equal(plan.mask[:, 0], expected)
