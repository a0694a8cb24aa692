"""Head files: what the MTP module and the EAGLE head write and read the same way.

A head directory holds ``config.json`` (the head's own record, with its format name, version and
the *fingerprint* of the target it fits) and ``model.safetensors`` (the head's own weights only,
as plain ``nn.Linear`` tensors). Only safetensors are read, never pickles. Loading checks the
files, builds the head on the meta device, assigns the weights on the target's device and, on a
CPU, quantises or packs its linear layers like the target's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from specdec.models.llama import ModelConfig

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "check_format",
    "check_target_fingerprint",
    "head_files",
    "place_weights",
    "plain_state_dict",
    "read_config",
    "read_weights",
    "save_head",
    "target_fingerprint",
]

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def target_fingerprint(cfg: ModelConfig, fields: Sequence[str]) -> dict[str, object]:
    """The ``fields`` of a target config a head records: it loads only onto a target that matches."""
    out = {name: getattr(cfg, name) for name in fields}
    out["architecture"] = cfg.architecture.value
    return out


def check_target_fingerprint(
    recorded: dict[str, object], cfg: ModelConfig, fields: Sequence[str], what: str
) -> None:
    """Raise ValueError naming each field where ``cfg`` differs from the ``recorded`` fingerprint."""
    theirs = target_fingerprint(cfg, fields)
    diff = {k: (recorded.get(k), v) for k, v in theirs.items() if recorded.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: head {a!r} vs target {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(f"{what} does not fit this target ({detail})")


def check_format(data: dict[str, object], fmt: str, version: int, what: str) -> None:
    """Raise ValueError unless a head's ``config.json`` data is format ``fmt`` at ``version``."""
    if data.get("format") != fmt or data.get("version") != version:
        raise ValueError(
            f"not a specdec {what} config (format {data.get('format')!r}, "
            f"version {data.get('version')!r}; expected {fmt!r} version {version})"
        )


def plain_state_dict(head: nn.Module) -> dict[str, torch.Tensor]:
    """The head's weights as ``nn.Linear`` names and layouts, also when its linears are packed
    (a file never depends on the machine that wrote it)."""
    from specdec.models.packed import PackedLinear, linear_weights

    state = dict(head.state_dict())
    for name, module in head.named_modules():
        if isinstance(module, PackedLinear):
            weight, bias = linear_weights(module)
            del state[f"{name}.packed"]
            state.pop(f"{name}.bias", None)
            state[f"{name}.weight"] = weight
            if bias is not None:
                state[f"{name}.bias"] = bias.to(weight.dtype)
    return state


def save_head(head: nn.Module, directory: str | Path) -> Path:
    """Write a head's files into ``directory``: ``model.safetensors`` (its own weights only,
    tagged with its format) and ``config.json`` (``head.config.to_json()``, format included)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.to_json()
    state = {name: t.detach().contiguous().cpu() for name, t in plain_state_dict(head).items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": config["format"]})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def head_files(directory: str | Path, what: str) -> tuple[Path, Path]:
    """``(config.json, model.safetensors)`` of a head directory; FileNotFoundError if either is
    missing."""
    directory = Path(directory).expanduser()
    paths = (directory / CONFIG_FILE, directory / WEIGHTS_FILE)
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"{what} directory {str(directory)!r} must hold {CONFIG_FILE} and {WEIGHTS_FILE} "
                f"(safetensors only: pytorch_model.bin is never read); {str(path)!r} is missing"
            )
    return paths


def read_config(path: Path) -> dict[str, object]:
    """A head's ``config.json`` as a dict; ValueError if it is no JSON object."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read {str(path)!r}: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object")
    return raw


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a head's ``model.safetensors``; ValueError if the file is corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"corrupt head weights {str(path)!r}: {err}") from err


def place_weights(
    head: nn.Module,  # built on the meta device
    state: dict[str, torch.Tensor],  # the head's state dict, checked against it
    *,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
) -> nn.Module:
    """Assign ``state`` to ``head`` on ``device`` (floating tensors in ``dtype``, integer ones as
    int64), frozen for inference; then its linear layers quantised (``"int8"`` / ``"q4"``) or,
    for bf16 on a CPU with the packed kernel, packed like the target's."""
    from specdec.models.packed import pack_linears, should_pack
    from specdec.models.quantized import quantize_linears

    state = {
        n: t.to(device=device, dtype=dtype if t.is_floating_point() else torch.int64)
        for n, t in state.items()
    }
    head.load_state_dict(state, assign=True)
    head.eval().requires_grad_(False)
    if quantization is not None:  # from the plain weights: packing first would be undone
        quantize_linears(head, quantization)
    elif should_pack(head):
        pack_linears(head)
    return head
