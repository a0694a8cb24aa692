"""Phi-3 and Phi-4-mini: what their decoder does differently from Llama's.

specdec runs ``Phi3ForCausalLM`` (model type ``phi3``: Phi-3-mini/medium 4k and 128k,
Phi-3.5-mini, Phi-4-mini) through the decoder of :mod:`specdec.models.llama`, with the
differences below, each read off transformers' ``modeling_phi3.py``, ``configuration_phi3.py``
and ``modeling_rope_utils.py`` (the reference; transformers 5):

- fused projections: ``self_attn.qkv_proj`` (q, k, v stacked on the output dimension, in that
  order: ``qkv[..., :Hq*D]``, then ``Hkv*D`` rows of k, then v) and ``mlp.gate_up_proj`` (gate,
  then up: ``chunk(2)``, ``up * act(gate)``). These are specdec's own fused layers, row for row
  (for the other families the loader fuses ``q/k/v_proj`` and ``gate/up_proj`` into them), so a
  checkpoint's tensors load as they are and every fast path (packed bf16, int8 and q4 linears,
  the fused CPU kernels) applies unchanged. No linear has a bias, whatever ``attention_bias`` or
  ``mlp_bias`` say (:func:`~specdec.models.config_checks.linear_biases`);
- partial RoPE (``partial_rotary_factor``; Phi-4-mini: 0.75): transformers rotates only the
  first ``rotary_dim = int(head_dim * factor)`` channels of each q/k head (rotate-half within
  them: channel ``i`` with ``i + rotary_dim / 2``) and passes the others through. specdec's RoPE
  (:func:`~specdec.models.llama.apply_rope` and the CPU kernels' ``rope_qk``) pairs channel ``i``
  with ``i + head_dim / 2`` under per-channel cos/sin tables. Attention scores are sums over a
  head's channels, unchanged when q and k reorder their channels alike, so the loader reorders
  each q and k head's rows of ``qkv_proj`` (:func:`qkv_row_order`) so that the rotated pairs
  land on the kernel's pairs and the passed channels on the pairs whose frequency is 0
  (:func:`rope_parameters` pads the frequencies with zeros) and whose attention scaling is 1
  (:func:`pair_scaling`): cos 1 and sin 0 leave a channel exactly as it was, as transformers'
  ``q_pass`` is. The KV cache holds keys in that order; nothing outside the layer sees it (the
  values, the attention output and the hidden states keep theirs). The CPU kernels' fused
  paths therefore run Phi-3 layers, whole-stack kernel included;
- RoPE type ``longrope`` (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): inverse frequencies
  ``1 / (factor_i * theta ** (2i / rotary_dim))`` with per-frequency ``short_factor`` or
  ``long_factor``, and cos/sin times an attention factor (``attention_factor``, else
  ``sqrt(1 + ln(max_position_embeddings / original) / ln(original))``). transformers uses the
  short factors while a forward's sequence (its largest position + 1) is at most
  ``original_max_position_embeddings``; a longer one rotates *every* position of that forward
  with the long factors (``dynamic_rope_update``), and ``generate`` drops its cache at the step
  the sequence first passes that length and recomputes the whole sequence with them
  (``Phi3ForCausalLM.prepare_inputs_for_generation``), so the keys of a short sequence and of a
  long one differ at every position. specdec computes the short factors (exactly transformers'
  ``_compute_longrope_parameters``) and bounds the model's context at
  ``original_max_position_embeddings`` (:func:`read_traits`): requests and ``max_model_len``
  past it are refused with an error naming that field. Switching exactly would mean recomputing
  every key of a sequence as it crosses the length, and in a verify pass that straddles it,
  rows before and after the crossing would need keys rotated both ways at once;
- ``sliding_window`` on every layer when set (transformers' sliding-window mask, as Mistral's).

Training-only fields change nothing here: ``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``.
An MTP head's layer is a Phi-3 layer (the target's RoPE tables, its own q/k channel order); an
EAGLE head's is a Llama layer with the target's frequencies and one attention scaling. GGUF
files as llama.cpp writes ``phi3`` (``attn_qkv``, ``ffn_up`` holding gate and up, the longrope
factor tensors) load densely and as q4 (:mod:`specdec.models.gguf_file`).

Refused, with a ValueError naming the field: RoPE types other than the default and ``longrope``
(as transformers' ``Phi3Config`` refuses them), a ``partial_rotary_factor`` outside (0, 1] or
leaving an odd number of rotated channels, ``short_factor``/``long_factor`` lists of the wrong
length, a ``sliding_window`` that is not a positive int, an ``original_max_position_embeddings``
that is not one, and what every family refuses (:mod:`specdec.models.config_checks`:
pre-quantized weights, activations with weights). Refused elsewhere: tensor parallelism
(:mod:`specdec.distributed.sharding` slices q/k/v and gate/up tensors by their Llama names; the
fused ones it would read whole).
"""

from __future__ import annotations

import attrs
import torch

from specdec.models import config_checks
from specdec.models.config_checks import unsupported

__all__ = [
    "Phi3Traits",
    "arrange_qkv",
    "pair_scaling",
    "qkv_row_order",
    "read_traits",
    "rope_parameters",
    "rotary_channel_order",
    "sliding_window",
    "usable_context",
]

_ROPE_TYPES = ("default", "longrope")  # what transformers' Phi3Config accepts
_CONTEXT = "max_position_embeddings"
_LONGROPE_CONTEXT = "rope_parameters.original_max_position_embeddings (longrope's short factors)"


@attrs.frozen(kw_only=True)
class Phi3Traits:
    """What a Phi-3 config adds to a :class:`~specdec.models.llama.ModelConfig`."""

    rotary_dim: int  # channels of each q/k head RoPE rotates: int(head_dim * partial_rotary_factor)
    context_field: str = _CONTEXT  # the config field that bounds the model's context


def read_traits(hf_config: object, head_dim: int) -> Phi3Traits:
    """The Phi-3 fields of a transformers ``Phi3Config``; ValueError naming a field specdec
    cannot honour. The context is bounded by ``original_max_position_embeddings`` for longrope
    (see the module's docstring), whose field then names the bound in length errors."""
    params = _rope_params(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise unsupported(
            "rope_parameters.rope_type", rope_type, ", ".join(_ROPE_TYPES) + " (Phi3Config's)"
        )
    traits = Phi3Traits(rotary_dim=_rotary_dim(params, head_dim))
    if rope_type == "longrope":
        _check_factors(params, traits.rotary_dim)
        original = params.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise unsupported(
                "rope_parameters.original_max_position_embeddings", original, "a positive int"
            )
        if original < hf_config.max_position_embeddings:
            traits = attrs.evolve(traits, context_field=_LONGROPE_CONTEXT)
    return traits


def usable_context(hf_config: object) -> int:
    """The longest sequence specdec runs a Phi-3 config at: ``max_position_embeddings``, but at
    most ``original_max_position_embeddings`` under longrope (its short factors)."""
    params = _rope_params(hf_config)
    context = hf_config.max_position_embeddings
    if params.get("rope_type", params.get("type")) == "longrope":
        original = params.get("original_max_position_embeddings")
        if isinstance(original, int) and not isinstance(original, bool) and original > 0:
            return min(context, original)
    return context


def rope_parameters(hf_config: object, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 and attention scaling: transformers'
    (the default RoPE of ``Phi3RotaryEmbedding``, or ``_compute_longrope_parameters`` without a
    sequence length: the short factors) over the ``rotary_dim // 2`` rotated pairs, then zeros
    for the pairs partial RoPE leaves alone (with :func:`qkv_row_order`'s channel order).

    Example:
        >>> cfg = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5)
        >>> rope_parameters(cfg, 16)[0]
        tensor([1.0000, 0.1000, 0.0100, 0.0010, 0.0000, 0.0000, 0.0000, 0.0000])
    """
    params = _rope_params(hf_config)
    rotary_dim = read_traits(hf_config, head_dim).rotary_dim
    if params.get("rope_type", params.get("type", "default")) == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")
    else:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq, scaling = config_checks.default_inv_freq(theta, rotary_dim), 1.0
    passed = torch.zeros(head_dim // 2 - rotary_dim // 2, dtype=torch.float32)
    return torch.cat((inv_freq.float(), passed)), float(scaling)


def sliding_window(hf_config: object) -> int | None:
    """``sliding_window`` (every layer's, as transformers' Phi3 masks); None: no window."""
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise unsupported("sliding_window", window, "a positive int, or null (no window)")
    return window


def rotary_channel_order(head_dim: int, rotary_dim: int) -> torch.Tensor:  # [head_dim] int64
    """The transformers channel of a head that each of specdec's channels holds: the first and
    second halves of the rotated channels on the first and second halves of the head (pairs
    ``i``, ``i + head_dim / 2``, as specdec rotates them), the passed channels on the pairs
    past ``rotary_dim / 2`` of each half.

    >>> rotary_channel_order(8, 4).tolist()
    [0, 1, 4, 5, 2, 3, 6, 7]
    """
    rot, passed = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((rot[:r], passed[:p], rot[r:], passed[p:]))


def qkv_row_order(
    num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int
) -> torch.Tensor | None:
    """The checkpoint row of each of specdec's ``qkv_proj`` rows ``[(Hq + 2 Hkv) * D]`` int64:
    every q and k head in :func:`rotary_channel_order`, v as it is; None when RoPE rotates whole
    heads (nothing to reorder)."""
    if rotary_dim == head_dim:
        return None
    within = rotary_channel_order(head_dim, rotary_dim)
    qk_heads = num_heads + num_kv_heads
    qk = (torch.arange(qk_heads).unsqueeze(1) * head_dim + within).reshape(-1)
    return torch.cat((qk, torch.arange(qk_heads * head_dim, (qk_heads + num_kv_heads) * head_dim)))


def arrange_qkv(state: dict[str, torch.Tensor], cfg: object) -> None:
    """Reorder, in ``state`` (specdec names), the q/k rows of every ``qkv_proj`` weight and bias
    of a model of ``cfg`` (a :class:`~specdec.models.llama.ModelConfig` with ``phi3`` traits)
    for partial RoPE (:func:`qkv_row_order`); nothing for RoPE over whole heads."""
    order = qkv_row_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.phi3.rotary_dim)
    if order is None:
        return
    for name in [
        n for n in state if n.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias"))
    ]:
        state[name] = state[name][order.to(state[name].device)]


def pair_scaling(
    cfg: object, device: torch.device | str | None = None
) -> torch.Tensor:  # [head_dim // 2]
    """The attention scaling of each RoPE pair when it is not one number: longrope's factor on
    the rotated pairs and 1 on the pairs partial RoPE passes through (transformers scales
    ``q_rot`` and ``k_rot`` only); empty where ``cfg.rope_attention_scaling`` serves every pair."""
    phi = getattr(cfg, "phi3", None)
    half = cfg.head_dim // 2
    if phi is None or phi.rotary_dim == cfg.head_dim or cfg.rope_attention_scaling == 1.0:
        return torch.zeros(0, device=device)
    scaling = torch.ones(half, dtype=torch.float32, device=device)
    scaling[: phi.rotary_dim // 2] = cfg.rope_attention_scaling
    return scaling


def _rope_params(hf_config: object) -> dict:
    params = (
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    if not isinstance(params, dict):
        raise unsupported("rope_parameters", params, "a dict (Phi3Config's)")
    return params


def _rotary_dim(params: dict, head_dim: int) -> int:
    factor = params.get("partial_rotary_factor", 1.0)
    ok = not isinstance(factor, bool) and isinstance(factor, (int, float)) and 0 < factor <= 1
    rotary_dim = int(head_dim * factor) if ok else 0
    if rotary_dim < 2 or rotary_dim % 2:
        raise unsupported(
            "rope_parameters.partial_rotary_factor",
            factor,
            f"a number in (0, 1] whose share of head_dim={head_dim} is an even number of channels",
        )
    return rotary_dim


def _check_factors(params: dict, rotary_dim: int) -> None:
    """longrope's factors: one number per rotated pair (transformers only warns, then fails or
    broadcasts in the rotary embedding)."""
    for field in ("short_factor", "long_factor"):
        factors = params.get(field)
        numbers = isinstance(factors, (list, tuple)) and all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors
        )
        if not numbers or len(factors) != rotary_dim // 2:
            shown = factors if not isinstance(factors, (list, tuple)) else f"{len(factors)} values"
            raise unsupported(
                f"rope_parameters.{field}",
                shown,
                f"{rotary_dim // 2} positive numbers (rotary_dim / 2)",
            )
