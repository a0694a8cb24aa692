"""Checkpoint loading: Hugging Face directories (safetensors, sharded or not), GGUF files, hub ids.

Only safetensors are read (never pickles). Weights stream tensor by tensor into a model built
on the meta device, so a checkpoint is never held twice in memory. A GGUF file is parsed once
per load (:class:`~specdec.models.gguf_file.GgufFile`: config, tensor table, memory-mapped
tensors); its tensors stream into a dense model (:func:`specdec.models.gguf_dense.gguf_state`),
except with ``quantization="q4"``: then :func:`specdec.models.gguf_q4.load_gguf_q4` assembles
the q4 model tensor by tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from specdec.disk_cache import packed_cache_max_bytes
from specdec.kernels.cpu_linear import kernel_available
from specdec.models import phi3, qwen3_moe
from specdec.models.from_transformers import is_transformers_model, source_dir, transformers_tensors
from specdec.models.gguf_dense import gguf_state
from specdec.models.gguf_file import GgufFile
from specdec.models.hf_adapter import TransformersAdapter
from specdec.models.hugepages import move_to_hugepages
from specdec.models.llama import LlamaModel, ModelConfig, UnsupportedArchitecture
from specdec.models.packed import pack_linears, should_pack
from specdec.models.packed_cache import (
    load_packed,
    map_input_embedding,
    packed_cache_file,
    save_packed,
)
from specdec.models.quantized import check_quantization, quantize_linears

__all__ = [
    "MODEL_IMPLS",
    "check_model_impl",
    "load_model",
    "load_hf_config",
    "local_context",
    "model_from_state_dict",
    "resolve_dtype",
    "resolve_device",
    "resolve_source",
    "safetensors_files",
    "settle_weights",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "double": torch.float64,
}


# How a checkpoint runs: its native family when it has one, else the transformers adapter
# ("auto"); only natively (an error for other architectures); always on the adapter.
MODEL_IMPLS = ("auto", "native", "transformers")


def check_model_impl(model_impl: object) -> None:
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"bfloat16"``/``torch.bfloat16``/... -> torch dtype (``None``: bfloat16); anything
    else raises naming ``dtype``."""
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in set(_DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))} or a floating torch.dtype, got {dtype!r}")


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse ``device`` and check it exists here; raises ValueError naming ``device``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be like 'cpu' or 'cuda:0', got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here, "
            f"indices 0..{torch.cuda.device_count() - 1}"
        )
    if dev.type not in {"cpu", "cuda"}:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def load_hf_config(path: str | Path) -> object:
    """Read ``config.json`` of a model directory with transformers (JSON only)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {err}") from err


def local_context(source: object) -> int | None:
    """The ``max_position_embeddings`` of a model directory already on disk, from its
    ``config.json`` alone (no weights read); ``None`` for anything else (a known name, a hub id,
    a ``.gguf`` file), whose context is known only once loaded."""
    if not isinstance(source, (str, Path)) or not (Path(source).expanduser() / "config.json").is_file():
        return None
    context = getattr(load_hf_config(Path(source).expanduser()), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (KeyError, json.JSONDecodeError) as err:
            raise ValueError(f"corrupt safetensors index {str(index)!r}: {err}") from err
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {str(path)!r} (specdec loads safetensors only, never pickles)"
            )
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing checkpoint shard {str(f)!r}")
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"corrupt or unreadable checkpoint file {str(f)!r}: {err}") from err


def _fuse_name(name: str) -> tuple[str, int, int] | None:
    """Map an HF projection name to (fused name, part index, number of parts); Qwen3-MoE's
    experts (``mlp.experts.{e}.gate_proj``/``up_proj``) fuse as the dense MLP's do."""
    for part, (old, new, n) in enumerate(
        (("q_proj", "qkv_proj", 3), ("k_proj", "qkv_proj", 3), ("v_proj", "qkv_proj", 3))
    ):
        if f".self_attn.{old}." in name:
            return name.replace(old, new), part, n
    for part, old in enumerate(("gate_proj", "up_proj")):
        if f".mlp.{old}." in name or (".mlp.experts." in name and f".{old}." in name):
            return name.replace(old, "gate_up_proj"), part, 2
    return None


def model_from_state_dict(
    cfg: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    layer_config: ModelConfig | None = None,
    make_model: Callable[[], LlamaModel] | None = None,
) -> LlamaModel:
    """Build a :class:`LlamaModel` from HF-named tensors, fusing q/k/v and gate/up on the way.

    ``layer_config``: the decoder layers' shape when it differs from ``cfg`` (one rank's shard
    under tensor parallelism); the tensors must then have the shard's shapes. ``make_model``
    builds the (meta-device) model instead of ``LlamaModel(cfg, layer_config=layer_config)``.
    Experts stacked in 3-D tensors load one per expert
    (:func:`~specdec.models.qwen3_moe.unstack_experts`)."""
    if cfg.moe is not None:
        tensors = qwen3_moe.unstack_experts(tensors)
    with torch.device("meta"):
        model = make_model() if make_model is not None else LlamaModel(cfg, layer_config=layer_config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = set(shapes)
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    for raw_name, tensor in tensors:
        name = raw_name.removeprefix("model.")
        if name.startswith("rotary_emb") or name.endswith("rotary_emb.inv_freq"):
            continue
        tensor = tensor.to(device=device, dtype=dtype)
        fused = _fuse_name(name)
        if fused is None:
            state[name] = tensor
            continue
        fused_name, part, n = fused
        parts = pending.setdefault(fused_name, [None] * n)
        parts[part] = tensor
        if all(p is not None for p in parts):
            state[fused_name] = torch.cat(parts, dim=0)
            del pending[fused_name]
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    incomplete = sorted(pending)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    misshapen = sorted(
        f"{name} {tuple(state[name].shape)} != {shapes[name]}"
        for name in expected & set(state)
        if tuple(state[name].shape) != shapes[name]
    )
    if incomplete or missing or unexpected or misshapen:
        raise ValueError(
            f"checkpoint does not match a {cfg.architecture.value} model of its config.json: "
            f"missing {missing[:5]}, incomplete {incomplete[:5]}, unexpected {unexpected[:5]}, "
            f"wrong shape (checkpoint != config) {misshapen[:5]}"
        )
    if cfg.phi3 is not None:  # partial RoPE: q/k channels in the order specdec rotates them
        phi3.arrange_qkv(state, model.layer_config)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope(device)
    return model.eval().requires_grad_(False)


def load_model(
    source: str | Path | torch.nn.Module,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    pack: bool | None = None,
    quantization: str | None = None,
    model_impl: str = "auto",
) -> tuple[LlamaModel | TransformersAdapter, object, Path | None]:
    """Load ``source`` (HF directory, ``.gguf`` file, known name or hub id).

    ``pack`` swaps bf16 linear layers for the packed CPU kernel (``None``: when it helps,
    see :func:`specdec.models.packed.should_pack`). ``quantization`` (``"int8"``, ``"q4"``; CPU)
    stores every linear layer, LM head included, in that format instead (see
    :mod:`specdec.models.quantized`). Packed and quantized models are cached on disk (not those
    read from a GGUF file: a q4 one is read straight from the file, keeping its 4-bit codes, see
    :mod:`specdec.models.gguf_q4`; int8 quantizes its dense load). Returns
    ``(model, hf_config, model_dir)``; ``model_dir`` holds the tokenizer files.

    ``source`` may also be a transformers model in memory (:mod:`specdec.models.from_transformers`:
    its weights copied in ``dtype``, never cached on disk); ``model_dir`` is then the local
    directory it was loaded from, or ``None``.

    ``model_impl`` (:data:`MODEL_IMPLS`): ``"auto"`` runs a native family natively and any
    other architecture on the transformers adapter (:mod:`specdec.models.hf_adapter`: the
    model's own code over specdec's paged KV, slower; a model object is then used as it is, not
    copied); ``"native"`` refuses other architectures; ``"transformers"`` takes the adapter for
    every model. ``dtype=None``: bfloat16, or a model object's own on the adapter.
    """
    check_model_impl(model_impl)
    check_quantization(quantization, device)
    if is_transformers_model(source) and _on_adapter(source.config, model_impl):
        return _adapter(source, dtype, device, quantization), source.config, source_dir(source)
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    if is_transformers_model(source):
        hf_config = source.config  # checked as a checkpoint's config.json would be
        tensors = transformers_tensors(source, dtype=torch_dtype, device=torch_device)
        model = model_from_state_dict(
            ModelConfig.from_hf_config(hf_config), tensors, dtype=torch_dtype, device=torch_device
        )
        if quantization is not None:
            quantize_linears(model, quantization)
        elif pack or (pack is None and should_pack(model)):
            pack_linears(model)
        return settle_weights(model), hf_config, source_dir(source)
    path = resolve_source(source)
    if path.suffix == ".gguf" and model_impl == "transformers":
        raise ValueError("model_impl='transformers' reads safetensors checkpoint directories, not GGUF files")
    if path.suffix == ".gguf":
        _import_gguf()
        gguf_file = GgufFile.read(path)  # the one parse of the file: everything below reads it
        if quantization == "q4":  # assembled tensor by tensor, never as a dense model
            from specdec.models.gguf_q4 import load_gguf_q4

            model, hf_config = load_gguf_q4(gguf_file, torch_dtype)
            return settle_weights(model), hf_config, path
        model, hf_config = _load_gguf(gguf_file, torch_dtype, torch_device)
        if quantization is not None:
            quantize_linears(model, quantization)
        elif pack or (pack is None and should_pack(model)):
            pack_linears(model)
        return settle_weights(model), hf_config, path
    hf_config = load_hf_config(path)
    if _on_adapter(hf_config, model_impl):
        return _adapter(_read_transformers(path, torch_dtype, torch_device), None, device, quantization), hf_config, path
    cfg = ModelConfig.from_hf_config(hf_config)
    files = safetensors_files(path)
    wants_pack = quantization is None and (pack if pack is not None else (
        torch_dtype == torch.bfloat16 and torch_device.type == "cpu" and kernel_available()
    ))  # fmt: skip
    cached_format = torch_dtype == torch.bfloat16 and (wants_pack or quantization is not None)
    cache_file = packed_cache_file(files, quantization) if cached_format else None
    if cache_file is not None:
        max_bytes = packed_cache_max_bytes()  # a bad setting fails before the slow part
        cached = load_packed(cfg, cache_file, torch_device, quantization)
        if cached is not None:
            return settle_weights(cached, cache_file if quantization else None), hf_config, path
    model = model_from_state_dict(cfg, _read_safetensors(files), dtype=torch_dtype, device=torch_device)
    if quantization is not None:
        quantize_linears(model, quantization)
    elif wants_pack:
        pack_linears(model)
    if cache_file is not None:
        label = f"{path} ({quantization or 'bf16, packed'})"
        if not save_packed(model, cache_file, max_bytes=max_bytes, label=label):
            cache_file = None  # not cached (over the bound, disk full): nothing to map
    return settle_weights(model, cache_file if quantization else None), hf_config, path


def _on_adapter(hf_config: object, model_impl: str) -> bool:
    """Whether ``model_impl`` sends a model of ``hf_config`` to the transformers adapter; a
    native family's config that specdec cannot honour raises here, whatever ``"auto"`` says
    (its error names the field; ``model_impl="transformers"`` runs it anyway)."""
    if model_impl != "auto":
        return model_impl == "transformers"
    try:
        ModelConfig.from_hf_config(hf_config)
    except UnsupportedArchitecture:
        return True
    return False


def _adapter(
    hf_model: torch.nn.Module, dtype: str | torch.dtype | None, device: str | torch.device, quantization: str | None
) -> TransformersAdapter:
    """The transformers adapter over ``hf_model`` itself (no copy): it runs in its own dtype
    and on its own device, so a different one asked for is refused, not silently converted."""
    name = type(hf_model).__name__
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} needs a natively supported family; {name} "
                         "runs on the transformers adapter (docs/models.md)")  # fmt: skip
    if dtype is not None and resolve_dtype(dtype) != hf_model.dtype:
        raise ValueError(
            f"dtype={dtype!r}, but the transformers adapter runs the model object as it is ({name}, "
            f"{hf_model.dtype}): pass dtype=None, or convert the model first (model.to(dtype))"
        )
    wanted = resolve_device(device)
    if hf_model.device.type != wanted.type:
        raise ValueError(f"device={device!r}, but the model object is on {hf_model.device}: the transformers "
                         "adapter runs it where it is (move it first)")  # fmt: skip
    return TransformersAdapter(hf_model)


def _read_transformers(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A checkpoint directory loaded by transformers (safetensors only, no remote code), every
    weight read from the files: transformers would fill missing ones with random values."""
    from transformers import AutoModelForCausalLM

    safetensors_files(path)  # a clear error when there are none
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, use_safetensors=True, trust_remote_code=False, output_loading_info=True
        )
    except (ValueError, OSError, KeyError, RuntimeError) as err:  # RuntimeError: shapes that differ
        raise ValueError(f"transformers cannot load {str(path)!r} as a causal LM "
                         f"(the weights in it do not match its config?): {err}") from err  # fmt: skip
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
    if bad:
        raise ValueError(f"the weights in {str(path)!r} do not match its config: {bad}")
    return model.to(device).eval()


def settle_weights(model: LlamaModel, cache_file: Path | None = None) -> LlamaModel:
    """CPU weights move to huge pages (decode streams them all every step), except a quantized
    model's input embedding, memory-mapped from its ``cache_file`` where it has one
    (see :func:`~specdec.models.packed_cache.map_input_embedding`)."""
    if model.device.type != "cpu":
        return model
    mapped = map_input_embedding(model, cache_file) if cache_file is not None else None
    return move_to_hugepages(model, exclude=() if mapped is None else (mapped,))


def resolve_source(source: str | Path) -> Path:
    if not isinstance(source, (str, Path)):
        raise TypeError(f"model source must be a path or a name, got {type(source).__name__}")
    path = Path(source).expanduser()
    if path.exists():
        return path
    if str(source).endswith(".gguf") or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {str(source)!r} does not exist")
    from specdec.hub import resolve_model

    return Path(resolve_model(str(source)))


def _import_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        raise ImportError("loading .gguf files needs the gguf extra: pip install 'specdec[gguf]'") from err


def _load_gguf(file: GgufFile, dtype: torch.dtype, device: torch.device) -> tuple[LlamaModel, object]:
    """The dense model of a parsed GGUF ``file``, dequantized tensor by tensor."""
    hf_config = file.hf_config()
    cfg = ModelConfig.from_hf_config(hf_config)
    model = model_from_state_dict(cfg, gguf_state(file), dtype=dtype, device=device)
    return model, hf_config
