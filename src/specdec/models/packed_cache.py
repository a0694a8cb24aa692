"""On-disk cache of packed models, so a second load is a memory map instead of a repack.

Packing a 1.5B-parameter checkpoint takes tens of seconds on a small CPU; the packed tensors
are written once as safetensors under ``<cache root>/packed/<key>/`` (atomically: temporary
file, then rename) and read back with ``safe_open``. The key covers the source files' paths,
sizes and modification times and the packing format, so a changed checkpoint is repacked.

The folder is bounded (``$SPECDEC_PACKED_CACHE_MAX_SIZE``, 8 GiB by default): a load touches
its entry, and a write first evicts the least recently used others to make room
(:mod:`specdec.disk_cache`; ``specdec cache list`` shows the entries).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from specdec.disk_cache import LABEL_FILE, evict, touch
from specdec.kernels.cpu_linear import PANEL
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.packed import pack_linears
from specdec.models.quantized import quantize_linears

__all__ = ["packed_cache_file", "load_packed", "save_packed", "map_tensor", "map_input_embedding"]

_FORMATS = {None: f"panel{PANEL}-v1", "int8": "int8-g32-v2", "q4": "q4-g32-v1"}


def packed_cache_file(sources: list[Path], quantization: str | None = None) -> Path:
    """Where the packed (bf16) or quantized (``"int8"``, ``"q4"``) model of these checkpoint
    files lives (it may not exist yet)."""
    from specdec.paths import packed_dir

    h = hashlib.sha256(_FORMATS[quantization].encode())
    for f in sources:
        st = f.stat()
        h.update(json.dumps([str(f.resolve()), st.st_size, st.st_mtime_ns]).encode())
    return packed_dir() / h.hexdigest()[:24] / "model.safetensors"


def load_packed(
    cfg: ModelConfig, file: Path, device: torch.device, quantization: str | None = None
) -> LlamaModel | None:
    """The packed or quantized model stored in ``file``, or ``None`` if it is missing or unreadable."""
    if not file.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = LlamaModel(cfg).to(torch.bfloat16)
        if quantization is None:
            pack_linears(model)
        else:
            quantize_linears(model, quantization)
    try:
        state = load_file(str(file), device=str(device))
        model.load_state_dict(state, strict=True, assign=True)
    except (SafetensorError, OSError, RuntimeError):
        return None  # a stale or damaged cache entry: repack from the checkpoint
    touch(file)  # a use: the least recently used entries are evicted first
    model.init_rope(device)
    return model.eval().requires_grad_(False)


def save_packed(model: LlamaModel, file: Path, *, max_bytes: int | None, label: str = "") -> bool:
    """Write ``model``'s packed state to ``file`` atomically, first evicting the least recently
    used other entries of its cache folder so that all fit in ``max_bytes`` (``None``: no bound;
    see :func:`specdec.disk_cache.packed_cache_max_bytes`). ``label`` says what the entry holds
    (``specdec cache list`` shows it). Returns whether it was written: not where the state alone
    exceeds the bound; failures (a full disk) are harmless, the model is merely not cached."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in state.values())
    if max_bytes is not None and size > max_bytes:
        return False  # it would evict every other entry and still not fit
    tmp = file.with_suffix(f".tmp{os.getpid()}")  # marks the entry as being written
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        evict(file.parent.parent, max_bytes, reserve=size, keep={file.parent.name})
        save_file(state, str(tmp))
        os.replace(tmp, file)
        if label:
            _write_atomically(file.with_name(LABEL_FILE), label.encode())
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def _write_atomically(file: Path, data: bytes) -> None:
    tmp = file.with_name(f"{file.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, file)


_NUMPY_VIEWS = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16), "F32": (np.float32, torch.float32)}


def map_tensor(file: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors ``file`` as a private (copy-on-write) memory map of its
    bytes alone: pages become resident only where they are read."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
    np_dtype, dtype = _NUMPY_VIEWS[entry["dtype"]]
    start, end = entry["data_offsets"]
    count = (end - start) // np.dtype(np_dtype).itemsize
    array = np.memmap(file, dtype=np_dtype, mode="c", offset=8 + header_len + start, shape=(count,))
    return torch.from_numpy(array).view(dtype).view(entry["shape"])


def map_input_embedding(model: LlamaModel, file: Path) -> torch.Tensor | None:
    """Point a quantized model's input embedding at its rows in the cache ``file`` (where
    :func:`save_packed` wrote this model), in place; returns the mapped weight, or ``None`` where
    the embedding is tied to the LM head or the file does not hold it (nothing changed then).

    Why: a quantized model's LM head has its own (quantized) weights, so the bf16 embedding is
    only ever read one row per token: mapped, it costs the resident memory of the rows of the
    tokens seen (3 KiB each for a 1536-wide model) instead of the whole table (0.47 GB for
    Qwen2.5-1.5B), with the same values."""
    weight = model.embed_tokens.weight
    if weight.device.type != "cpu" or any(
        p is weight for name, p in model.named_parameters(remove_duplicate=False) if name != "embed_tokens.weight"
    ):
        return None
    try:
        mapped = map_tensor(file, "embed_tokens.weight")
    except (OSError, KeyError, ValueError):
        return None
    if mapped.shape != weight.shape or mapped.dtype != weight.dtype:
        return None
    model.embed_tokens.weight = torch.nn.Parameter(mapped, requires_grad=False)
    return mapped
