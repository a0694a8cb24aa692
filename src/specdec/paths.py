"""Where specdec keeps files on disk: one cache root for converted models, packed weights and
the CPU kernel's build (a module of its own so kernels need not import the downloader).

Layout under :func:`cache_root`: ``<name>/`` fetched models (:mod:`specdec.hub`),
:func:`packed_dir` packed and quantized weights (bounded, see :mod:`specdec.disk_cache`),
:func:`kernel_builds_dir` the CPU kernels' builds, one folder per source and environment."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "kernel_builds_dir", "packed_dir"]


def cache_root() -> Path:
    """The cache directory: ``$SPECDEC_CACHE`` when set and non-empty, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def packed_dir() -> Path:
    """Packed and quantized weights, one folder per entry (:mod:`specdec.models.packed_cache`)."""
    return cache_root() / "packed"


def kernel_builds_dir() -> Path:
    """Builds of the CPU kernels (:func:`specdec.kernels.cpu_linear.load_kernel`)."""
    return cache_root() / "torch_extensions"
