"""On-disk cache of packed models, so a second load is a memory map instead of a repack.

Packing a 1.5B-parameter checkpoint takes tens of seconds on a small CPU; the packed tensors
are written once as safetensors under ``<cache root>/packed/<key>/`` (atomically: temporary
file, then rename) and read back with ``safe_open``. The key covers the source files' paths,
sizes and modification times and the packing format, so a changed checkpoint is repacked.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from specdec.kernels.cpu_linear import PANEL
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.packed import pack_linears
from specdec.models.quantized import quantize_linears

__all__ = ["packed_cache_file", "load_packed", "save_packed"]

_FORMATS = {None: f"panel{PANEL}-v1", "int8": "int8-g32-v2", "q4": "q4-g32-v1"}


def packed_cache_file(sources: list[Path], quantization: str | None = None) -> Path:
    """Where the packed (bf16) or quantized (``"int8"``, ``"q4"``) model of these checkpoint
    files lives (it may not exist yet)."""
    from specdec.paths import cache_root

    h = hashlib.sha256(_FORMATS[quantization].encode())
    for f in sources:
        st = f.stat()
        h.update(json.dumps([str(f.resolve()), st.st_size, st.st_mtime_ns]).encode())
    return cache_root() / "packed" / h.hexdigest()[:24] / "model.safetensors"


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
    model.inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=device)
    return model.eval().requires_grad_(False)


def save_packed(model: LlamaModel, file: Path) -> None:
    """Write ``model``'s packed state next to nothing else, atomically; failures are harmless."""
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp))
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)
