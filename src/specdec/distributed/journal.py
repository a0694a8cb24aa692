"""The leader's page-table operations, recorded so the other ranks replay them.

Under tensor parallelism one allocator, the leader's, decides every page (and which pages the
prefix cache keeps). The other ranks keep
their own :class:`~specdec.kv.paged.KVCacheManager` over a pool of their KV heads and replay the
leader's operations in order, so their page tables equal the leader's (checked on every
forward), tree compaction moves their KV too, and at the end their pages are free as well.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from specdec.kv.paged import KVCacheManager

__all__ = ["PageOp", "JournaledKVCacheManager", "replay"]


class PageOp(enum.IntEnum):
    ADD_SEQUENCE = 1  # seq_id
    RESERVE = 2  # seq_id, num_slots
    TRUNCATE = 3  # seq_id, num_slots
    FORK = 4  # src_seq_id, dst_seq_id
    ENSURE_WRITABLE = 5  # seq_id, start_slot
    COMPACT = 6  # seq_id, dst_start, src_slots...
    FREE = 7  # seq_id
    SHARE_PAGES = 8  # seq_id, pages... (a prefix-cache hit)
    KEY_PAGES = 9  # pages... (given a content key: kept when freed, until evicted)


class JournaledKVCacheManager(KVCacheManager):
    """A :class:`KVCacheManager` that also appends each completed page-table operation to
    ``journal`` as ``[op, num_args, args...]`` words (a failed one changes nothing and is not
    recorded)."""

    def __init__(self, allocator, page_size: int, *, prefix_cache=None) -> None:
        super().__init__(allocator, page_size, prefix_cache=prefix_cache)
        self.journal: list[int] = []

    def take_journal(self) -> list[int]:
        """The operations recorded since the last call, and a fresh journal."""
        ops, self.journal = self.journal, []
        return ops

    def _record(self, op: PageOp, *args: int) -> None:
        self.journal.extend((int(op), len(args), *args))

    def add_sequence(self, seq_id: int) -> None:
        super().add_sequence(seq_id)
        self._record(PageOp.ADD_SEQUENCE, seq_id)

    def reserve(self, seq_id: int, num_slots: int) -> int:
        added = super().reserve(seq_id, num_slots)
        if added:
            self._record(PageOp.RESERVE, seq_id, num_slots)
        return added

    def truncate(self, seq_id: int, num_slots: int) -> None:
        before = len(self._table(seq_id))
        super().truncate(seq_id, num_slots)
        if len(self._table(seq_id)) != before:
            self._record(PageOp.TRUNCATE, seq_id, num_slots)

    def fork(self, src_seq_id: int, dst_seq_id: int) -> None:
        super().fork(src_seq_id, dst_seq_id)
        self._record(PageOp.FORK, src_seq_id, dst_seq_id)

    def ensure_writable(self, seq_id: int, start_slot: int) -> int:
        copied = super().ensure_writable(seq_id, start_slot)
        if copied:
            self._record(PageOp.ENSURE_WRITABLE, seq_id, start_slot)
        return copied

    def compact(self, seq_id: int, src_slots: Sequence[int], dst_start: int) -> None:
        src_slots = list(src_slots)
        super().compact(seq_id, src_slots, dst_start)
        self._record(PageOp.COMPACT, seq_id, dst_start, *src_slots)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._record(PageOp.FREE, seq_id)

    def share_pages(self, seq_id: int, pages: Sequence[int]) -> None:
        pages = list(pages)
        super().share_pages(seq_id, pages)
        if pages:
            self._record(PageOp.SHARE_PAGES, seq_id, *pages)

    def cache_prefix(self, seq_id, token_ids, num_valid_slots, salt=None, num_target_slots=None) -> list[int]:
        keyed = super().cache_prefix(seq_id, token_ids, num_valid_slots, salt, num_target_slots)
        if keyed:
            self._record(PageOp.KEY_PAGES, *keyed)
        return keyed


def replay(manager: KVCacheManager, words: Sequence[int]) -> None:
    """Apply a journal's ``[op, num_args, args...]`` words to ``manager``, in order."""
    i = 0
    while i < len(words):
        op, n = PageOp(words[i]), words[i + 1]
        args = list(words[i + 2 : i + 2 + n])
        i += 2 + n
        if op is PageOp.ADD_SEQUENCE:
            manager.add_sequence(*args)
        elif op is PageOp.RESERVE:
            manager.reserve(*args)
        elif op is PageOp.TRUNCATE:
            manager.truncate(*args)
        elif op is PageOp.FORK:
            manager.fork(*args)
        elif op is PageOp.ENSURE_WRITABLE:
            manager.ensure_writable(*args)
        elif op is PageOp.COMPACT:
            manager.compact(args[0], args[2:], args[1])
        elif op is PageOp.SHARE_PAGES:
            manager.share_pages(args[0], args[1:])
        elif op is PageOp.KEY_PAGES:
            # The leader keyed these pages; a follower only needs them kept and evicted in the
            # same order, so any key unique to the page will do.
            for page in args:
                manager.allocator.set_key(page, b"page:%d" % page)
        else:
            manager.free(*args)
