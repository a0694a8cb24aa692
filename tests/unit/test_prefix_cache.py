"""Prefix caching bookkeeping: content keys on the allocator, hash chains, eviction order,
read-only cached pages, salts, and the tensor-parallel journal replaying it all."""

from __future__ import annotations

import pytest
import torch

from specdec.distributed.journal import JournaledKVCacheManager, replay
from specdec.kv.allocator import OutOfPages, PageAllocator
from specdec.kv.paged import KVCacheManager, KVSpec
from specdec.kv.prefix_cache import PrefixCache, next_key, root_key

SPEC = KVSpec(name="target", num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def make(num_pages: int = 8, page_size: int = 4, lookahead: int = 0, manager=KVCacheManager, partial=False):
    cache = PrefixCache(page_size, lookahead=lookahead, partial=partial)
    kv = manager(PageAllocator(num_pages), page_size, prefix_cache=cache)
    kv.add_pool(SPEC)
    return kv


def run(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: str | None = None) -> int:
    """Admit ``tokens`` (attaching cached pages), 'compute' the rest, key what is final."""
    kv.add_sequence(seq_id)
    cached, complete = kv.attach_prefix(seq_id, tokens, salt)
    assert complete == cached  # every page was keyed complete
    kv.reserve(seq_id, len(tokens))
    kv.cache_prefix(seq_id, tokens, len(tokens), salt)
    return cached


def test_keyed_pages_are_free_but_remembered_until_evicted():
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    assert alloc.set_key(pages[0], b"a") and not alloc.set_key(pages[1], b"a")  # one page per key
    alloc.free(pages)
    assert alloc.num_free_pages == 3 and alloc.num_evictable_pages == 1
    assert alloc.lookup(b"a") == pages[0]
    alloc.incref([pages[0]])  # revived: in use again, no longer evictable
    assert alloc.num_evictable_pages == 0 and alloc.refcount(pages[0]) == 1
    alloc.free([pages[0]])
    assert sorted(alloc.allocate(2)) == sorted({0, 1, 2} - {pages[0]})  # unkeyed pages first
    assert alloc.lookup(b"a") == pages[0] and alloc.num_evictions == 0
    assert alloc.allocate(1) == [pages[0]]  # then the keyed one, evicted
    assert alloc.lookup(b"a") is None and alloc.key_of(pages[0]) is None and alloc.num_evictions == 1
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    with pytest.raises(ValueError, match="only held pages can be given a key"):
        PageAllocator(2).set_key(0, b"x")


def test_a_freed_table_is_evicted_tail_first_and_least_recent_first():
    alloc = PageAllocator(6)
    first, second = alloc.allocate(3), alloc.allocate(3)
    for i, page in enumerate(first + second):
        alloc.set_key(page, bytes([i]))
    alloc.free(first)
    alloc.free(second)
    # first was freed earlier: its pages go first, each table's last page before its first.
    assert alloc.allocate(6) == [first[2], first[1], first[0], second[2], second[1], second[0]]


def test_hash_chain_depends_on_every_earlier_token_and_the_salt():
    a = next_key(root_key(None), [1, 2, 3, 4])
    assert a == next_key(root_key(None), [1, 2, 3, 4])
    assert a != next_key(root_key(None), [1, 2, 3, 5])
    assert a != next_key(root_key("alice"), [1, 2, 3, 4])
    assert next_key(a, [5, 6, 7, 8]) != next_key(next_key(root_key(None), [1, 2, 3, 5]), [5, 6, 7, 8])


def test_a_prompt_finds_the_full_pages_of_its_longest_cached_prefix():
    kv = make()
    assert run(kv, 0, list(range(11))) == 0  # pages 0, 1 full and final; page 2 partial
    kv.free(0)
    assert run(kv, 1, list(range(9)) + [99]) == 8  # both full pages shared
    assert run(kv, 2, [0, 1, 2, 3, 7, 7, 7, 7, 7]) == 4  # diverges in page 1
    assert run(kv, 3, list(range(8))) == 4  # at least one token is left to compute
    assert kv.page_table(1)[:2] == kv.page_table(3)[:1] + kv.page_table(1)[1:2]
    stats = kv.stats()
    assert stats["prefix_cache_hit_tokens"] == 16 and stats["prefix_cache_query_tokens"] == 11 + 10 + 9 + 8


def test_salts_never_share_and_lookahead_must_match():
    kv = make()
    run(kv, 0, list(range(10)), salt="a")
    assert run(kv, 1, list(range(10)), salt="b") == 0
    assert run(kv, 2, list(range(10)), salt="a") == 8
    ahead = make(lookahead=1)
    run(ahead, 0, list(range(10)))
    assert run(ahead, 1, list(range(8)) + [50, 51]) == 4  # page 1's next token differs
    assert run(ahead, 2, list(range(10))) == 8


def test_cached_pages_are_read_only_and_copy_on_write():
    kv = make()
    run(kv, 0, list(range(9)))
    with pytest.raises(ValueError, match="is shared or in the prefix cache"):
        kv.build_layout([0], [[1]], [3])  # slot 3: a keyed page, even with one holder
    kv.build_layout([0], [[1]], [8])  # the partial page is the sequence's own
    assert kv.ensure_writable(0, 0) == 2  # private copies; the cached ones stay cached
    kv.build_layout([0], [[1]], [3])
    kv.free(0)
    assert kv.stats()["num_used_pages"] == 0 and kv.stats()["prefix_cache_pages"] == 2


def test_only_final_pages_are_keyed():
    kv = make()
    kv.add_sequence(0)
    kv.attach_prefix(0, list(range(12)))
    kv.reserve(0, 12)
    assert kv.cache_prefix(0, list(range(12)), 5) == [kv.page_table(0)[0]]  # slots 0..4 final
    assert kv.cache_prefix(0, list(range(12)), 5) == []  # nothing new
    assert len(kv.cache_prefix(0, list(range(12)), 12)) == 2


def _end_with_target_only(kv, seq_id: int, tokens: list[int], proposer_valid: int) -> None:
    """A sequence whose proposer ran its first ``proposer_valid`` slots ends: it keys what is
    final in every pool, then (ending) what is final in the target's pool."""
    kv.add_sequence(seq_id)
    kv.attach_prefix(seq_id, tokens)
    kv.reserve(seq_id, len(tokens))
    kv.cache_prefix(seq_id, tokens, proposer_valid)
    kv.cache_prefix(seq_id, tokens, proposer_valid, None, len(tokens))
    kv.free(seq_id)


@pytest.mark.parametrize("partial", [True, False])
def test_target_only_pages_serve_a_proposer_that_catches_up_as_private_copies(partial):
    """A draft model left behind (a suffix tree drafted) still lets a retried request skip the
    target's prefill: the pages past the draft's KV are found, marked partial, and copied so
    the draft can write there; a cache for heads (not ``partial``) never hands them out."""
    kv = make(num_pages=12, partial=partial)
    tokens = list(range(14))  # 3 full pages
    _end_with_target_only(kv, 0, tokens, proposer_valid=5)  # page 0 complete, 1 and 2 target-only
    assert kv.stats()["prefix_cache_partial_pages"] == (2 if partial else 0)
    kv.add_sequence(1)
    cached = kv.attach_prefix(1, tokens + [99])
    assert cached == ((12, 4) if partial else (4, 4))
    table = kv.page_table(1)
    assert kv.allocator.refcount(table[0]) == 1 and kv.allocator.lookup(next_key(root_key(None), tokens[:4])) == table[0]
    if partial:  # the partial pages are the sequence's own: the draft may write its KV there
        assert all(kv.allocator.lookup(k) not in table[1:] for k in [kv.prefix_cache.chain_key(tokens, 2, None),
                                                                    kv.prefix_cache.chain_key(tokens, 3, None)])
        kv.reserve(1, 15)
        kv.build_layout([1], [[5]], [4])  # writing slot 4 (a copied page) is allowed
    kv.free(1)


def test_without_free_pages_for_the_copies_only_complete_pages_are_used():
    kv = make(num_pages=4, partial=True)
    tokens = list(range(14))
    _end_with_target_only(kv, 0, tokens, proposer_valid=4)
    kv.add_sequence(1)
    hog = kv.allocator.allocate(kv.allocator.num_free_pages - 3)  # the 3 cached pages stay
    assert kv.attach_prefix(1, tokens + [1]) == (4, 4)  # copies of 2 pages do not fit
    assert len(kv.page_table(1)) == 1
    kv.free(1)
    kv.allocator.free(hog)


def test_a_follower_replaying_the_journal_keeps_the_same_pages():
    """Tensor parallelism: the other ranks replay hits and keys, so they allocate and evict
    the very pages the leader does."""
    leader = make(num_pages=6, manager=JournaledKVCacheManager)
    follower = KVCacheManager(PageAllocator(6), 4)
    follower.add_pool(SPEC)
    prompts = [list(range(10)), list(range(9)) + [40], [7] * 10, [8] * 10, list(range(10))]
    for seq_id, tokens in enumerate(prompts):
        run(leader, seq_id, tokens)
        leader.free(seq_id)
        replay(follower, leader.take_journal())
        assert follower.allocator.free_page_ids() == leader.allocator.free_page_ids()
        assert follower.allocator.num_evictable_pages == leader.allocator.num_evictable_pages
    run(leader, 9, list(range(10)))
    replay(follower, leader.take_journal())
    assert follower.page_table(9) == leader.page_table(9)
    assert leader.stats()["prefix_cache_evictions"] > 0
