"""The bounded cache folders: sizes read and written, least-recently-used eviction (the pure plan
and its application to real folders), and the tolerance of files another process removes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specdec import disk_cache
from specdec.disk_cache import (
    RECENT_S,
    WRITE_TIMEOUT_S,
    CacheEntry,
    evict,
    eviction_plan,
    format_size,
    packed_cache_max_bytes,
    parse_size,
    remove_entry,
    scan_entries,
    touch,
)

NOW = 1_000_000_000.0
MIB = 1024**2


def entry(name: str, size: int, age: float, writing: bool = False) -> CacheEntry:
    return CacheEntry(
        name=name, path=Path("/nowhere") / name, size=size, last_used=NOW - age, writing=writing
    )


def make_entry(
    folder: Path,
    name: str,
    size: int,
    age: float,
    *,
    files: tuple[str, ...] = ("model.safetensors",),
) -> Path:
    """An entry folder of ``size`` bytes (in its first file) last used ``age`` seconds ago."""
    path = folder / name
    path.mkdir(parents=True)
    for i, file in enumerate(files):
        (path / file).write_bytes(b"x" * (size if i == 0 else 0))
        os.utime(path / file, (time.time() - age, time.time() - age))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


# --- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [("0", 0), ("123", 123), ("8GiB", 8 * 1024**3), ("8g", 8 * 1024**3), ("500M", 500 * MIB),
     ("2 GB", 2 * 1000**3), ("1.5k", 1536), ("10kb", 10_000), (" 3TiB ", 3 * 1024**4),
     ("unlimited", None), ("NONE", None)],
)  # fmt: skip
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "-1G", "8 gigs", "G", "1e9", "8GiBs"])
def test_parse_size_refuses_naming_the_value(text):
    with pytest.raises(ValueError, match="size must be a number of bytes") as err:
        parse_size(text)
    assert repr(text) in str(err.value)


def test_format_size():
    assert [format_size(n) for n in (0, 1023, 1024, 5 * MIB + 1, 8 * 1024**3, None)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "8.0 GiB", "unlimited"
    ]  # fmt: skip


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(disk_cache.PACKED_CACHE_MAX_SIZE_ENV, raising=False)
    assert packed_cache_max_bytes() == 8 * 1024**3
    for text, size in (("2GiB", 2 * 1024**3), ("0", 0), ("unlimited", None), ("", 8 * 1024**3)):
        monkeypatch.setenv(disk_cache.PACKED_CACHE_MAX_SIZE_ENV, text)
        assert packed_cache_max_bytes() == size
    monkeypatch.setenv(disk_cache.PACKED_CACHE_MAX_SIZE_ENV, "lots")
    with pytest.raises(ValueError, match="SPECDEC_PACKED_CACHE_MAX_SIZE: size must be"):
        packed_cache_max_bytes()


# --- the plan ---------------------------------------------------------------------------------


def test_plan_evicts_least_recently_used_first_until_it_fits():
    entries = [
        entry("new", 3, 100),
        entry("old", 3, 300),
        entry("mid", 3, 200),
        entry("oldest", 3, 400),
    ]
    assert [e.name for e in eviction_plan(entries, 12, now=NOW)] == []
    assert [e.name for e in eviction_plan(entries, 11, now=NOW)] == ["oldest"]
    assert [e.name for e in eviction_plan(entries, 6, now=NOW)] == ["oldest", "old"]
    assert [e.name for e in eviction_plan(entries, 6, reserve=3, now=NOW)] == [
        "oldest",
        "old",
        "mid",
    ]
    assert [e.name for e in eviction_plan(entries, 0, now=NOW)] == ["oldest", "old", "mid", "new"]


def test_plan_never_takes_kept_written_or_recent_entries():
    entries = [
        entry("kept", 5, 900),
        entry("writing", 5, 800, writing=True),
        entry("recent", 5, RECENT_S / 2),
        entry("old", 5, 700),
    ]
    plan = eviction_plan(entries, 0, keep={"kept"}, now=NOW)
    assert [e.name for e in plan] == ["old"]  # short of the bound: the rest may not go


def test_plan_refuses_negative_sizes():
    with pytest.raises(ValueError, match="max_bytes and reserve must be >= 0"):
        eviction_plan([], -1)


# --- real folders -----------------------------------------------------------------------------


def test_scan_reads_sizes_last_use_and_writers(tmp_path):
    make_entry(tmp_path, "a", 1000, age=500)
    make_entry(tmp_path, "b", 10, age=100, files=("model.safetensors", "model.tmp4242"))
    make_entry(
        tmp_path, "c", 10, age=WRITE_TIMEOUT_S + 100, files=("model.safetensors", "model.tmp1")
    )
    make_entry(tmp_path, ".trash-d-1-2", 10, age=0)
    (tmp_path / "stray-file").write_bytes(b"x")
    entries = scan_entries(tmp_path)
    assert [e.name for e in entries] == [
        "c",
        "a",
        "b",
    ]  # oldest use first; hidden and files left out
    by_name = {e.name: e for e in entries}
    assert by_name["a"].size == 1000 and abs(by_name["a"].last_used - (time.time() - 500)) < 5
    assert by_name["b"].writing and not by_name["a"].writing
    assert not by_name["c"].writing  # its writer died long ago
    assert scan_entries(tmp_path / "missing") == []


def test_evict_keeps_the_folder_within_its_bound(tmp_path):
    for i, name in enumerate(["e0", "e1", "e2", "e3", "e4"]):
        make_entry(tmp_path, name, MIB, age=1000 - 100 * i)  # e0 least recently used
    removed = evict(tmp_path, 3 * MIB)
    assert [e.name for e in removed] == ["e0", "e1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2", "e3", "e4"]
    assert sum(e.size for e in scan_entries(tmp_path)) <= 3 * MIB
    removed = evict(tmp_path, 3 * MIB, reserve=MIB, keep={"e2"})  # room for one more, e2 stays
    assert [e.name for e in removed] == ["e3"]
    assert evict(tmp_path, None) == [] and len(scan_entries(tmp_path)) == 2


def test_touch_makes_an_entry_recent(tmp_path):
    make_entry(tmp_path, "a", 10, age=300)
    make_entry(tmp_path, "b", 10, age=200)
    touch(tmp_path / "a" / "model.safetensors")
    touch(tmp_path / "missing" / "model.safetensors")  # harmless
    assert [e.name for e in evict(tmp_path, 10)] == ["b"]


def test_eviction_tolerates_entries_vanishing(tmp_path, monkeypatch):
    """Another process removes an entry between our scan and our removal: no error, and it is
    not reported as removed by us."""
    make_entry(tmp_path, "a", 10, age=300)
    make_entry(tmp_path, "b", 10, age=200)
    scanned = disk_cache.scan_entries

    def scan_then_lose_a(folder, **kwargs):
        entries = scanned(folder, **kwargs)
        remove_entry(tmp_path / "a")  # the other process wins the race
        return entries

    monkeypatch.setattr(disk_cache, "scan_entries", scan_then_lose_a)
    assert [e.name for e in evict(tmp_path, 0)] == ["b"]
    assert list(tmp_path.iterdir()) == []
    assert remove_entry(tmp_path / "a") is False


def test_a_half_done_removal_is_finished(tmp_path):
    make_entry(tmp_path, ".trash-a-12-34", 10, age=0)  # a remover killed mid-way
    evict(tmp_path, None)
    assert list(tmp_path.iterdir()) == []
