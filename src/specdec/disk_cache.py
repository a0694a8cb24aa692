"""Cache folders on disk: their entries, least-recently-used eviction, and the size bound.

An entry is one folder of a cache folder (a packed model under ``<cache root>/packed``, a CPU
kernel build under ``<cache root>/torch_extensions``). Its size is the sum of its files' sizes,
its last use the newest modification time among them: loading an entry touches its file
(:func:`touch`), writing one creates new files, so both count as a use without a separate
record that two processes would have to update together.

Several processes may share a cache folder (parallel test workers, a server beside a
notebook), so nothing here holds a lock: an entry is removed by renaming it aside first (atomic;
a process that already opened its files keeps reading them) and then deleting the renamed
folder, and every step tolerates files that another process removed a moment earlier.
Entries being written (a temporary file younger than :data:`WRITE_TIMEOUT_S`) and entries
used in the last :data:`RECENT_S` seconds are never evicted: another process may be about to
map the file it just wrote or loaded.

Example::

    bound = packed_cache_max_bytes()             # 8 GiB unless SPECDEC_PACKED_CACHE_MAX_SIZE says
    evict(packed_dir(), bound, reserve=new_entry_bytes, keep=[new_entry_folder])
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import attrs

__all__ = [
    "CacheEntry",
    "DEFAULT_PACKED_CACHE_MAX_BYTES",
    "LABEL_FILE",
    "PACKED_CACHE_MAX_SIZE_ENV",
    "RECENT_S",
    "WRITE_TIMEOUT_S",
    "eviction_plan",
    "evict",
    "format_size",
    "packed_cache_max_bytes",
    "parse_size",
    "remove_entry",
    "scan_entries",
    "touch",
]

PACKED_CACHE_MAX_SIZE_ENV = "SPECDEC_PACKED_CACHE_MAX_SIZE"
# 8 GiB holds every format of the largest model the README names (Qwen2.5-1.5B: packed bf16
# 3.4 GB, int8 1.9 GB, q4 1.2 GB), so switching formats never repacks, while the folder can
# no longer grow by a few GB per afternoon of experiments. A share of the free disk would make
# the bound move with unrelated files, and what a load costs would then depend on them.
DEFAULT_PACKED_CACHE_MAX_BYTES = 8 * 1024**3
RECENT_S = 60.0  # an entry used this recently may be mapped by another process right now
WRITE_TIMEOUT_S = 3600.0  # a temporary file older than this belongs to a writer that died
_TEMPORARY = re.compile(r"\.tmp\d+$")  # how writers name a file before renaming it into place
_TRASH_PREFIX = ".trash-"
LABEL_FILE = "source.txt"  # in an entry: what it holds, in words, for ``specdec cache list``

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


@attrs.frozen(kw_only=True)
class CacheEntry:
    """One entry of a cache folder, as :func:`scan_entries` found it."""

    name: str
    path: Path
    size: int  # bytes, all its files
    last_used: float  # seconds since the epoch: its newest file's modification time
    writing: bool  # it holds a temporary file younger than WRITE_TIMEOUT_S


def parse_size(text: str) -> int | None:
    """``"8GiB"``, ``"500M"``, ``"2.5 GB"``, ``"0"`` -> bytes; ``"unlimited"`` -> ``None``.

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000 (any case).

    >>> parse_size("8GiB") == 8 * 1024**3, parse_size("1.5k"), parse_size("unlimited")
    (True, 1536, None)
    """
    value = text.strip().lower()
    if value in {"unlimited", "none"}:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([a-z]*)", value)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"size must be a number of bytes with an optional unit (K, M, G, T, KiB.., KB..) or "
            f"'unlimited', like '8GiB' or '500M'; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(size: int | None) -> str:
    """Bytes as a short human-readable string (powers of 1024).

    >>> format_size(3 * 1024**3 + 1), format_size(512), format_size(None)
    ('3.0 GiB', '512 B', 'unlimited')
    """
    if size is None:
        return "unlimited"
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def packed_cache_max_bytes() -> int | None:
    """The bound of the packed-weights cache: ``$SPECDEC_PACKED_CACHE_MAX_SIZE`` when set and
    non-empty (``"0"``: write no entries; ``"unlimited"``: no bound), else 8 GiB. Raises a
    ValueError naming the variable when it cannot be read."""
    text = os.environ.get(PACKED_CACHE_MAX_SIZE_ENV, "").strip()
    if not text:
        return DEFAULT_PACKED_CACHE_MAX_BYTES
    try:
        return parse_size(text)
    except ValueError as err:
        raise ValueError(f"{PACKED_CACHE_MAX_SIZE_ENV}: {err}") from err


def touch(path: Path) -> None:
    """Mark the entry holding ``path`` as used now; harmless where it vanished or is read-only."""
    try:
        os.utime(path)
    except OSError:
        pass


def scan_entries(
    folder: Path, *, now: float | None = None, skip: Collection[str] = ()
) -> list[CacheEntry]:
    """The entries (sub-folders) of ``folder`` but those named in ``skip``, oldest use first;
    none where it does not exist. Hidden folders (staging areas, folders renamed aside for
    removal) and folders vanishing while read are left out."""
    now = time.time() if now is None else now
    try:
        children = sorted(os.scandir(folder), key=lambda d: d.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    entries = []
    for child in children:
        if (
            child.name.startswith(".")
            or child.name in skip
            or not child.is_dir(follow_symlinks=False)
        ):
            continue
        entry = _scan_entry(Path(child.path), now)
        if entry is not None:
            entries.append(entry)
    return sorted(entries, key=lambda e: (e.last_used, e.name))


def _scan_entry(path: Path, now: float) -> CacheEntry | None:
    size, last_used, writing = 0, 0.0, False
    try:
        last_used = path.stat().st_mtime
        for root, _, files in os.walk(path):
            for name in files:
                try:
                    st = os.stat(os.path.join(root, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed (or renamed into place) while we looked
                size += st.st_size
                last_used = max(last_used, st.st_mtime)
                writing |= bool(_TEMPORARY.search(name)) and now - st.st_mtime < WRITE_TIMEOUT_S
    except FileNotFoundError:
        return None
    return CacheEntry(name=path.name, path=path, size=size, last_used=last_used, writing=writing)


def eviction_plan(
    entries: Sequence[CacheEntry],
    max_bytes: int,
    *,
    reserve: int = 0,
    keep: Collection[str] = (),
    now: float | None = None,
) -> list[CacheEntry]:
    """The entries to remove, least recently used first, so that the rest plus ``reserve``
    bytes (an entry about to be written) fit in ``max_bytes``: a pure function of its inputs.

    Never chosen: entries named in ``keep``, entries being written, entries used within
    :data:`RECENT_S` of ``now``. When those alone exceed the bound the plan falls short of it
    (the caller decides whether to write anyway)."""
    if max_bytes < 0 or reserve < 0:
        raise ValueError(f"max_bytes and reserve must be >= 0, got {max_bytes} and {reserve}")
    now = time.time() if now is None else now
    excess = sum(e.size for e in entries) + reserve - max_bytes
    plan = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.name)):
        if excess <= 0:
            break
        if entry.name in keep or entry.writing or now - entry.last_used < RECENT_S:
            continue
        plan.append(entry)
        excess -= entry.size
    return plan


def evict(
    folder: Path,
    max_bytes: int | None,
    *,
    reserve: int = 0,
    keep: Collection[str] = (),
    now: float | None = None,
) -> list[CacheEntry]:
    """Remove the least recently used entries of ``folder`` until the rest and ``reserve`` more
    bytes fit in ``max_bytes`` (``None``: no bound, nothing removed), within the limits of
    :func:`eviction_plan`; returns the entries removed (by this process)."""
    _sweep_trash(folder)
    if max_bytes is None:
        return []
    plan = eviction_plan(
        scan_entries(folder, now=now), max_bytes, reserve=reserve, keep=keep, now=now
    )
    removed = []
    for entry in plan:
        try:
            if remove_entry(entry.path):
                removed.append(entry)
        except OSError:
            continue  # not ours to remove (permissions): the bound is a goal, not worth a failed load
    return removed


def remove_entry(path: Path) -> bool:
    """Remove the entry folder ``path``: renamed aside first, so that it vanishes from its name
    at once and a second remover finds nothing; ``False`` where it was already gone."""
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _sweep_trash(folder: Path) -> None:
    """Finish removals that a killed process left half done (its renamed folders)."""
    try:
        leftovers = [p for p in folder.iterdir() if p.name.startswith(_TRASH_PREFIX)]
    except OSError:
        return
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)  # another process may be removing it too
