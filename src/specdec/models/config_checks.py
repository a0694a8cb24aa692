"""What of a transformers config the native decoder honours; a ValueError for the rest.

specdec's Llama-family decoder (:mod:`specdec.models.llama`) is exact only for the math it
implements. A config field that changes transformers' math but not specdec's would load and
decode wrongly without a word (a Llama with ``hidden_act="gelu"`` run as SiLU disagrees with
transformers' greedy output on 20 of 72 tokens), so every such field is read here, before any
weight is, and a value the decoder cannot honour raises a ValueError naming the field, its
value and what is supported.

The fields, as transformers 5's ``models/{llama,qwen2,qwen3,mistral}`` use them (Gemma 2 and
Gemma 3 read some differently, and have fields of their own: :mod:`specdec.models.gemma`; so
do Phi-3's RoPE and window: :mod:`specdec.models.phi3`):

- ``hidden_act``: ``ACT2FN[hidden_act]`` in every MLP. Any parameter-free activation is honoured
  (SiLU also by the CPU kernels' fused ops, the others by plain torch ops); ``prelu`` and
  ``xielu`` have weights of their own, which specdec does not load.
- ``sliding_window``, ``use_sliding_window``, ``max_window_layers``, ``layer_types``: which
  layers attend through a window. These families must have the same window on all of them
  (:func:`uniform_window`); Gemma's layers each have their own.
- ``attention_bias``, ``mlp_bias``: Llama reads both; Qwen3, Qwen3-MoE and OLMo 2 read
  ``attention_bias`` (q/k/v and o_proj; their MLPs have no biases). Qwen2's q/k/v always have biases and its
  other linears none; Mistral's and Phi-3's have none, whatever these say (:func:`linear_biases`).
- ``rope_parameters`` (older configs: ``rope_scaling``): every static RoPE type is computed by
  transformers' own functions (:func:`check_rope_type`, :func:`check_rotary_dims`).
- ``quantization_config``: pre-quantized weights (GPTQ, AWQ, bitsandbytes, FP8, ...), whose
  tensors specdec cannot read.

Not checked, as they change nothing at inference: ``attention_dropout`` (training only),
``pretraining_tp`` (unread by transformers 5; 4.x split the products into slices, the same
math), ``initializer_range``, ``use_cache``, the special token ids.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_activation",
    "check_quantization_config",
    "check_rope_type",
    "check_layer_types",
    "check_rotary_dims",
    "default_inv_freq",
    "linear_biases",
    "rope_parameters",
    "uniform_window",
    "unsupported",
]

SILU_NAMES = frozenset({"silu", "swish"})  # what the CPU kernels' fused SiLU-and-multiply computes
_FULL, _SLIDING = "full_attention", "sliding_attention"
_WINDOW_ON_EVERY_LAYER = ("mistral", "qwen3_moe")  # their attention reads config.sliding_window
# Recomputed from each forward's sequence length, and from the history of lengths (the cache
# holds keys rotated the old way): no fixed table gives transformers' numbers.
_DYNAMIC_ROPE = frozenset({"longrope"})


def unsupported(field: str, value: object, supported: str) -> ValueError:
    """The error of a config field the native decoder cannot honour."""
    return ValueError(
        f"this model is not supported by specdec's native decoder: config field "
        f"{field}={value!r} (supported: {supported})"
    )


def check_activation(hf_config: object, field: str = "hidden_act") -> str:
    """``hidden_act`` (default ``"silu"``; ``field``: the config field the family's MLP reads,
    Gemma's ``hidden_activation``) when it is a parameter-free activation of transformers'
    ``ACT2FN``; ValueError naming the field otherwise."""
    name = getattr(hf_config, field, None) or "silu"
    if name in SILU_NAMES:
        return name
    from transformers.activations import ACT2FN

    supported = "a parameter-free activation of transformers' ACT2FN: " + ", ".join(
        sorted(k for k in ACT2FN if k not in ("prelu", "xielu"))
    )
    if not isinstance(name, str) or name not in ACT2FN:
        raise unsupported(field, name, supported)
    act = ACT2FN[name]
    if isinstance(act, torch.nn.Module) and any(True for _ in act.parameters()):
        raise unsupported(field, name, f"{supported}; {name!r} has weights of its own")
    return name


def linear_biases(hf_config: object, arch: str) -> tuple[bool, bool, bool]:
    """``(qkv_bias, o_bias, mlp_bias)`` of architecture ``arch`` (an ``Architecture`` value)
    as transformers builds its linears: Llama reads ``attention_bias`` and ``mlp_bias``, Qwen3,
    Gemma 2, Gemma 3 and OLMo 2 ``attention_bias`` only (default False)."""
    if arch == "qwen2":
        return True, False, False
    if arch in ("mistral", "phi3"):
        return False, False, False
    attention = bool(getattr(hf_config, "attention_bias", False))
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3_text", "olmo2"):
        return attention, attention, False
    return attention, attention, bool(getattr(hf_config, "mlp_bias", False))


def uniform_window(hf_config: object, arch: str) -> int | None:
    """The sliding window of every layer (``None``: full attention), as transformers' class of
    ``arch`` applies it; ValueError when layers differ, or when ``layer_types`` asks for windows
    that class does not apply.

    Qwen2 and Qwen3 window the layers ``layer_types`` calls ``sliding_attention`` (transformers
    derives them from ``use_sliding_window`` and ``max_window_layers``: layers
    ``i >= max_window_layers``), Mistral and Qwen3-MoE every layer (Qwen3MoeConfig drops
    ``sliding_window`` unless ``use_sliding_window``), Llama none (its ``sliding_window``, if
    any, is unread by transformers).
    """
    n = hf_config.num_hidden_layers
    if arch in ("qwen2", "qwen3"):
        return _qwen2_window(hf_config, n, arch)
    return _class_window(hf_config, arch, n)


def _qwen2_window(hf_config: object, n: int, arch: str) -> int | None:
    """Qwen2's and Qwen3's layers follow ``layer_types`` (transformers 5 writes them; older
    configs have only ``max_window_layers``, from which transformers derives them the same way;
    both configs drop ``sliding_window`` unless ``use_sliding_window``)."""
    window = getattr(hf_config, "sliding_window", None)
    window = window if getattr(hf_config, "use_sliding_window", False) else None
    first = getattr(hf_config, "max_window_layers", n)
    declared = getattr(hf_config, "layer_types", None)
    types = list(
        declared or (_SLIDING if window is not None and i >= first else _FULL for i in range(n))
    )
    check_layer_types(types, n)
    windows = {window if t == _SLIDING else None for t in types}
    if len(windows) > 1:
        raise unsupported(
            "layer_types",
            _summary(types),
            "the same attention on every layer: all full_attention, or all sliding_attention "
            f"(for {arch.capitalize()} from use_sliding_window=True and max_window_layers=0; this config has "
            f"use_sliding_window={getattr(hf_config, 'use_sliding_window', False)!r}, "
            f"max_window_layers={first!r}, sliding_window={window!r})",
        )
    return windows.pop()


def _class_window(hf_config: object, arch: str, n: int) -> int | None:
    """Mistral's and Qwen3-MoE's ``sliding_window`` on every layer, Llama's none, checked
    against any ``layer_types``: transformers' Llama, Mistral and Qwen3-MoE classes ignore them,
    but AutoConfig reads a Mistral config.json that has them as Ministral's, whose layers follow
    them as Qwen2's do. Only where both readings agree is the model's attention known."""
    window = getattr(hf_config, "sliding_window", None)
    applied = window if arch in _WINDOW_ON_EVERY_LAYER else None
    declared = getattr(hf_config, "layer_types", None)
    if declared is None:
        return applied
    types = list(declared)
    check_layer_types(types, n)
    if any((window if t == _SLIDING else None) != applied for t in types):
        where = (
            f"sliding_window={applied!r} on every layer"
            if arch in _WINDOW_ON_EVERY_LAYER
            else "no window on any layer"
        )
        raise unsupported(
            "layer_types",
            _summary(types),
            f"layer_types that agree with what transformers' {arch} class applies, {where}; "
            "per-layer windows are implemented for Gemma 2 and Gemma 3 only",
        )
    return applied


def check_layer_types(types: list[object], n: int) -> None:
    """ValueError naming ``layer_types`` unless it has ``n`` entries of the two kinds."""
    if len(types) != n or any(t not in (_FULL, _SLIDING) for t in types):
        raise unsupported(
            "layer_types",
            _summary(types),
            f"{n} entries (num_hidden_layers), each {_FULL!r} or {_SLIDING!r}",
        )


def _summary(types: list[object]) -> str:
    """``layer_types`` in a line: runs of equal entries as ``name x count``."""
    runs: list[list[object]] = []
    for t in types:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return "[" + ", ".join(f"{t} x{c}" if c > 1 else str(t) for t, c in runs) + "]"


def rope_parameters(
    hf_config: object, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 and attention scaling exactly as
    transformers computes them (every static RoPE scaling type; the others raise, see
    :func:`check_rope_type`); ``layer_type``: the entry of per-layer-type ``rope_parameters``
    (Gemma 3's ``"sliding_attention"``/``"full_attention"``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = check_rope_type(params)
    if rope_type == "default":
        theta = (params or {}).get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return default_inv_freq(theta, head_dim), 1.0
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    check_rotary_dims(inv_freq, head_dim, params)
    return inv_freq, scaling


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    """Plain RoPE's inverse frequencies, transformers' formula (float32 exponents)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def check_rope_type(params: dict | None) -> str:
    """The RoPE type of ``rope_parameters`` (``"default"`` without one); ValueError for a
    type transformers recomputes as sequences grow, for an unknown one, and for parameters
    per layer type (one RoPE serves every layer here).

    ``"dynamic"`` (NTK) is kept: transformers changes its frequencies only once a sequence
    passes ``max_position_embeddings``, which specdec's sequences never reach.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = params or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise unsupported(
            "rope_parameters", sorted(params), "one set of RoPE parameters for every layer"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    static = sorted({"default", *ROPE_INIT_FUNCTIONS} - _DYNAMIC_ROPE)
    if rope_type != "default" and (
        rope_type in _DYNAMIC_ROPE or rope_type not in ROPE_INIT_FUNCTIONS
    ):
        raise unsupported("rope_parameters.rope_type", rope_type, ", ".join(static))
    return rope_type


def check_rotary_dims(inv_freq: torch.Tensor, head_dim: int, params: dict | None) -> None:
    """RoPE must rotate whole heads (``head_dim // 2`` frequencies): transformers' Llama,
    Qwen2, Qwen3 and Mistral apply cos/sin to all ``head_dim`` channels, and fail themselves on
    the shorter tables a ``partial_rotary_factor`` below 1 makes."""
    if inv_freq.numel() != head_dim // 2:
        factor = (params or {}).get("partial_rotary_factor")
        raise unsupported(
            "rope_parameters.partial_rotary_factor",
            factor,
            f"1.0 (RoPE over all {head_dim} channels of a head)",
        )


def check_quantization_config(hf_config: object) -> None:
    """Pre-quantized checkpoints (GPTQ, AWQ, bitsandbytes, FP8, ...) are refused: their tensors
    are packed codes, not the dense weights specdec reads (``quantization="int8"``/``"q4"``
    quantizes a dense checkpoint itself)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # an enum in transformers' config classes
    raise unsupported(
        "quantization_config",
        {"quant_method": method},
        "none: a dense float checkpoint (quantize it with specdec's quantization='int8' or 'q4')",
    )
