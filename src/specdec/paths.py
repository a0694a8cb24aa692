"""Where specdec keeps files on disk: one cache root for converted models, packed weights and
the CPU kernel's build (a module of its own so kernels need not import the downloader)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """The cache directory: ``$SPECDEC_CACHE`` when set and non-empty, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"
