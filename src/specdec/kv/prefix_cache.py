"""Automatic prefix caching: full KV pages found again by a hash chain of their tokens.

Requests that share a prefix (a system prompt, a chat history, few-shot examples, the samples
of one prompt) share its KV pages instead of recomputing them. Page ``i`` of a sequence gets the
content key::

    key(-1) = H("specdec-prefix", salt)
    key(i)  = H(key(i - 1), tokens[i * page_size : (i + 1) * page_size + lookahead])

once its KV is final in every model's pool (the engine says how far that is). A new request
walks its prompt's chain and takes every page found, up to the first miss; its prefill starts
after them.

A proposer with its own pool that catches up from tokens alone (a draft model: it runs the
tokens it has not seen when it next drafts) may leave its pool behind the target's: a request
drafted by a suffix tree never runs the draft model at all. Such a cache (``partial=True``)
also keys, when a request ends, the pages whose KV is final in the target's pool only; they are
marked partial. A request that finds them skips the target's prefill over them and the
proposer starts before them (it catches up there when it next drafts). Heads (MTP, EAGLE) need
the target's features of every slot they run, which a cached page no longer has: their caches
reuse complete pages only.

``lookahead`` is the number of tokens after a slot that a model's KV at that slot depends on:
0 for a target or draft model, 1 for an MTP or EAGLE head (its row ``p`` pairs the target's
features at ``p`` with token ``p + 1``), so a page is only reused where those tokens match too. The salt keeps requests of different salts (users, API keys) on separate chains: a
shared page's prefill time would otherwise be visible to another user.

Keys live on the :class:`~specdec.kv.allocator.PageAllocator` (a keyed page no table holds is
free but remembered, and evicted least recently used first); this module computes keys and
remembers, per sequence, how far its chain has been keyed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from specdec.kv.allocator import PageAllocator, require_int

__all__ = ["PrefixCache", "root_key", "next_key"]

_KEY_BYTES = 16  # 128-bit keys: a collision would silently reuse another prefix's KV


def root_key(salt: str | None) -> bytes:
    """The key before a sequence's first page: its salt's (``None``: the unsalted chain)."""
    tag = b"specdec-prefix" if salt is None else b"specdec-prefix\x00" + salt.encode()
    return hashlib.blake2b(tag, digest_size=_KEY_BYTES).digest()


def next_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page whose chain so far is ``previous`` and whose tokens (page tokens plus
    lookahead) are ``tokens``."""
    h = hashlib.blake2b(previous, digest_size=_KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCache:
    """Hash chains of sequences' pages, and hit statistics.

    Example:
        >>> cache = PrefixCache(page_size=16)
        >>> pages, key = cache.match(allocator, prompt_ids, salt=None)   # cached pages, in order
        >>> cache.keyed(allocator, seq_id, table, token_ids, valid_slots, salt=None)
    """

    def __init__(self, page_size: int, *, lookahead: int = 0, partial: bool = False) -> None:
        self.page_size = require_int("page_size", page_size, minimum=1)
        self.lookahead = require_int("lookahead", lookahead)
        if not isinstance(partial, bool):
            raise TypeError(f"partial must be a bool, got {type(partial).__name__}")
        self.partial = partial  # whether pages final in the target's pool only are reused
        # Keyed pages whose KV is final in the target's pool only; set (or cleared) whenever
        # a page is given a key, so a page's mark always describes its current key.
        self._partial_pages: set[int] = set()
        # seq_id -> (pages of its table keyed so far, the last of their keys)
        self._progress: dict[int, tuple[int, bytes]] = {}
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached

    def _keyable(self, page: int, num_tokens: int) -> bool:
        """Whether page ``page`` of ``num_tokens`` known tokens is full with its lookahead known."""
        return (page + 1) * self.page_size + self.lookahead <= num_tokens

    def match(
        self, allocator: PageAllocator, token_ids: Sequence[int], salt: str | None
    ) -> tuple[list[int], bytes, int]:
        """The cached pages of ``token_ids``' longest cached prefix, the key of the last, and
        how many of them (from the first) are complete (final in every pool; the rest are
        partial, found only by a ``partial`` cache).

        At least one token is always left out, so a prefill has a row to draw the next token
        from. Counts the lookup in ``query_tokens`` and ``hit_tokens``.
        """
        key = root_key(salt)
        pages: list[int] = []
        complete = 0
        ps, n = self.page_size, len(token_ids)
        while self._keyable(len(pages), n) and (len(pages) + 1) * ps < n:
            i = len(pages)
            candidate = next_key(key, token_ids[i * ps : (i + 1) * ps + self.lookahead])
            page = allocator.lookup(candidate)
            if page is None or (page in self._partial_pages and not self.partial):
                break
            pages.append(page)
            key = candidate
            if complete == i and page not in self._partial_pages:
                complete = i + 1
        self.query_tokens += n
        self.hit_tokens += len(pages) * ps
        return pages, key, complete

    def chain_key(self, token_ids: Sequence[int], num_pages: int, salt: str | None) -> bytes:
        """The key of page ``num_pages - 1`` of ``token_ids`` (the root key for 0 pages)."""
        key, ps = root_key(salt), self.page_size
        for i in range(num_pages):
            key = next_key(key, token_ids[i * ps : (i + 1) * ps + self.lookahead])
        return key

    def start(self, seq_id: int, num_pages: int, key: bytes) -> None:
        """``seq_id``'s first ``num_pages`` pages are keyed already, the last with ``key``."""
        self._progress[seq_id] = (num_pages, key)

    def keyed(
        self,
        allocator: PageAllocator,
        seq_id: int,
        table: Sequence[int],
        token_ids: Sequence[int],
        num_valid_slots: int,
        salt: str | None,
        num_target_slots: int | None = None,
    ) -> list[int]:
        """Key every page of ``seq_id`` that became full and final (KV valid in every pool up
        to ``num_valid_slots``); returns the pages given a key now. ``num_target_slots``
        (a ``partial`` cache, when the sequence ends): the target's KV is final up to there,
        and the pages past ``num_valid_slots`` are keyed as partial.

        A page whose content is cached already under another page stays private to its
        sequence, and the chain goes on past it (later pages still get keys).
        """
        done, key = self._progress.get(seq_id) or (0, root_key(salt))
        ps = self.page_size
        last = num_valid_slots
        if num_target_slots is not None and self.partial:
            last = max(num_valid_slots, num_target_slots)
        newly: list[int] = []
        i = done
        while i < len(table) and (i + 1) * ps <= last and self._keyable(i, len(token_ids)):
            key = next_key(key, token_ids[i * ps : (i + 1) * ps + self.lookahead])
            if allocator.set_key(table[i], key):
                newly.append(table[i])
                if (i + 1) * ps <= num_valid_slots:
                    self._partial_pages.discard(table[i])
                else:
                    self._partial_pages.add(table[i])
            i += 1
        if i != done:
            self._progress[seq_id] = (i, key)
        return newly

    def forget(self, seq_id: int) -> None:
        """``seq_id`` left (finished, preempted, failed): drop its chain position."""
        self._progress.pop(seq_id, None)

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_partial_pages": len(self._partial_pages)}
