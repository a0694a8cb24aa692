"""``specdec cache list | clear | prune``: what specdec keeps on disk, and removing it.

Three kinds of entries live under the cache root (:mod:`specdec.paths`): packed and quantized
weights (bounded by ``$SPECDEC_PACKED_CACHE_MAX_SIZE``, evicted least recently used first),
CPU kernel builds (one per kernel source and environment) and fetched models
(``specdec fetch``). ``clear --all`` removes the first two, which a later load rebuilds
without the network; a fetched model goes only when named.

Example::

    specdec cache list
    specdec cache clear 7bab80          # an entry, by its name or a unique prefix of it
    specdec cache prune --max-size 4GiB
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import attrs

from specdec.disk_cache import (
    LABEL_FILE,
    PACKED_CACHE_MAX_SIZE_ENV,
    CacheEntry,
    evict,
    format_size,
    packed_cache_max_bytes,
    parse_size,
    remove_entry,
    scan_entries,
)
from specdec.paths import cache_root, kernel_builds_dir, packed_dir

__all__ = ["add_cache_parser", "run_cache"]


@attrs.frozen(kw_only=True)
class _Section:
    title: str
    folder: Path
    entries: list[CacheEntry]
    in_all: bool  # removed by ``clear --all``


def add_cache_parser(cache: argparse.ArgumentParser) -> None:
    """The ``cache`` command's sub-commands and options, on its parser ``cache``."""
    sub = cache.add_subparsers(dest="cache_command", required=True, help="what to do")
    sub.add_parser("list", help="entries with their sizes and last use, the totals and the bound")
    clear = sub.add_parser("clear", help="remove entries (--all: packed weights and kernel builds)")
    clear.add_argument(
        "entries",
        nargs="*",
        metavar="ENTRY",
        help="entry names from `specdec cache list` "
        "(or unique prefixes); a fetched model is removed only when named",
    )
    clear.add_argument(
        "--all", action="store_true", help="remove every packed model and kernel build"
    )
    prune = sub.add_parser("prune", help="evict least recently used packed models down to a size")
    prune.add_argument(
        "--max-size",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help=f"like 4GiB or 500M (default: the bound, ${PACKED_CACHE_MAX_SIZE_ENV} or 8GiB)",
    )


def _size_arg(text: str) -> int | None:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def run_cache(args: argparse.Namespace) -> int:
    """Run ``specdec cache <args.cache_command>``; prints to stdout, returns the exit status.
    Entries that match nothing, or a clear with both or neither of ``--all`` and names, raise
    a ValueError naming them (the command line reports it)."""
    if args.cache_command == "list":
        return _list(packed_cache_max_bytes())
    if args.cache_command == "clear":
        return _clear(args.entries, args.all)
    bound = args.max_size if args.max_size is not None else packed_cache_max_bytes()
    _print_removed(evict(packed_dir(), bound))  # never entries in use (see disk_cache.evict)
    print(f"packed weights now {format_size(sum(e.size for e in scan_entries(packed_dir())))} "
          f"(at most {format_size(bound)})")  # fmt: skip
    return 0


def _sections() -> list[_Section]:
    root = cache_root()
    models = scan_entries(root, skip={packed_dir().name, kernel_builds_dir().name})
    return [
        _Section(title="packed weights", folder=packed_dir(), entries=scan_entries(packed_dir()), in_all=True),
        _Section(title="CPU kernel builds", folder=kernel_builds_dir(), entries=scan_entries(kernel_builds_dir()),
                 in_all=True),
        _Section(title="fetched models", folder=root, entries=models, in_all=False),
    ]  # fmt: skip


def _list(bound: int | None) -> int:
    for section in _sections():
        total = sum(e.size for e in section.entries)
        print(f"{section.title}: {section.folder}")
        width = max([len(e.name) for e in section.entries] + [5])
        if section.entries:
            print(f"  {'ENTRY':<{width}}  {'SIZE':>10}  {'LAST USED':<16}  SOURCE")
        for entry in sorted(section.entries, key=lambda e: -e.last_used):  # newest first
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
            note = "(being written)" if entry.writing else _label(entry)
            print(
                f"  {entry.name:<{width}}  {format_size(entry.size):>10}  {used:<16}  {note}".rstrip()
            )
        bounded = section.folder == packed_dir()
        limit = (
            f" of at most {format_size(bound)} (${PACKED_CACHE_MAX_SIZE_ENV})" if bounded else ""
        )
        print(f"  total {format_size(total)}{limit}, {len(section.entries)} entries\n")
    return 0


def _label(entry: CacheEntry) -> str:
    try:
        return (entry.path / LABEL_FILE).read_text(errors="replace").strip()
    except OSError:
        return ""


def _clear(names: list[str], everything: bool) -> int:
    if everything == bool(names):
        raise ValueError(
            "specdec cache clear takes either --all or ENTRY names (see `specdec cache list`)"
        )
    sections = _sections()
    if everything:
        chosen = [e for s in sections if s.in_all for e in s.entries]
    else:
        chosen = list({id(e): e for e in (_find(name, sections) for name in names)}.values())
    _print_removed([e for e in chosen if remove_entry(e.path)])
    return 0


def _find(name: str, sections: list[_Section]) -> CacheEntry:
    """The entry named ``name``, or the one entry whose name starts with it."""
    entries = [e for s in sections for e in s.entries]
    exact = [e for e in entries if e.name == name]
    matches = exact or [e for e in entries if e.name.startswith(name)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ValueError(
            f"no cache entry {name!r} under {cache_root()} (`specdec cache list` shows them)"
        )
    raise ValueError(
        f"cache entry {name!r} is ambiguous: it starts {', '.join(e.name for e in matches)}"
    )


def _print_removed(removed: list[CacheEntry]) -> None:
    for entry in removed:
        print(f"removed {entry.path} ({format_size(entry.size)})")
    print(f"freed {format_size(sum(e.size for e in removed))} in {len(removed)} entries")
