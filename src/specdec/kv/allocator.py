"""KV page allocation: one free list, one reference count per page, and content keys.

One :class:`PageAllocator` serves every model of a generator; page ids index the page pools of
all models at once (see :mod:`specdec.kv.paged`). A page is *free* exactly when its reference
count is 0; every page table holding a page owns one reference to it, so prefix sharing
(:meth:`KVCacheManager.fork <specdec.kv.paged.KVCacheManager.fork>`) is an ``incref``.

Prefix caching (:mod:`specdec.kv.prefix_cache`) gives a full page a *content key* once its KV
is final. A keyed page that no table holds is still free (it counts in ``num_free_pages``) but
keeps its KV: it waits in a least-recently-freed queue, and :meth:`PageAllocator.allocate` takes
never-keyed pages first and then evicts keyed ones oldest first, dropping their keys. Until
then :meth:`PageAllocator.lookup` finds it and ``incref`` revives it. The cache itself holds no
references, so a finished request's prefix costs nothing: it is free memory that remembers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

__all__ = ["OutOfPages", "PageAllocator"]


def require_int(name: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` if it is an ``int >= minimum`` (bools rejected), else raise naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class OutOfPages(RuntimeError):
    """Too few free pages for an all-or-nothing request; nothing was allocated.

    The scheduler catches it to preempt a sequence and retry.

    Attributes:
        requested: pages the request needed.
        available: pages free when it was refused.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"out of KV pages: requested {requested}, only {available} free")
        self.requested = requested
        self.available = available

    def __reduce__(self):
        # The default reduce would call __init__ with the message only.
        return (type(self), (self.requested, self.available))


class PageAllocator:
    """A fixed set of ``num_pages`` page ids with a free list and reference counts.

    Example:
        >>> alloc = PageAllocator(4)
        >>> pages = alloc.allocate(2)          # [0, 1], refcount 1 each
        >>> alloc.incref(pages[:1])            # page 0 now shared by two tables
        >>> alloc.free(pages)                  # page 1 is free again, page 0 still held once
        >>> alloc.num_free_pages
        3
    """

    def __init__(self, num_pages: int) -> None:
        require_int("num_pages", num_pages, minimum=1)
        self._refcounts = [0] * num_pages
        # Popped from the end: a fresh allocator hands out 0, 1, 2, ... and the most recently
        # freed page is reused first (its memory is likely still in cache). Keyed pages are not
        # here while keyed: they wait in _evictable instead.
        self._free = list(range(num_pages - 1, -1, -1))
        self._key_of: dict[int, bytes] = {}  # keyed page -> its content key
        self._page_of: dict[bytes, int] = {}  # content key -> page
        # Keyed pages no table holds, least recently freed first: evicted in this order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_total_pages(self) -> int:
        return len(self._refcounts)

    @property
    def num_free_pages(self) -> int:
        """Pages no table holds: never-keyed ones plus keyed ones kept for reuse (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return len(self._refcounts) - self.num_free_pages

    @property
    def num_keyed_pages(self) -> int:
        """Pages with a content key (held by tables or waiting to be evicted)."""
        return len(self._key_of)

    @property
    def num_evictable_pages(self) -> int:
        """Keyed pages no table holds (free, but their KV can still be reused)."""
        return len(self._evictable)

    def free_page_ids(self) -> frozenset[int]:
        """The free page ids (O(num_free_pages); for invariant checks and debugging)."""
        return frozenset(self._free) | frozenset(self._evictable)

    def refcount(self, page: int) -> int:
        """How many page tables hold ``page`` (0 when it is free)."""
        self._check_page(page)
        return self._refcounts[page]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with refcount 1; all or nothing.

        Raises:
            OutOfPages: fewer than ``n`` pages are free (the allocator is unchanged).
        """
        require_int("n", n)
        if n > self.num_free_pages:
            raise OutOfPages(n, self.num_free_pages)
        pages = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:  # then evict keyed pages, least recently freed first
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.num_evictions += 1
            pages.append(page)
        for page in pages:
            self._refcounts[page] = 1
        return pages

    # ---- content keys (prefix caching) -----------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The page holding the content ``key`` (held or evictable), or ``None``."""
        return self._page_of.get(key)

    def key_of(self, page: int) -> bytes | None:
        """``page``'s content key, or ``None`` when it has none."""
        self._check_page(page)
        return self._key_of.get(page)

    def set_key(self, page: int, key: bytes) -> bool:
        """Give the held ``page`` the content ``key`` (its KV is final from now on).

        Returns ``False`` (and changes nothing) when ``key`` already names another page (the
        same content computed twice: the first copy stays the cached one) or ``page`` already
        has a key.

        Raises:
            ValueError: ``page`` is free (only a page a table holds has KV worth keeping).
        """
        self._check_page(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"pages: page {page} is free; only held pages can be given a key")
        if key in self._page_of or page in self._key_of:
            return False
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two); a keyed page no
        table held comes back into use.

        Raises:
            ValueError: a page id is out of range, or free without a key (sharing a free page
                would let it be allocated twice). Nothing changes then.
        """
        pages = list(pages)
        for page in pages:
            self._check_page(page)
            if self._refcounts[page] == 0 and page not in self._evictable:
                raise ValueError(f"pages: page {page} is free; only allocated or cached pages can be shared")
        for page in pages:
            if self._refcounts[page] == 0:  # a cached page comes back into use
                del self._evictable[page]
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page at refcount 0 is free again (a keyed one
        keeps its KV and key until evicted: pages freed earlier go first, and of the pages of one
        call the last listed; pass a table in order, so that its first pages, the ones most
        prefixes share, stay longest).

        Raises:
            ValueError: a page id is out of range, or would be freed more times than it is held
                (a double free). Nothing changes then.
        """
        counts = Counter(pages)
        for page, times in counts.items():
            self._check_page(page)
            held = self._refcounts[page]
            if times > held:
                state = "already free" if held == 0 else f"held {held} time(s)"
                raise ValueError(f"pages: page {page} freed {times} time(s) but is {state}")
        # Validated above, so this loop cannot fail halfway.
        kept: list[int] = []  # keyed pages now free, in call order
        for page, times in counts.items():
            self._refcounts[page] -= times
            if self._refcounts[page] == 0:
                (kept if page in self._key_of else self._free).append(page)
        for page in reversed(kept):  # the call's first page is the most recent: evicted last
            self._evictable[page] = None

    def _check_page(self, page: object) -> None:
        if not isinstance(page, int) or isinstance(page, bool):
            raise TypeError(f"pages: page ids must be ints, got {type(page).__name__}")
        if not 0 <= page < len(self._refcounts):
            raise ValueError(f"pages: page id {page} out of range 0..{len(self._refcounts) - 1}")
