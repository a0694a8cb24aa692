"""EAGLE head files: specdec's own layout and the public EAGLE-1/2 and EAGLE-3 checkpoints.

specdec writes a head as ``config.json`` (an :class:`~specdec.models.eagle_head.EagleHeadConfig`,
format ``specdec-eagle-head``) plus ``model.safetensors`` (:mod:`specdec.models.head_io`). Public
checkpoints (github.com/SafeAILab/EAGLE at cb7e084) keep the reference's ``config.json`` (an HF
Llama config of the one layer) and its key names: q/k/v and gate/up as separate tensors, the
layer under ``layers.0.`` (EAGLE-1/2) or ``midlayer.`` (EAGLE-3). Loading converts them to the
head's fused layout, checks every key and shape, and derives the config and RoPE as the
reference does (the choices are documented in :mod:`specdec.models.eagle_head`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models import head_io
from specdec.models.eagle_head import (
    FORMAT,
    TARGET_FIELDS,
    EagleHeadConfig,
    EagleHeadModel,
    EagleKind,
    default_target_layers,
)
from specdec.models.llama import LlamaModel, ModelConfig

__all__ = ["load_eagle_head", "save_eagle_head"]

_WHAT = "EAGLE head"  # in messages


save_eagle_head = head_io.save_head  # (head, directory) -> directory: specdec's own layout


def load_eagle_head(
    directory: str | Path,
    target: LlamaModel,
    *,
    dtype: torch.dtype | None = None,
    target_layers: tuple[int, ...] | None = None,
    quantization: str | None = None,
) -> EagleHeadModel:
    """Load an EAGLE head onto ``target`` from ``config.json`` + ``model.safetensors`` in one of
    three layouts, told apart by the keys: specdec's own (:func:`save_eagle_head`), the public
    EAGLE-1/2 one (``fc``, ``layers.0.*``) or the public EAGLE-3 one (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``, ``d2t``, ``t2d``). Only safetensors are read, never pickles.

    ``target_layers`` overrides the reference's EAGLE-3 layers for public files. Weights take
    ``dtype`` (default: the target's) on the target's device; bf16 on a CPU with the packed
    kernel gets packed linears, like the target. ``quantization`` (``"int8"`` or ``"q4"``, CPU
    only) stores the head's own linear layers (its LM head included) in that format: each head
    forward streams them once, so they set its cost; the proposals change, never the output.
    """
    from specdec.models.quantized import check_quantization

    check_quantization(quantization, target.device)
    config_path, weights_path = head_io.head_files(directory, _WHAT)
    raw = head_io.read_config(config_path)
    tensors = head_io.read_weights(weights_path)
    if raw.get("format") == FORMAT:
        if target_layers is not None:
            raise ValueError(f"target_layers is recorded in {str(config_path)!r}; do not pass it")
        try:
            config = EagleHeadConfig.from_json(raw)
        except (KeyError, TypeError) as err:
            raise ValueError(f"cannot read {str(config_path)!r}: {err}") from err
        prefix = None
    else:
        config, prefix = _public_config(raw, tensors, target.config, config_path, target_layers)
    with torch.device("meta"):
        head = EagleHeadModel(target, config)
    state = _match_keys(head, tensors, prefix, weights_path)
    if config.kind is EagleKind.EAGLE3:
        _check_vocab_map(state["d2t"], tensors.get("t2d"), config, target.config, weights_path)
    # A buffer kept out of the state dict: made here, on the device, from the config.
    head.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=target.device)
    return head_io.place_weights(head, state, device=target.device, dtype=dtype or target.dtype, quantization=quantization)


def _public_config(
    raw: dict, tensors: dict[str, torch.Tensor], target: ModelConfig, path: Path, target_layers
) -> tuple[EagleHeadConfig, str]:
    """The config of a public EAGLE checkpoint and the prefix of its layer's keys."""
    if any(k.startswith("midlayer.") for k in tensors):
        kind, prefix = EagleKind.EAGLE3, "midlayer."
    elif any(k.startswith("layers.0.") for k in tensors):
        kind, prefix = EagleKind.EAGLE1, "layers.0."
    else:
        raise ValueError(
            f"{str(path.with_name(head_io.WEIGHTS_FILE))!r} is neither a specdec head ({head_io.CONFIG_FILE} format "
            f"{FORMAT!r}) nor a public EAGLE head (keys midlayer.* or layers.0.*): keys {sorted(tensors)[:8]}"
        )
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        vocab, intermediate = int(raw["vocab_size"]), int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{str(path)!r} lacks a usable {err} (hidden_size, num_attention_heads, ...)"
        ) from err
    sizes = {
        "hidden_size": hidden,
        "target_hidden_size": raw.get("target_hidden_size", hidden),
        "vocab_size": vocab,
    }
    want = {
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    if sizes != want or int(raw.get("num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"{str(path)!r} describes a head for {sizes} with {raw.get('num_hidden_layers')} layers; "
            f"this target needs {want} and specdec supports one layer"
        )
    fc_bias = "fc.bias" in tensors
    if kind is EagleKind.EAGLE1 and "bias" in raw and bool(raw["bias"]) != fc_bias:
        raise ValueError(
            f"{str(path)!r} says bias={raw['bias']} but fc.bias is {'present' if fc_bias else 'missing'}"
        )
    head_dim = hidden // heads
    layers = target_layers
    if layers is None:
        layers = default_target_layers(kind, target.num_layers)
    config = EagleHeadConfig(
        kind=kind,
        target_layers=layers,
        draft_vocab_size=int(raw.get("draft_vocab_size", vocab))
        if kind is EagleKind.EAGLE3
        else vocab,
        fc_bias=fc_bias,
        qkv_bias=kind is EagleKind.EAGLE1 and bool(raw.get("qkv_bias", False)),
        intermediate_size=intermediate,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        inv_freq=_reference_inv_freq(raw, head_dim, path),
        target=head_io.target_fingerprint(target, TARGET_FIELDS),
    )
    return config, prefix


def _reference_inv_freq(raw: dict, head_dim: int, path: Path) -> tuple[float, ...]:
    """RoPE inverse frequencies as the reference builds them from a head's config.json."""
    scaling = raw.get("rope_scaling") or {}
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if kind not in ("default", "linear", "dynamic"):
        raise ValueError(
            f"{str(path)!r}: rope_scaling type {kind!r} unsupported (allowed: linear, dynamic)"
        )
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    return tuple(inv_freq.tolist())


def _file_keys(
    head: EagleHeadModel, prefix: str | None
) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """``file key -> (head parameter, part, shape)``: the head's names in a public layout, with
    ``qkv_proj`` split into q/k/v and ``gate_up_proj`` into gate/up."""
    attn = head.layer.self_attn
    splits = {
        "self_attn.qkv_proj": (
            ("q_proj", attn.q_size),
            ("k_proj", attn.kv_size),
            ("v_proj", attn.kv_size),
        ),
        "mlp.gate_up_proj": (
            ("gate_proj", head.layer_config.intermediate_size),
            ("up_proj", head.layer_config.intermediate_size),
        ),
    }
    out = {}
    for name, t in head.state_dict().items():
        shape = tuple(t.shape)
        if prefix is None or not name.startswith("layer."):
            out[name] = (name, 0, shape)
            continue
        local = name.removeprefix("layer.")
        module, _, leaf = local.rpartition(".")
        if module not in splits:
            out[prefix + local] = (name, 0, shape)
            continue
        parent = module.rpartition(".")[0]
        for part, (proj, rows) in enumerate(splits[module]):
            out[f"{prefix}{parent}.{proj}.{leaf}"] = (name, part, (rows, *shape[1:]))
    return out


def _match_keys(
    head: EagleHeadModel, tensors: dict[str, torch.Tensor], prefix: str | None, path: Path
) -> dict[str, torch.Tensor]:
    """The head's state dict from a file's tensors; ValueError naming every missing,
    unexpected or wrong-shape key (in the file's names)."""
    keys = _file_keys(head, prefix)
    hidden, vocab = head.target_config.hidden_size, head.target_config.vocab_size
    ignored = {}  # accepted, not loaded (see the module docstring): key -> shape
    if prefix is not None:
        ignored["embed_tokens.weight"] = (vocab, hidden)
        if prefix == "layers.0." and not head.config.input_norm:
            ignored["layers.0.input_layernorm.weight"] = (hidden,)
        if head.config.kind is EagleKind.EAGLE3:
            ignored["t2d"] = (vocab,)
            if head.config.draft_vocab_size == vocab:
                ignored["d2t"] = keys.pop("d2t")[2]
    missing = sorted(set(keys) - set(tensors))
    unexpected = sorted(set(tensors) - set(keys) - set(ignored))
    shapes = {k: s for k, (_, _, s) in keys.items()} | ignored
    wrong = sorted(
        f"{k} {tuple(t.shape)} != {shapes[k]}"
        for k, t in tensors.items()
        if k in shapes and tuple(t.shape) != shapes[k]
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"{str(path)!r} does not match its {head_io.CONFIG_FILE} ({head.config.kind.value} head): missing {missing}, "
            f"unexpected {unexpected}, wrong shape (file != expected) {wrong}"
        )
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, (name, part, _) in keys.items():
        parts.setdefault(name, {})[part] = tensors[key]
    state = {
        name: torch.cat([p[i] for i in range(len(p))]) if len(p) > 1 else p[0]
        for name, p in parts.items()
    }
    if "d2t" not in state and head.config.kind is EagleKind.EAGLE3:
        state["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    return state


def _check_vocab_map(
    d2t: torch.Tensor,
    t2d: torch.Tensor | None,
    config: EagleHeadConfig,
    target: ModelConfig,
    path: Path,
) -> None:
    """d2t must send the draft vocabulary to distinct target ids (and agree with t2d if given)."""
    ids = torch.arange(config.draft_vocab_size) + d2t.to(torch.int64)
    ok = (
        bool(((ids >= 0) & (ids < target.vocab_size)).all()) and ids.unique().numel() == ids.numel()
    )
    if ok and t2d is not None and config.draft_vocab_size != target.vocab_size:
        expected = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        ok = torch.equal(t2d.to(torch.bool), expected)
    if not ok:
        raise ValueError(
            f"{str(path)!r}: d2t must map draft ids 0..{config.draft_vocab_size - 1} to distinct target "
            f"ids in 0..{target.vocab_size - 1} (d + d2t[d]), matching t2d"
        )
