"""Automatic prefix caching: full KV pages found again by a hash chain of their tokens.

Requests that share a prefix (a system prompt, a chat history, few-shot examples, the samples
of one prompt) share its KV pages instead of recomputing them. Page ``i`` of a sequence gets the
content key::

    key(-1) = H("specdec-prefix", salt)
    key(i)  = H(key(i - 1), tokens[i * page_size : (i + 1) * page_size + lookahead])

once its KV is final in every model's pool (the engine says how far that is). A new request
walks its prompt's chain and takes every page found, up to the first miss; its prefill starts
after them. ``lookahead`` is the number of tokens after a slot that a model's KV at that slot
depends on: 0 for a target or draft model, 1 for an MTP or EAGLE head (its row ``p`` pairs the
target's features at ``p`` with token ``p + 1``), so a page is only reused where those tokens
match too. The salt keeps requests of different salts (users, API keys) on separate chains: a
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

    def __init__(self, page_size: int, *, lookahead: int = 0) -> None:
        self.page_size = require_int("page_size", page_size, minimum=1)
        self.lookahead = require_int("lookahead", lookahead)
        # seq_id -> (pages of its table keyed so far, the last of their keys)
        self._progress: dict[int, tuple[int, bytes]] = {}
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, found cached

    def _keyable(self, page: int, num_tokens: int) -> bool:
        """Whether page ``page`` of ``num_tokens`` known tokens is full with its lookahead known."""
        return (page + 1) * self.page_size + self.lookahead <= num_tokens

    def match(
        self, allocator: PageAllocator, token_ids: Sequence[int], salt: str | None
    ) -> tuple[list[int], bytes]:
        """The cached pages of ``token_ids``' longest cached prefix, and the key of the last.

        At least one token is always left out, so a prefill has a row to draw the next token
        from. Counts the lookup in ``query_tokens`` and ``hit_tokens``.
        """
        key = root_key(salt)
        pages: list[int] = []
        ps, n = self.page_size, len(token_ids)
        while self._keyable(len(pages), n) and (len(pages) + 1) * ps < n:
            i = len(pages)
            candidate = next_key(key, token_ids[i * ps : (i + 1) * ps + self.lookahead])
            page = allocator.lookup(candidate)
            if page is None:
                break
            pages.append(page)
            key = candidate
        self.query_tokens += n
        self.hit_tokens += len(pages) * ps
        return pages, key

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
    ) -> list[int]:
        """Key every page of ``seq_id`` that became full and final (KV valid in every pool up
        to ``num_valid_slots``); returns the pages given a key now.

        A page whose content is cached already under another page stays private to its
        sequence, and the chain goes on past it (later pages still get keys).
        """
        done, key = self._progress.get(seq_id) or (0, root_key(salt))
        ps = self.page_size
        newly: list[int] = []
        i = done
        while i < len(table) and (i + 1) * ps <= num_valid_slots and self._keyable(i, len(token_ids)):
            key = next_key(key, token_ids[i * ps : (i + 1) * ps + self.lookahead])
            if allocator.set_key(table[i], key):
                newly.append(table[i])
            i += 1
        if i != done:
            self._progress[seq_id] = (i, key)
        return newly

    def forget(self, seq_id: int) -> None:
        """``seq_id`` left (finished, preempted, failed): drop its chain position."""
        self._progress.pop(seq_id, None)

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_tokens": self.hit_tokens}
