"""How big a generator's KV cache is: the longest sequence, the page pool, and whether it fits.

Two sizes, kept apart: ``max_model_len`` bounds one request (prompt + output, the target's
context by default), while the page pool is shared by every sequence, which draws pages as it
grows. The default pool holds ``max_batch_size`` sequences of up to :data:`DEFAULT_SLOT_TOKENS`
tokens and at least one of ``max_model_len``, so a long-context model costs no more memory up
front than a 4k one at the same batch until requests need it (then the scheduler preempts).

Example:
    >>> pool_pages(CacheConfig(), max_len=32768, k=4)    # 8 x 4,096 tokens, 16-slot pages
    2056
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.config import CacheConfig
from specdec.kv.paged import KVSpec

__all__ = [
    "DEFAULT_SLOT_TOKENS",
    "available_memory",
    "check_pool_fits",
    "length_bound",
    "model_len",
    "pool_pages",
]

# A batch slot's share of the default pool: what every slot got before the pool followed the
# model's context, so a 32k model is no larger by default than it was at a 4,096-token cap.
DEFAULT_SLOT_TOKENS = 4096

_GIB = 1024**3


def model_len(
    cache_config: CacheConfig, max_context: int, context_field: str = "max_position_embeddings"
) -> int:
    """The most tokens one request may reach: ``cache_config.max_model_len`` (or its deprecated
    name ``max_num_tokens``), else the target's context; ValueError past the context, naming
    ``context_field``, the config field that sets it.

    >>> model_len(CacheConfig(max_model_len=100), 512), model_len(CacheConfig(), 512)
    (100, 512)
    """
    given = cache_config.sequence_limit
    if given is None:
        return max_context
    if given > max_context:
        raise ValueError(
            f"max_model_len ({given}) exceeds the model's context ({context_field} = "
            f"{max_context}); pass at most {max_context}, or None for the whole context"
        )
    return given


def pool_pages(cache_config: CacheConfig, *, max_len: int, k: int) -> int:
    """Pages of the pool: ``cache_config.num_pages``, else ``max_batch_size`` sequences of up to
    :data:`DEFAULT_SLOT_TOKENS` tokens and never fewer than one of ``max_len`` (each sequence
    with the ``k + 1`` slots a verify step writes past it).

    >>> pool_pages(CacheConfig(page_size=16, max_batch_size=2), max_len=100, k=0)
    14
    """
    if cache_config.num_pages is not None:
        return cache_config.num_pages

    def pages(tokens: int) -> int:
        return math.ceil((tokens + k + 1) / cache_config.page_size)

    return max(
        cache_config.max_batch_size * pages(min(max_len, DEFAULT_SLOT_TOKENS)), pages(max_len)
    )


def length_bound(
    *,
    max_len: int,
    capacity: int,
    max_context: int,
    cache_config: CacheConfig,
    context_field: str = "max_position_embeddings",
) -> str:
    """What holds a request to ``min(max_len, capacity)`` tokens, and how to raise it (for the
    errors of over-long requests)."""
    if capacity < max_len:
        return (
            f"what the KV cache's {cache_config.num_pages} pages of {cache_config.page_size} "
            "slots hold for one sequence; raise CacheConfig(num_pages=...)"
        )
    if max_len < max_context:
        return (
            f"max_model_len; raise CacheConfig(max_model_len=...) or --max-model-len, up to the "
            f"model's context of {max_context}"
        )
    return f"the model's context, {context_field}"


def check_pool_fits(
    specs: Sequence[KVSpec], *, num_pages: int, page_size: int, max_len: int, device: torch.device
) -> None:
    """ValueError, before any page is allocated, when the pools of ``specs`` (one per model)
    need more bytes than ``device`` has free; silent where that is unknown."""
    free = available_memory(device)
    slot_bytes = sum(
        s.num_layers * 2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize for s in specs
    )
    need = num_pages * page_size * slot_bytes
    if free is None or need <= free:
        return
    raise ValueError(
        f"max_model_len ({max_len}) and num_pages ({num_pages} of {page_size} slots) make a KV "
        f"cache of {_size(need)}, but {device} has {_size(free)} free; lower "
        "CacheConfig(max_model_len=...) (--max-model-len), or num_pages or max_batch_size"
    )


def _size(num_bytes: int) -> str:
    """``num_bytes`` for people: GiB, or MiB below one GiB."""
    return f"{num_bytes / _GIB:.1f} GiB" if num_bytes >= _GIB else f"{num_bytes / 2**20:.1f} MiB"


def available_memory(device: torch.device) -> int | None:
    """Bytes ``device`` can still give new tensors: free CUDA memory, or Linux's MemAvailable
    (page cache counts as free: the kernel drops it on demand); ``None`` where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError):
        pass
    return None
