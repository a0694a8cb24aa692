"""``specdec cache list | clear | prune`` on a cache root of the test's own (``SPECDEC_CACHE``),
and loads that keep the packed-weights cache within its bound (``SPECDEC_PACKED_CACHE_MAX_SIZE``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.disk_cache import PACKED_CACHE_MAX_SIZE_ENV, scan_entries

MIB = 1024**2


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(PACKED_CACHE_MAX_SIZE_ENV, raising=False)
    return tmp_path / "cache"


def entry(folder: Path, name: str, size: int, age: float, label: str = "") -> Path:
    """A cache entry of ``size`` bytes last used ``age`` seconds ago."""
    path = folder / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * size)
    if label:
        (path / "source.txt").write_text(label)
    make_old(path, age)
    return path


def make_old(path: Path, age: float) -> None:
    """Last use of the entry ``path``: ``age`` seconds ago (every file, and the folder)."""
    for p in [*path.iterdir(), path]:
        os.utime(p, (time.time() - age, time.time() - age))


@pytest.fixture
def filled(root) -> Path:
    """Three packed entries, two kernel builds and one fetched model."""
    entry(root / "packed", "aaaa1111", 3 * MIB, 3000, label="/models/qwen (int8)")
    entry(root / "packed", "aaaa2222", 2 * MIB, 2000, label="/models/qwen (q4)")
    entry(root / "packed", "bbbb3333", 1 * MIB, 1000)
    entry(root / "torch_extensions", "cpu_kernels-2.13.0+cpu-0123456789ab", MIB, 500)
    entry(root / "torch_extensions", "cpu_kernels-2.13.0+cpu-ba9876543210", MIB, 400)
    entry(root, "qwen2.5-coder-0.5b-instruct", 4 * MIB, 100)
    return root


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


def names(folder: Path) -> list[str]:
    return sorted(e.name for e in scan_entries(folder))


def test_list_shows_entries_sizes_last_use_totals_and_the_bound(filled, capsys, monkeypatch):
    code, out, _ = run(capsys, "list")
    assert code == 0
    packed, kernels, models = out.split("\n\n")[:3]
    assert f"packed weights: {filled / 'packed'}" in packed
    assert "aaaa1111" in packed and "3.0 MiB" in packed and "/models/qwen (int8)" in packed
    assert (
        packed.index("bbbb3333") < packed.index("aaaa2222") < packed.index("aaaa1111")
    )  # newest first
    assert time.strftime("%Y-%m-%d", time.localtime(time.time() - 3000)) in packed
    assert "total 6.0 MiB of at most 8.0 GiB ($SPECDEC_PACKED_CACHE_MAX_SIZE), 3 entries" in packed
    assert f"CPU kernel builds: {filled / 'torch_extensions'}" in kernels
    assert (
        "cpu_kernels-2.13.0+cpu-0123456789ab" in kernels and "total 2.0 MiB, 2 entries" in kernels
    )
    assert "qwen2.5-coder-0.5b-instruct" in models and "packed" not in models.split("\n", 1)[1]
    monkeypatch.setenv(PACKED_CACHE_MAX_SIZE_ENV, "512M")
    assert "of at most 512.0 MiB" in run(capsys, "list")[1]


def test_list_of_an_empty_cache(root, capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0 and out.count("total 0 B") == 3


def test_clear_named_entries_by_name_or_unique_prefix(filled, capsys):
    code, out, _ = run(capsys, "clear", "aaaa1111", "bbbb", "qwen2.5-coder-0.5b-instruct")
    assert code == 0 and "freed 8.0 MiB in 3 entries" in out
    assert names(filled / "packed") == ["aaaa2222"]
    assert names(filled) == ["packed", "torch_extensions"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["aaaa"], "cache entry 'aaaa' is ambiguous: it starts aaaa1111, aaaa2222"),
        (["cccc"], "no cache entry 'cccc' under"),
        ([], "takes either --all or ENTRY names"),
        (["--all", "aaaa1111"], "takes either --all or ENTRY names"),
    ],
)
def test_clear_refuses_what_it_cannot_tell(filled, capsys, args, message):
    code, out, err = run(capsys, "clear", *args)
    assert code == 2 and message in err and out == ""
    assert len(names(filled / "packed")) == 3  # nothing removed before the error


def test_clear_all_keeps_fetched_models(filled, capsys):
    code, out, _ = run(capsys, "clear", "--all")
    assert code == 0 and "freed 8.0 MiB in 5 entries" in out
    assert names(filled / "packed") == names(filled / "torch_extensions") == []
    assert "qwen2.5-coder-0.5b-instruct" in names(filled)


def test_prune_evicts_least_recently_used_down_to_a_size(filled, capsys, monkeypatch):
    code, out, _ = run(capsys, "prune", "--max-size", "2.5M")
    assert code == 0 and "packed weights now 1.0 MiB (at most 2.5 MiB)" in out
    assert "freed 5.0 MiB in 2 entries" in out
    assert names(filled / "packed") == ["bbbb3333"]  # the most recently used stays
    monkeypatch.setenv(PACKED_CACHE_MAX_SIZE_ENV, "0")
    assert run(capsys, "prune")[0] == 0 and names(filled / "packed") == []
    assert len(names(filled / "torch_extensions")) == 2  # prune is about packed weights only


def test_prune_refuses_a_bad_size(filled, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["cache", "prune", "--max-size", "lots"])
    assert exit_.value.code == 2 and "size must be a number of bytes" in capsys.readouterr().err


def test_loads_keep_the_packed_cache_within_its_bound(
    kernel, root, tiny_checkpoint, monkeypatch, capsys
):
    """A write evicts the least recently used entries first; a load touches its entry; an entry
    larger than the bound is not written; a bad bound fails the load naming the variable."""
    from specdec.models.loading import load_model

    checkpoint = tiny_checkpoint("qwen2")
    load_model(checkpoint, quantization="int8")
    (int8,) = scan_entries(root / "packed")
    assert (int8.path / "source.txt").read_text() == f"{checkpoint} (int8)"
    assert f"{checkpoint} (int8)" in run(capsys, "list")[1]

    make_old(int8.path, 1000)
    load_model(checkpoint, quantization="int8")  # a cache hit: now the most recent use
    assert scan_entries(root / "packed")[0].last_used > time.time() - 100

    make_old(int8.path, 1000)
    monkeypatch.setenv(PACKED_CACHE_MAX_SIZE_ENV, str(int8.size + 1))  # room for one entry
    load_model(checkpoint, quantization="q4")
    (q4,) = scan_entries(root / "packed")
    assert q4.name != int8.name and (q4.path / "source.txt").read_text().endswith("(q4)")

    monkeypatch.setenv(PACKED_CACHE_MAX_SIZE_ENV, str(q4.size - 1))
    load_model(checkpoint, quantization="int8")  # too big for the bound: loaded, not cached
    assert names(root / "packed") == [q4.name]

    monkeypatch.setenv(PACKED_CACHE_MAX_SIZE_ENV, "lots")
    with pytest.raises(ValueError, match="SPECDEC_PACKED_CACHE_MAX_SIZE"):
        load_model(checkpoint, quantization="int8")
