"""Paged KV cache shared by every model of a generator: one page allocator, per-sequence page
tables, per-model page pools."""

from specdec.kv.allocator import OutOfPages, PageAllocator
from specdec.kv.paged import KVCacheManager, KVSpec, ModelKV, PagePool

__all__ = ["OutOfPages", "PageAllocator", "KVSpec", "PagePool", "KVCacheManager", "ModelKV"]
