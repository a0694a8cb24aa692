"""Paged KV cache: per-model page pools, per-sequence page tables, truncate/compact/fork.

One :class:`~specdec.kv.allocator.PageAllocator` serves every model of a generator. Page tables
belong to *sequences*: slot ``p`` of sequence ``s`` (the KV of its ``p``-th token) lives at page
``table[p // page_size]``, offset ``p % page_size``. Each *model* (target, draft, MTP/EAGLE head)
owns a :class:`PagePool` with its own layer count and head shapes, indexed by the same page ids,
so one page table serves all models and a model's KV for slot ``p`` sits at the same page and
offset of its own pool::

    sequence 7, page_size 4, table (5, 2, 9)
    slots   0 1 2 3 | 4 5 6 7 | 8 9
    page    5       | 2       | 9        flat slot of slot 6 = 2 * 4 + 2 = 10

Pages shared by :meth:`KVCacheManager.fork` are read-only until
:meth:`KVCacheManager.ensure_writable` gives the writer its own copy (copy on write). With a
:class:`~specdec.kv.prefix_cache.PrefixCache`, :meth:`KVCacheManager.attach_prefix` starts a
sequence on the cached pages of its prompt's longest cached prefix and
:meth:`KVCacheManager.cache_prefix` keys a sequence's pages once their KV is final; keyed pages
are read-only too.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Mapping, Sequence

import attrs
import torch

from specdec.config import positive_int
from specdec.kv.allocator import OutOfPages, PageAllocator, require_int
from specdec.kv.prefix_cache import PrefixCache
from specdec.types import BatchLayout, LayoutHost

__all__ = ["KVSpec", "PagePool", "KVCacheManager", "ModelKV"]


def _non_empty_str(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty str, got {value!r}")


def _floating_dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{attribute.name} must be a floating torch.dtype, got {value!r}")


@attrs.frozen(kw_only=True)
class KVSpec:
    """The KV shape of one model, fixed for its lifetime.

    Example:
        >>> KVSpec(name="target", num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    """

    name: str = attrs.field(validator=_non_empty_str)
    num_layers: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(validator=_floating_dtype)


class PagePool:
    """One model's KV pages for every layer, in one tensor.

    ``cache`` is ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` with K at index
    0 and V at index 1 of dim 1, so ``cache[i, 0]`` is layer ``i``'s K pages in FlashInfer's NHD
    page layout. Slot ids passed to :meth:`copy_slots` are flat: ``page * page_size + offset``.

    Example:
        >>> pool = PagePool(spec, num_pages=8, page_size=16, device="cpu")
        >>> k_pages, v_pages = pool.layer(0)     # [8, 16, Hkv, D] views
    """

    def __init__(
        self, spec: KVSpec, *, num_pages: int, page_size: int, device: torch.device | str = "cpu"
    ) -> None:
        require_int("num_pages", num_pages, minimum=1)
        require_int("page_size", page_size, minimum=1)
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        # Zeros, not empty: masked-out slots are still read by some kernels, and garbage NaNs
        # there would survive a multiply by zero.
        self.cache = torch.zeros(
            (spec.num_layers, 2, num_pages, page_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=device,
        )  # [L, 2, num_pages, page_size, Hkv, D]
        # A view sharing storage with cache: the same memory addressed by flat slot id.
        self._slots = self.cache.view(
            spec.num_layers, 2, num_pages * page_size, spec.num_kv_heads, spec.head_dim
        )  # [L, 2, num_pages * page_size, Hkv, D]

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(k_pages, v_pages)``, views of ``[num_pages, page_size, Hkv, D]``."""
        require_int("i", i)
        if i >= self.spec.num_layers:
            raise ValueError(f"i must be in 0..{self.spec.num_layers - 1}, got {i}")
        return self.cache[i, 0], self.cache[i, 1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K and V of every layer from flat slots ``src`` to flat slots ``dst``.

        All of ``src`` is gathered before anything is written, so overlapping ranges are safe.
        ``dst`` must hold distinct in-range slots (not checked here: that would sync the device).

        Args:
            src: ``[n]`` int64 flat slot ids to read.
            dst: ``[n]`` int64 flat slot ids to write.
        """
        _check_index_pair(src, dst)
        move = _triton_kv_move() if self.device.type == "cuda" else None
        if move is not None:
            move(self._slots, src, dst)  # one gather + one scatter launch
            return
        rows = self._slots.index_select(2, src)  # [L, 2, n, Hkv, D], a copy
        self._slots.index_copy_(2, dst, rows)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (K and V of every layer): page ``src[j]`` onto page ``dst[j]``.

        Args:
            src: ``[n]`` int64 page ids to read.
            dst: ``[n]`` int64 distinct page ids to write.
        """
        _check_index_pair(src, dst)
        pages = self.cache.index_select(2, src)  # [L, 2, n, page_size, Hkv, D], a copy
        self.cache.index_copy_(2, dst, pages)



def _check_index_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``src`` and ``dst`` must be 1-D int64 index tensors of one shape (checked on the host:
    shapes and dtypes only, no device sync)."""
    for name, index in (("src", src), ("dst", dst)):
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or index.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must have the same shape, got {src.shape} and {dst.shape}")


def _triton_kv_move():
    """``kernels.triton.kv_move.move_slots`` (the same copy, tested against this module's),
    or ``None`` without Triton."""
    try:
        from specdec.kernels.triton.kv_move import move_slots
    except ImportError:
        return None
    return move_slots


class KVCacheManager:
    """Page tables of every sequence over one allocator, and the page pools of every model.

    Every operation validates its arguments before changing anything, and operations that
    allocate are all or nothing: on :class:`~specdec.kv.allocator.OutOfPages` the tables, the
    allocator and the pools are as they were.

    Example:
        >>> kv = KVCacheManager(PageAllocator(64), page_size=16)
        >>> target = kv.add_pool(KVSpec(name="target", num_layers=2, num_kv_heads=2,
        ...                             head_dim=8, dtype=torch.float32), device="cpu")
        >>> kv.add_sequence(0)
        >>> kv.reserve(0, 20)                      # two pages
        >>> layout = kv.build_layout([0], [[1, 2, 3]], [0])   # prefill three tokens
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int, *, prefix_cache: PrefixCache | None = None
    ) -> None:
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.page_size = require_int("page_size", page_size, minimum=1)
        if prefix_cache is not None and prefix_cache.page_size != self.page_size:
            raise ValueError(
                f"prefix_cache.page_size ({prefix_cache.page_size}) must equal page_size ({page_size})"
            )
        self.prefix_cache = prefix_cache  # None: every prefill computes its whole prompt
        self._pools: dict[str, PagePool] = {}
        self._tables: dict[int, list[int]] = {}

    # ---- pools ------------------------------------------------------------------------------

    def add_pool(self, spec: KVSpec, device: torch.device | str = "cpu") -> ModelKV:
        """Allocate a model's page pool, sized to every page of the allocator.

        Pools must all exist before the first sequence: a pool added later would hold no KV for
        the pages those sequences already filled.
        """
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if spec.name in self._pools:
            raise ValueError(f"spec.name {spec.name!r} already has a pool; names must be unique")
        if self._tables:
            raise ValueError("add_pool must be called before add_sequence (sequences exist)")
        pool = PagePool(
            spec, num_pages=self.allocator.num_total_pages, page_size=self.page_size, device=device
        )
        self._pools[spec.name] = pool
        return ModelKV(spec=spec, pool=pool, manager=self)

    @property
    def pools(self) -> Mapping[str, PagePool]:
        """Read-only mapping from ``KVSpec.name`` to that model's pool."""
        return types.MappingProxyType(self._pools)

    # ---- sequences --------------------------------------------------------------------------

    def add_sequence(self, seq_id: int) -> None:
        """Start an empty page table for ``seq_id``."""
        require_int("seq_id", seq_id)
        if seq_id in self._tables:
            raise ValueError(f"seq_id {seq_id} already exists")
        self._tables[seq_id] = []

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def seq_ids(self) -> tuple[int, ...]:
        return tuple(self._tables)

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._table(seq_id))

    def capacity(self, seq_id: int) -> int:
        """Slots covered by the sequence's pages (a multiple of ``page_size``)."""
        return len(self._table(seq_id)) * self.page_size

    def pages_for(self, num_slots: int) -> int:
        """Pages that cover ``num_slots`` slots: ``ceil(num_slots / page_size)``."""
        require_int("num_slots", num_slots)
        return -(-num_slots // self.page_size)

    def pages_needed(self, seq_id: int, num_slots: int) -> int:
        """New pages :meth:`reserve` would take to cover ``num_slots`` slots (0 if covered)."""
        return max(0, self.pages_for(num_slots) - len(self._table(seq_id)))

    def can_reserve(self, requests: Mapping[int, int]) -> bool:
        """Whether every ``seq_id -> num_slots`` reservation fits in the free pages together.

        For admission: an id not added yet counts as a new, empty sequence.
        """
        needed = 0
        for seq_id, num_slots in requests.items():
            held = len(self._tables.get(seq_id, ()))
            needed += max(0, self.pages_for(num_slots) - held)
        return needed <= self.allocator.num_free_pages

    def reserve(self, seq_id: int, num_slots: int) -> int:
        """Grow the page table to cover at least ``num_slots`` slots; never shrinks it.

        Returns:
            The number of pages added.

        Raises:
            OutOfPages: too few free pages; nothing changed.
        """
        table = self._table(seq_id)
        needed = self.pages_needed(seq_id, num_slots)
        if needed:
            table.extend(self.allocator.allocate(needed))
        return needed

    def truncate(self, seq_id: int, num_slots: int) -> None:
        """Keep the pages of slots ``0 .. num_slots - 1``; free every whole page past them.

        ``num_slots`` must be in ``0 .. capacity(seq_id)``.
        """
        table = self._table(seq_id)
        self._check_slot_count("num_slots", num_slots, seq_id)
        keep = self.pages_for(num_slots)
        if keep < len(table):
            self.allocator.free(table[keep:])
            del table[keep:]

    # ---- prefix caching ---------------------------------------------------------------------

    def attach_prefix(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None = None
    ) -> tuple[int, int]:
        """Start the empty sequence ``seq_id`` on the cached pages of ``token_ids``' longest
        cached prefix (shared, read-only); returns the slots they cover and how many of those
        (from slot 0) are final in every pool; (0, 0) without a cache.

        The sequence's prefill then starts at the first; the proposer's pool is final up to the
        second. Pages past it (partial: final in the target's pool only, see
        :mod:`~specdec.kv.prefix_cache`) become the sequence's own copies at once, as the
        proposer will write its KV there when it catches up; with too few free pages for the
        copies only the complete pages are used. At least one token is left uncached.
        """
        table = self._table(seq_id)
        cache = self.prefix_cache
        if cache is None:
            return 0, 0
        if table:
            raise ValueError(f"sequence {seq_id} already holds pages; attach_prefix starts empty ones")
        pages, key, complete = cache.match(self.allocator, token_ids, salt)
        self.share_pages(seq_id, pages)
        cache.start(seq_id, len(pages), key)
        slots, complete_slots = len(pages) * self.page_size, complete * self.page_size
        if complete_slots < slots:
            try:
                self.ensure_writable(seq_id, complete_slots)
            except OutOfPages:
                self.truncate(seq_id, complete_slots)
                cache.start(seq_id, complete, cache.chain_key(token_ids, complete, salt))
                slots = complete_slots
        return slots, complete_slots

    def share_pages(self, seq_id: int, pages: Sequence[int]) -> None:
        """Append ``pages`` (held or cached) to ``seq_id``'s table, one reference each."""
        table = self._table(seq_id)
        self.allocator.incref(pages)
        table.extend(pages)

    def cache_prefix(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        num_valid_slots: int,
        salt: str | None = None,
        num_target_slots: int | None = None,
    ) -> list[int]:
        """Key ``seq_id``'s full pages below ``num_valid_slots`` (its KV is final there in every
        pool), so later prompts find them; returns the pages keyed now. A no-op without a cache.
        ``num_target_slots``: the target's KV is final up to there (a partial cache keys the
        pages in between as partial; for a sequence that ends, as it writes them no more).
        """
        table = self._table(seq_id)
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.keyed(
            self.allocator, seq_id, table, token_ids, num_valid_slots, salt, num_target_slots
        )

    def fork(self, src_seq_id: int, dst_seq_id: int) -> None:
        """Start ``dst_seq_id`` sharing every page of ``src_seq_id`` (prefix sharing).

        The shared pages are read-only for both until :meth:`ensure_writable`.
        """
        table = self._table(src_seq_id)
        require_int("dst_seq_id", dst_seq_id)
        if dst_seq_id in self._tables:
            raise ValueError(f"dst_seq_id {dst_seq_id} already exists")
        self.allocator.incref(table)
        self._tables[dst_seq_id] = list(table)

    def ensure_writable(self, seq_id: int, start_slot: int) -> int:
        """Give ``seq_id`` its own copy of every shared or keyed page holding slots ``>= start_slot``.

        Copy on write after :meth:`fork`: call before writing slots from ``start_slot`` on
        (:meth:`build_layout` and :meth:`compact` refuse to write into a shared page).

        Returns:
            The number of pages copied.

        Raises:
            OutOfPages: too few free pages for the copies; nothing changed.
        """
        table = self._table(seq_id)
        self._check_slot_count("start_slot", start_slot, seq_id)
        shared = [
            i
            for i in range(start_slot // self.page_size, len(table))
            if not self._writable(table[i])
        ]
        if not shared:
            return 0
        fresh = self.allocator.allocate(len(shared))
        old = [table[i] for i in shared]
        self._for_each_pool(old, fresh, PagePool.copy_pages)
        for i, page in zip(shared, fresh, strict=True):
            table[i] = page
        # Still held by the other sequences, so these decrefs never reach 0.
        self.allocator.free(old)
        return len(shared)

    def compact(self, seq_id: int, src_slots: Sequence[int], dst_start: int) -> None:
        """Move the KV of slots ``src_slots`` to slots ``dst_start, dst_start + 1, ...``.

        In every pool at once. For tree verification: the accepted path's rows are scattered
        over the verify slots and must become one contiguous run. All sources are read before
        anything is written, so the ranges may overlap.
        """
        self._table(seq_id)
        src_slots = list(src_slots)
        require_int("dst_start", dst_start)
        dst_end = dst_start + len(src_slots)
        self._check_slot_count("dst_start + len(src_slots)", dst_end, seq_id)
        src = self.slot_ids(seq_id, src_slots)
        dst = self.slot_ids(seq_id, range(dst_start, dst_end))
        self._check_exclusive(seq_id, dst_start, dst_end)
        # A slot already in place needs no copy, and dropping it cannot change the others:
        # dst slots are distinct and every read happens before any write.
        pairs = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
        if pairs:
            self._for_each_pool([s for s, _ in pairs], [d for _, d in pairs], PagePool.copy_slots)

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references to its pages and forget it (its keyed pages stay
        cached until evicted, its first pages longest)."""
        table = self._table(seq_id)
        self.allocator.free(table)
        del self._tables[seq_id]
        if self.prefix_cache is not None:
            self.prefix_cache.forget(seq_id)

    # ---- metadata ---------------------------------------------------------------------------

    def slot_ids(self, seq_id: int, slots: Sequence[int]) -> list[int]:
        """Sequence-relative slots -> flat pool slot ids (``page * page_size + offset``)."""
        table = self._table(seq_id)
        capacity = len(table) * self.page_size
        ps = self.page_size
        out = []
        for slot in slots:
            if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < capacity:
                raise ValueError(
                    f"slots must be ints in 0..{capacity - 1} (capacity of sequence {seq_id}), "
                    f"got {slot!r}"
                )
            out.append(table[slot // ps] * ps + slot % ps)
        return out

    def page_metadata(
        self, seq_ids: Sequence[int], kv_lens: Sequence[int], device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The paged-KV CSR FlashInfer takes, over the first ``ceil(kv_len / page_size)`` pages.

        Returns:
            ``kv_page_indptr`` ``[batch + 1]`` int32, ``kv_page_indices`` ``[num_used_pages]``
            int32 and ``kv_last_page_len`` ``[batch]`` int32 (each in ``1 .. page_size``).
        """
        if len(seq_ids) != len(kv_lens):
            raise ValueError(
                f"kv_lens must have one entry per sequence ({len(seq_ids)}), got {len(kv_lens)}"
            )
        for i, (seq_id, kv_len) in enumerate(zip(seq_ids, kv_lens, strict=True)):
            require_int(f"kv_lens[{i}]", kv_len, minimum=1)
            self._check_slot_count(f"kv_lens[{i}]", kv_len, seq_id)
        indptr, indices, last = self._page_csr(seq_ids, kv_lens)
        return (
            torch.tensor(indptr, dtype=torch.int32, device=device),  # [batch + 1] int32
            torch.tensor(indices, dtype=torch.int32, device=device),  # [num_used_pages] int32
            torch.tensor(last, dtype=torch.int32, device=device),  # [batch] int32
        )

    def build_layout(
        self,
        seq_ids: Sequence[int],
        new_token_ids: Sequence[Sequence[int]],
        start_slots: Sequence[int],
        *,
        positions: Sequence[Sequence[int] | None] | None = None,
        tree_masks: Sequence[torch.Tensor | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> BatchLayout:
        """The ragged batch of one model forward (see :class:`~specdec.types.BatchLayout`).

        Sequence ``i``'s new rows take slots ``start_slots[i] .. start_slots[i] + q_len_i - 1``,
        so ``kv_lens[i] = start_slots[i] + q_len_i``. Positions default to the slots (prefill,
        causal chains); a tree passes depth-based ``positions`` and a ``[q_len_i, q_len_i]`` bool
        ``tree_masks[i]`` (row ``r`` sees column ``c`` when ``c`` is ``r``'s ancestor or
        ``r`` itself). A ``None`` mask means causal; if every mask is ``None`` the layout has no
        tree mask.

        Capacity must already cover every ``kv_lens[i]`` (the engine reserves first), and the
        written pages must not be shared (see :meth:`ensure_writable`).

        Example:
            >>> kv.build_layout([3, 5], [[11], [21, 22, 23]], [7, 2])   # a decode and a chain
        """
        batch = len(seq_ids)
        if batch == 0:
            raise ValueError("seq_ids must name at least one sequence")
        if len(set(seq_ids)) != batch:
            raise ValueError(f"seq_ids must be distinct, got {list(seq_ids)}")
        for name, arg in (
            ("new_token_ids", new_token_ids),
            ("start_slots", start_slots),
            ("positions", positions),
            ("tree_masks", tree_masks),
        ):
            if arg is not None and len(arg) != batch:
                raise ValueError(
                    f"{name} must have one entry per sequence ({batch}), got {len(arg)}"
                )

        ps = self.page_size
        q_lens: list[int] = []
        kv_lens: list[int] = []
        slot_mapping: list[int] = []
        flat_positions: list[int] = []
        for i, seq_id in enumerate(seq_ids):
            table = self._table(seq_id)
            q_len = len(new_token_ids[i])
            if q_len == 0:
                raise ValueError(f"new_token_ids[{i}] must hold at least one token")
            start = require_int(f"start_slots[{i}]", start_slots[i])
            kv_len = start + q_len
            if kv_len > len(table) * ps:
                raise ValueError(
                    f"sequence {seq_id}: kv_len {kv_len} exceeds its capacity "
                    f"{len(table) * ps}; reserve() first"
                )
            self._check_exclusive(seq_id, start, kv_len)
            q_lens.append(q_len)
            kv_lens.append(kv_len)
            slot_mapping.extend(table[s // ps] * ps + s % ps for s in range(start, kv_len))
            seq_positions = None if positions is None else positions[i]
            if seq_positions is None:
                flat_positions.extend(range(start, kv_len))
            elif len(seq_positions) != q_len:
                raise ValueError(
                    f"positions[{i}] must have {q_len} entries, got {len(seq_positions)}"
                )
            else:
                flat_positions.extend(seq_positions)

        page_indptr, page_indices, last_page_len = self._page_csr(seq_ids, kv_lens)
        tokens = list(itertools.chain.from_iterable(new_token_ids))
        tree_mask = _flat_tree_mask(tree_masks, q_lens, "cpu")  # [sum(q_len_i**2)] bool | None
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return BatchLayout(
            token_ids=torch.tensor(tokens, **i64),  # [num_tokens] int64
            positions=torch.tensor(flat_positions, **i64),  # [num_tokens] int64
            qo_indptr=torch.tensor([0, *itertools.accumulate(q_lens)], **i32),  # [batch + 1] int32
            kv_page_indptr=torch.tensor(page_indptr, **i32),  # [batch + 1] int32
            kv_page_indices=torch.tensor(page_indices, **i32),  # [num_used_pages] int32
            kv_last_page_len=torch.tensor(last_page_len, **i32),  # [batch] int32
            slot_mapping=torch.tensor(slot_mapping, **i64),  # [num_tokens] int64
            q_lens=tuple(q_lens),
            kv_lens=tuple(kv_lens),
            page_size=ps,
            tree_mask=None if tree_mask is None else tree_mask.to(device),
            seq_ids=tuple(seq_ids),
            host=LayoutHost(
                kv_page_indptr=tuple(page_indptr),
                kv_page_indices=tuple(page_indices),
                kv_last_page_len=tuple(last_page_len),
                tree_mask=tree_mask,
            ),
        )

    def stats(self) -> dict[str, int]:
        """Occupancy counters for logs and metrics."""
        stats = {
            "page_size": self.page_size,
            "num_total_pages": self.allocator.num_total_pages,
            "num_free_pages": self.allocator.num_free_pages,  # cached pages no table holds too
            "num_used_pages": self.allocator.num_used_pages,
            "num_sequences": len(self._tables),
            "num_pools": len(self._pools),
            "pool_bytes": sum(pool.nbytes for pool in self._pools.values()),
        }
        if self.prefix_cache is not None:
            stats |= self.prefix_cache.stats()
            stats["prefix_cache_pages"] = self.allocator.num_keyed_pages
            stats["prefix_cache_evictable_pages"] = self.allocator.num_evictable_pages
            stats["prefix_cache_evictions"] = self.allocator.num_evictions
        return stats

    # ---- helpers ----------------------------------------------------------------------------

    def _table(self, seq_id: int) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown seq_id {seq_id!r}") from None

    def _check_slot_count(self, name: str, value: int, seq_id: int) -> None:
        require_int(name, value)
        capacity = len(self._table(seq_id)) * self.page_size
        if value > capacity:
            raise ValueError(
                f"{name} must be in 0..{capacity} (capacity of sequence {seq_id}), got {value}"
            )

    def _writable(self, page: int) -> bool:
        """One table holds ``page`` and it has no content key (keyed KV is read-only)."""
        return self.allocator.refcount(page) == 1 and self.allocator.key_of(page) is None

    def _check_exclusive(self, seq_id: int, start: int, end: int) -> None:
        """Refuse to write slots ``start .. end - 1`` if any of their pages is shared or keyed."""
        if end <= start:
            return
        table = self._tables[seq_id]
        for i in range(start // self.page_size, (end - 1) // self.page_size + 1):
            if not self._writable(table[i]):
                raise ValueError(
                    f"sequence {seq_id}: page {table[i]} (slots {i * self.page_size}.."
                    f"{(i + 1) * self.page_size - 1}) is shared or in the prefix cache; call "
                    f"ensure_writable({seq_id}, {start}) before writing to it"
                )

    def _page_csr(
        self, seq_ids: Sequence[int], kv_lens: Sequence[int]
    ) -> tuple[list[int], list[int], list[int]]:
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for seq_id, kv_len in zip(seq_ids, kv_lens, strict=True):
            num_pages = self.pages_for(kv_len)
            indices.extend(self._tables[seq_id][:num_pages])
            indptr.append(len(indices))
            last.append(kv_len - (num_pages - 1) * self.page_size)
        return indptr, indices, last

    def _for_each_pool(self, src: list[int], dst: list[int], copy) -> None:
        """Run ``copy(pool, src, dst)`` on every pool, building the index tensors once per device."""
        by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for pool in self._pools.values():
            if pool.device not in by_device:
                by_device[pool.device] = (
                    torch.tensor(src, dtype=torch.int64, device=pool.device),  # [n] int64
                    torch.tensor(dst, dtype=torch.int64, device=pool.device),  # [n] int64
                )
            copy(pool, *by_device[pool.device])


def _flat_tree_mask(
    tree_masks: Sequence[torch.Tensor | None] | None,
    q_lens: Sequence[int],
    device: torch.device | str,
) -> torch.Tensor | None:
    """Row-major concatenation of every ``[q_len, q_len]`` mask; causal blocks fill ``None``."""
    if tree_masks is None or all(mask is None for mask in tree_masks):
        return None
    blocks = []
    for i, (mask, q_len) in enumerate(zip(tree_masks, q_lens, strict=True)):
        if mask is None:
            mask = torch.ones((q_len, q_len), dtype=torch.bool).tril_()
        elif not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"tree_masks[{i}] must be a bool tensor or None")
        elif tuple(mask.shape) != (q_len, q_len):
            raise ValueError(
                f"tree_masks[{i}] must have shape ({q_len}, {q_len}), got {tuple(mask.shape)}"
            )
        blocks.append(mask.to(device).reshape(-1))
    return torch.cat(blocks)  # [sum(q_len_i ** 2)] bool


class ModelKV:
    """One model's view of the shared cache: its pool plus the manager's page tables.

    Example:
        >>> draft = manager.add_pool(draft_spec, device="cpu")
        >>> layout = draft.layout([0], [[5, 6]], [10])      # tensors on the pool's device
        >>> k_pages, v_pages = draft.layer(0)
    """

    __slots__ = ("spec", "pool", "manager")

    def __init__(self, *, spec: KVSpec, pool: PagePool, manager: KVCacheManager) -> None:
        self.spec = spec
        self.pool = pool
        self.manager = manager

    @property
    def page_size(self) -> int:
        return self.manager.page_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s ``(k_pages, v_pages)``, each ``[num_pages, page_size, Hkv, D]``."""
        return self.pool.layer(i)

    def layout(self, *args, device: torch.device | str | None = None, **kwargs) -> BatchLayout:
        """:meth:`KVCacheManager.build_layout` (the same arguments), on the pool's device unless
        ``device`` says otherwise."""
        device = self.pool.device if device is None else device
        return self.manager.build_layout(*args, device=device, **kwargs)
