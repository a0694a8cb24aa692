"""KV page allocation: one free list and one reference count per page.

One :class:`PageAllocator` serves every model of a generator; page ids index the page pools of
all models at once (see :mod:`specdec.kv.paged`). A page is *free* exactly when its reference
count is 0; every page table holding a page owns one reference to it, so prefix sharing
(:meth:`KVCacheManager.fork <specdec.kv.paged.KVCacheManager.fork>`) is an ``incref``.
"""

from __future__ import annotations

from collections import Counter
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
        # freed page is reused first (its memory is likely still in cache).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_total_pages(self) -> int:
        return len(self._refcounts)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return len(self._refcounts) - len(self._free)

    def free_page_ids(self) -> frozenset[int]:
        """The free page ids (O(num_free_pages); for invariant checks and debugging)."""
        return frozenset(self._free)

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
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gains two).

        Raises:
            ValueError: a page id is out of range or free (sharing a free page would let it be
                allocated twice). Nothing changes then.
        """
        pages = list(pages)
        for page in pages:
            self._check_page(page)
            if self._refcounts[page] == 0:
                raise ValueError(f"pages: page {page} is free; only allocated pages can be shared")
        for page in pages:
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page at refcount 0 returns to the free list.

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
        for page, times in counts.items():
            self._refcounts[page] -= times
            if self._refcounts[page] == 0:
                self._free.append(page)

    def _check_page(self, page: object) -> None:
        if not isinstance(page, int) or isinstance(page, bool):
            raise TypeError(f"pages: page ids must be ints, got {type(page).__name__}")
        if not 0 <= page < len(self._refcounts):
            raise ValueError(f"pages: page id {page} out of range 0..{len(self._refcounts) - 1}")
