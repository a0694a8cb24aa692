"""Paged KV cache: allocator, page tables, truncate/compact/fork, CSR metadata, BatchLayout."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specdec.kv import KVCacheManager, KVSpec, ModelKV, OutOfPages, PageAllocator, PagePool

# Two models with different KV shapes and dtypes over the same pages.
TARGET = KVSpec(name="target", num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
DRAFT = KVSpec(name="draft", num_layers=1, num_kv_heads=1, head_dim=5, dtype=torch.float64)


def make_manager(num_pages: int, page_size: int) -> KVCacheManager:
    kv = KVCacheManager(PageAllocator(num_pages), page_size)
    kv.add_pool(TARGET)
    kv.add_pool(DRAFT)
    return kv


def slot_view(pool: PagePool) -> torch.Tensor:
    """[L, 2, num_pages * page_size, Hkv, D] view of the pool, addressed by flat slot."""
    return pool.cache.flatten(2, 3)


def tag_values(pool: PagePool, tags: list[int]) -> torch.Tensor:
    """[L, 2, n, Hkv, D]: every element of slot j encodes tags[j] and its own (layer, k/v, head, dim)."""
    s = pool.spec
    base = torch.arange(s.num_layers * 2 * s.num_kv_heads * s.head_dim, dtype=pool.cache.dtype)
    base = base.reshape(s.num_layers, 2, 1, s.num_kv_heads, s.head_dim)  # [L, 2, 1, Hkv, D]
    tag = torch.tensor(tags, dtype=pool.cache.dtype).reshape(1, 1, -1, 1, 1)  # [1, 1, n, 1, 1]
    return tag * 100 + base


def write_tags(kv: KVCacheManager, flat_slots: list[int], tags: list[int]) -> None:
    for pool in kv.pools.values():
        slot_view(pool)[:, :, flat_slots] = tag_values(pool, tags)


def read_matches(kv: KVCacheManager, flat_slots: list[int], tags: list[int]) -> bool:
    return all(
        torch.equal(slot_view(pool)[:, :, flat_slots], tag_values(pool, tags))
        for pool in kv.pools.values()
    )


def fill_sequence(kv: KVCacheManager, seq_id: int, tags: list[int]) -> None:
    """Write tags[p] into slot p of seq_id (0..len(tags)-1) through build_layout's slot_mapping."""
    layout = kv.build_layout([seq_id], [tags], [0])
    write_tags(kv, layout.slot_mapping.tolist(), tags)


# ---- allocator -------------------------------------------------------------------------------


def test_allocate_free_refcounts():
    alloc = PageAllocator(5)
    assert (alloc.num_total_pages, alloc.num_free_pages) == (5, 5)
    pages = alloc.allocate(3)
    assert pages == [0, 1, 2]
    assert [alloc.refcount(p) for p in range(5)] == [1, 1, 1, 0, 0]
    alloc.incref([0, 0, 2])
    assert [alloc.refcount(p) for p in range(3)] == [3, 1, 2]
    alloc.free([0, 1, 2])
    assert [alloc.refcount(p) for p in range(3)] == [2, 0, 1]
    assert alloc.num_free_pages == 3 and alloc.free_page_ids() == {1, 3, 4}
    assert alloc.allocate(0) == []
    assert alloc.allocate(1) == [1]  # the most recently freed page comes back first


def test_exhaustion_leaves_state_unchanged():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfPages) as info:
        alloc.allocate(2)
    assert (info.value.requested, info.value.available) == (2, 1)
    assert "2" in str(info.value) and "1" in str(info.value)
    assert alloc.num_free_pages == 1 and alloc.free_page_ids() == {3}
    assert alloc.refcount(3) == 0
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.requested, again.available) == (2, 1)


def test_double_free_raises_and_changes_nothing():
    alloc = PageAllocator(3)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(ValueError, match=f"page {a} .*already free"):
        alloc.free([a])
    # Freed twice in one call while held once: refused as a whole, b keeps its reference.
    with pytest.raises(ValueError, match=f"page {b}"):
        alloc.free([b, b])
    assert alloc.refcount(b) == 1 and alloc.num_free_pages == 2


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda a: a.allocate(-1), ValueError),
        (lambda a: a.allocate(1.0), TypeError),
        (lambda a: a.allocate(True), TypeError),
        (lambda a: a.free([7]), ValueError),
        (lambda a: a.incref([2]), ValueError),  # page 2 is free: sharing it is a bug
        (lambda a: a.refcount(-1), ValueError),
    ],
)
def test_allocator_rejects_bad_arguments(call, error):
    alloc = PageAllocator(3)
    alloc.allocate(1)
    with pytest.raises(error):
        call(alloc)
    assert alloc.num_free_pages == 2 and alloc.refcount(0) == 1


def test_allocator_rejects_bad_size():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


# ---- pools -------------------------------------------------------------------------------------


def test_kvspec_validates():
    with pytest.raises(ValueError, match="num_layers"):
        KVSpec(name="x", num_layers=0, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        KVSpec(name="x", num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.int64)
    with pytest.raises(ValueError, match="name"):
        KVSpec(name="", num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def test_pool_layout_and_views():
    kv = KVCacheManager(PageAllocator(6), page_size=4)
    target = kv.add_pool(TARGET)
    assert isinstance(target, ModelKV) and target.pool is kv.pools["target"]
    cache = target.pool.cache
    assert cache.shape == (2, 2, 6, 4, 2, 3)
    assert target.pool.nbytes == cache.numel() * 4
    k, v = target.layer(1)
    assert k.shape == v.shape == (6, 4, 2, 3)
    k[3, 2] = 7.0  # views: writes land in the one cache tensor
    assert torch.all(cache[1, 0, 3, 2] == 7.0) and torch.all(cache[1, 1] == 0)
    with pytest.raises(ValueError, match="i must be in 0..1"):
        target.layer(2)
    with pytest.raises(ValueError, match="already has a pool"):
        kv.add_pool(TARGET)
    kv.add_sequence(0)
    with pytest.raises(ValueError, match="before add_sequence"):
        kv.add_pool(DRAFT)


def test_copy_slots_overlapping_gathers_first():
    pool = PagePool(DRAFT, num_pages=2, page_size=4, device="cpu")
    slot_view(pool)[:] = tag_values(pool, list(range(8)))
    pool.copy_slots(torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]))  # shift right by one
    assert torch.equal(slot_view(pool), tag_values(pool, [0, 0, 1, 2, 4, 5, 6, 7]))


# ---- sequences ---------------------------------------------------------------------------------


def test_sequence_bookkeeping_errors():
    kv = make_manager(4, 2)
    kv.add_sequence(1)
    with pytest.raises(ValueError, match="seq_id 1 already exists"):
        kv.add_sequence(1)
    with pytest.raises(KeyError, match="unknown seq_id 9"):
        kv.free(9)
    with pytest.raises(KeyError, match="unknown seq_id 9"):
        kv.reserve(9, 1)
    assert kv.has_sequence(1) and not kv.has_sequence(9) and kv.seq_ids() == (1,)


def test_reserve_is_all_or_nothing():
    kv = make_manager(5, 4)
    kv.add_sequence(0)
    kv.add_sequence(1)
    assert kv.reserve(0, 9) == 3 and kv.capacity(0) == 12
    assert kv.reserve(0, 5) == 0  # never shrinks
    assert kv.pages_needed(1, 12) == 3
    assert not kv.can_reserve({1: 12})
    assert kv.can_reserve({1: 8}) and not kv.can_reserve({1: 8, 2: 1})  # 2: a new sequence
    with pytest.raises(OutOfPages) as info:
        kv.reserve(1, 12)
    assert (info.value.requested, info.value.available) == (3, 2)
    assert kv.page_table(1) == () and kv.allocator.num_free_pages == 2
    assert kv.page_table(0) == (0, 1, 2)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_truncate_frees_exactly_the_pages_past_the_kept_slots(page_size):
    kv = make_manager(10, page_size)
    kv.add_sequence(0)
    kv.reserve(0, 7 * page_size)
    table = kv.page_table(0)
    for num_slots, keep in [
        (7 * page_size, 7),
        (5 * page_size + 1, 6),
        (5 * page_size, 5),
        (page_size - 1 if page_size > 1 else 1, 1),
        (0, 0),
    ]:
        kv.truncate(0, num_slots)
        assert kv.page_table(0) == table[:keep]
        assert kv.capacity(0) == keep * page_size
        assert kv.allocator.free_page_ids() == set(range(10)) - set(table[:keep])
    with pytest.raises(ValueError, match="num_slots must be in 0..0"):
        kv.truncate(0, 1)


@pytest.mark.parametrize(
    ("src_slots", "dst_start"),
    [
        ([9, 3, 10], 5),  # a tree path: scattered verify rows onto the run after slot 4
        ([6, 7, 8, 9], 5),  # overlapping, shift left across a page boundary
        ([2, 3, 4, 5], 3),  # overlapping, shift right: sequential copying would smear slot 2
        ([5, 1, 6], 5),  # the first row is already in place
    ],
)
def test_compact_moves_kv_in_every_pool(src_slots, dst_start):
    kv = make_manager(12, 4)
    kv.add_sequence(0)
    kv.add_sequence(1)
    # Interleave reservations so sequence 0's pages are fragmented.
    for _ in range(3):
        kv.reserve(0, kv.capacity(0) + 4)
        kv.reserve(1, kv.capacity(1) + 4)
    assert kv.page_table(0) == (0, 2, 4)
    tags0 = [100 + p for p in range(12)]
    tags1 = [200 + p for p in range(12)]
    fill_sequence(kv, 0, tags0)
    fill_sequence(kv, 1, tags1)

    kv.compact(0, src_slots, dst_start)

    expected = list(tags0)
    for j, src in enumerate(src_slots):
        expected[dst_start + j] = tags0[src]
    assert read_matches(kv, kv.slot_ids(0, range(12)), expected)
    assert read_matches(kv, kv.slot_ids(1, range(12)), tags1)


def test_compact_validates_before_touching_anything():
    kv = make_manager(4, 4)
    kv.add_sequence(0)
    kv.reserve(0, 8)
    fill_sequence(kv, 0, list(range(8)))
    with pytest.raises(ValueError, match="slots must be ints in 0..7"):
        kv.compact(0, [1, 8], 0)
    with pytest.raises(ValueError, match="dst_start"):
        kv.compact(0, [1, 2], 7)
    assert read_matches(kv, kv.slot_ids(0, range(8)), list(range(8)))


def test_fork_shares_pages_and_copies_on_write():
    kv = make_manager(8, 4)
    kv.add_sequence(0)
    kv.reserve(0, 6)
    fill_sequence(kv, 0, [1, 2, 3, 4, 5, 6])
    kv.fork(0, 1)
    assert kv.page_table(1) == kv.page_table(0) == (0, 1)
    assert [kv.allocator.refcount(p) for p in (0, 1)] == [2, 2]
    with pytest.raises(ValueError, match="dst_seq_id 1 already exists"):
        kv.fork(0, 1)

    # The shared partial page is read-only until the writer gets its own copy.
    with pytest.raises(ValueError, match=r"page 1 .*ensure_writable\(1, 6\)"):
        kv.build_layout([1], [[7]], [6])
    assert kv.ensure_writable(1, 6) == 1
    assert kv.page_table(1) == (0, 2) and kv.allocator.refcount(1) == 1
    layout = kv.build_layout([1], [[7]], [6])
    write_tags(kv, layout.slot_mapping.tolist(), [7])
    assert read_matches(kv, kv.slot_ids(1, range(7)), [1, 2, 3, 4, 5, 6, 7])
    assert read_matches(kv, kv.slot_ids(0, range(6)), [1, 2, 3, 4, 5, 6])

    kv.free(0)  # the shared first page stays alive for sequence 1
    assert kv.allocator.refcount(0) == 1 and kv.allocator.free_page_ids() >= {1}
    assert read_matches(kv, kv.slot_ids(1, range(7)), [1, 2, 3, 4, 5, 6, 7])
    kv.free(1)
    assert kv.allocator.num_free_pages == 8


def test_compact_refuses_shared_pages():
    kv = make_manager(4, 2)
    kv.add_sequence(0)
    kv.reserve(0, 4)
    fill_sequence(kv, 0, [1, 2, 3, 4])
    kv.fork(0, 1)
    with pytest.raises(ValueError, match="is shared or in the prefix cache"):
        kv.compact(1, [3], 2)
    assert read_matches(kv, kv.slot_ids(0, range(4)), [1, 2, 3, 4])
    kv.ensure_writable(1, 2)
    kv.compact(1, [3], 2)
    assert read_matches(kv, kv.slot_ids(1, range(3)), [1, 2, 4])
    assert read_matches(kv, kv.slot_ids(0, range(4)), [1, 2, 3, 4])


def test_ensure_writable_is_all_or_nothing():
    kv = make_manager(4, 2)
    kv.add_sequence(0)
    kv.reserve(0, 6)
    kv.fork(0, 1)
    with pytest.raises(OutOfPages):
        kv.ensure_writable(1, 0)  # three shared pages, one free
    assert kv.page_table(1) == (0, 1, 2) and kv.allocator.num_free_pages == 1
    assert kv.ensure_writable(1, 4) == 1 and kv.page_table(1) == (0, 1, 3)


# ---- metadata ----------------------------------------------------------------------------------


def test_page_metadata_on_fragmented_tables():
    kv = make_manager(10, 4)
    for seq in (0, 1, 2):
        kv.add_sequence(seq)
    for _ in range(3):
        for seq in (0, 1, 2):
            kv.reserve(seq, kv.capacity(seq) + 4)
    kv.free(1)  # frees 1, 4, 7; reused last-freed first
    kv.reserve(2, 16)  # takes page 7
    assert kv.page_table(0) == (0, 3, 6)
    assert kv.page_table(2) == (2, 5, 8, 7)

    indptr, indices, last = kv.page_metadata([2, 0], [13, 4], device="cpu")
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert indptr.tolist() == [0, 4, 5]
    assert indices.tolist() == [2, 5, 8, 7, 0]  # only the pages kv_len uses
    assert last.tolist() == [1, 4]
    with pytest.raises(ValueError, match=r"kv_lens\[0\] must be >= 1"):
        kv.page_metadata([0], [0])
    with pytest.raises(ValueError, match="capacity of sequence 0"):
        kv.page_metadata([0], [13])


def test_slot_ids():
    kv = make_manager(6, 4)
    kv.add_sequence(0)
    kv.add_sequence(1)
    kv.reserve(1, 4)
    kv.reserve(0, 8)
    assert kv.page_table(0) == (1, 2)
    assert kv.slot_ids(0, [0, 3, 4, 7]) == [4, 7, 8, 11]
    with pytest.raises(ValueError, match="slots must be ints in 0..7"):
        kv.slot_ids(0, [8])


def test_build_layout_fields():
    kv = make_manager(8, 4)
    for seq in (10, 11):
        kv.add_sequence(seq)
    kv.reserve(10, 4)
    kv.reserve(11, 4)
    kv.reserve(10, 8)
    assert kv.page_table(10) == (0, 2) and kv.page_table(11) == (1,)

    # Sequence 10 decodes one token at slot 5; sequence 11 verifies a 3-token chain at 1..3.
    layout = kv.build_layout([10, 11], [[42], [7, 8, 9]], [5, 1])
    assert layout.token_ids.tolist() == [42, 7, 8, 9]
    assert layout.positions.tolist() == [5, 1, 2, 3]
    assert layout.qo_indptr.tolist() == [0, 1, 4]
    assert layout.slot_mapping.tolist() == [2 * 4 + 1, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3]
    assert layout.q_lens == (1, 3) and layout.kv_lens == (6, 4)
    assert layout.kv_page_indptr.tolist() == [0, 2, 3]
    assert layout.kv_page_indices.tolist() == [0, 2, 1]
    assert layout.kv_last_page_len.tolist() == [2, 4]
    assert layout.page_size == 4 and layout.tree_mask is None
    assert layout.batch_size == 2 and layout.num_tokens == 4
    assert layout.last_row_indices.tolist() == [0, 3]
    assert (
        layout.token_ids.dtype == layout.positions.dtype == layout.slot_mapping.dtype == torch.int64
    )
    assert layout.qo_indptr.dtype == torch.int32


def test_build_layout_tree_mask_flattening():
    kv = make_manager(8, 4)
    for seq in (0, 1):
        kv.add_sequence(seq)
        kv.reserve(seq, 8)
    # Sequence 0: root with two children (depth positions 3, 4, 4).
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = kv.build_layout(
        [0, 1],
        [[5, 6, 7], [8, 9]],
        [3, 2],
        positions=[[3, 4, 4], None],
        tree_masks=[tree, None],
    )
    assert layout.positions.tolist() == [3, 4, 4, 2, 3]
    assert layout.tree_mask.dtype == torch.bool
    assert layout.tree_mask.tolist() == [*tree.flatten().tolist(), True, False, True, True]
    assert kv.build_layout([0], [[1]], [0], tree_masks=[None]).tree_mask is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(new_token_ids=[[1, 2, 3]], start_slots=[2]), ValueError, "sequence 0: kv_len 5"),
        (dict(new_token_ids=[[]], start_slots=[0]), ValueError, r"new_token_ids\[0\]"),
        (dict(new_token_ids=[[1]], start_slots=[-1]), ValueError, r"start_slots\[0\]"),
        (dict(new_token_ids=[[1], [2]], start_slots=[0]), ValueError, "new_token_ids must have"),
        (dict(new_token_ids=[[1, 2]], start_slots=[0], positions=[[0]]), ValueError, "positions"),
        (
            dict(new_token_ids=[[1, 2]], start_slots=[0], tree_masks=[torch.ones(3, 3).bool()]),
            ValueError,
            r"tree_masks\[0\] must have shape \(2, 2\)",
        ),
        (
            dict(new_token_ids=[[1, 2]], start_slots=[0], tree_masks=[torch.ones(2, 2)]),
            TypeError,
            "bool",
        ),
    ],
)
def test_build_layout_rejects_bad_input(kwargs, error, match):
    kv = make_manager(2, 4)
    kv.add_sequence(0)
    kv.reserve(0, 4)
    with pytest.raises(error, match=match):
        kv.build_layout([0], **kwargs)


def test_model_kv_layout_and_stats():
    kv = KVCacheManager(PageAllocator(4), page_size=2)
    draft = kv.add_pool(DRAFT)
    kv.add_sequence(3)
    kv.reserve(3, 3)
    layout = draft.layout([3], [[4, 5, 6]], [0])
    assert layout.slot_mapping.device == draft.pool.device and layout.kv_lens == (3,)
    assert draft.page_size == 2 and draft.layer(0)[0].shape == (4, 2, 1, 5)
    stats = kv.stats()
    assert stats["num_free_pages"] == 2 and stats["num_total_pages"] == 4
    assert stats["num_sequences"] == 1 and stats["page_size"] == 2
    with pytest.raises(ValueError, match="distinct"):
        kv.build_layout([3, 3], [[1], [1]], [0, 1])


# ---- random operation sequences ------------------------------------------------------------


class KVMachine(RuleBasedStateMachine):
    """Random add/reserve/append/truncate/fork/compact/free against a model of every slot's KV.

    The model records, per sequence, the tag written into each committed slot; after every
    operation the pools must hold exactly those tags and the page accounting must balance.
    """

    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(1, 12))
    def setup(self, page_size, num_pages):
        self.kv = make_manager(num_pages, page_size)
        self.contents: dict[int, list[int]] = {}  # seq -> tag per committed slot
        self.next_id = 0
        self.next_tag = 1

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.contents)))

    def _attempt(self, op) -> bool:
        """Run op; on OutOfPages check that nothing changed and report False."""
        tables = {s: self.kv.page_table(s) for s in self.kv.seq_ids()}
        free = self.kv.allocator.free_page_ids()
        try:
            op()
        except OutOfPages:
            assert {s: self.kv.page_table(s) for s in self.kv.seq_ids()} == tables
            assert self.kv.allocator.free_page_ids() == free
            return False
        return True

    @rule()
    def add(self):
        self.kv.add_sequence(self.next_id)
        self.contents[self.next_id] = []
        self.next_id += 1

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def reserve(self, data):
        seq = self._pick(data)
        num_slots = data.draw(st.integers(0, self.kv.capacity(seq) + 3 * self.kv.page_size))
        if self._attempt(lambda: self.kv.reserve(seq, num_slots)):
            assert self.kv.capacity(seq) >= num_slots

    @precondition(lambda self: self.contents)
    @rule(data=st.data(), q_len=st.integers(1, 5))
    def append(self, data, q_len):
        seq = self._pick(data)
        start = len(self.contents[seq])
        if not self._attempt(lambda: self.kv.reserve(seq, start + q_len)):
            return
        if not self._attempt(lambda: self.kv.ensure_writable(seq, start)):
            return
        tags = list(range(self.next_tag, self.next_tag + q_len))
        self.next_tag += q_len
        layout = self.kv.build_layout([seq], [tags], [start])
        assert layout.kv_lens == (start + q_len,)
        assert layout.slot_mapping.tolist() == self.kv.slot_ids(seq, range(start, start + q_len))
        write_tags(self.kv, layout.slot_mapping.tolist(), tags)
        self.contents[seq].extend(tags)

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def truncate(self, data):
        seq = self._pick(data)
        num_slots = data.draw(st.integers(0, len(self.contents[seq])))
        self.kv.truncate(seq, num_slots)
        del self.contents[seq][num_slots:]
        assert self.kv.capacity(seq) == self.kv.pages_for(num_slots) * self.kv.page_size

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def fork(self, data):
        src = self._pick(data)
        self.kv.fork(src, self.next_id)
        self.contents[self.next_id] = list(self.contents[src])
        self.next_id += 1

    @precondition(lambda self: any(self.contents.values()))
    @rule(data=st.data())
    def compact(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, c in self.contents.items() if c)))
        length = len(self.contents[seq])
        src = data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=length))
        dst_start = data.draw(st.integers(0, length - len(src)))
        if not self._attempt(lambda: self.kv.ensure_writable(seq, dst_start)):
            return
        self.kv.compact(seq, src, dst_start)
        old = self.contents[seq]
        self.contents[seq] = old[:dst_start] + [old[s] for s in src] + old[dst_start + len(src) :]

    @precondition(lambda self: self.contents)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        self.kv.free(seq)
        del self.contents[seq]

    @invariant()
    def pages_balance(self):
        if not hasattr(self, "kv"):
            return
        alloc = self.kv.allocator
        held = Counter()
        for seq in self.kv.seq_ids():
            table = self.kv.page_table(seq)
            assert len(set(table)) == len(table), f"sequence {seq} holds a page twice"
            held.update(table)
        free = alloc.free_page_ids()
        assert len(free) == alloc.num_free_pages, "a page is on the free list twice"
        assert not free & held.keys(), "a page is both free and referenced"
        assert all(alloc.refcount(p) == held[p] for p in range(alloc.num_total_pages))
        assert alloc.num_free_pages + len(held) == alloc.num_total_pages

    @invariant()
    def kv_contents_match(self):
        if not hasattr(self, "kv"):
            return
        assert set(self.kv.seq_ids()) == set(self.contents)
        for seq, tags in self.contents.items():
            assert self.kv.capacity(seq) >= len(tags)
            assert read_matches(self.kv, self.kv.slot_ids(seq, range(len(tags))), tags)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for seq in list(self.contents):
            self.kv.free(seq)
        alloc = self.kv.allocator
        assert alloc.num_free_pages == alloc.num_total_pages
        assert all(alloc.refcount(p) == 0 for p in range(alloc.num_total_pages))


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase
