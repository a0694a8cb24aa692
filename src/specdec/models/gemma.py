"""Gemma 2 and Gemma 3 (text): what their decoder does differently from Llama's.

specdec runs ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (``Gemma3TextConfig``, model type
``gemma3_text``) through the decoder of :mod:`specdec.models.llama`, with the differences
below, each read off transformers' ``modeling_gemma2.py`` and ``modeling_gemma3.py`` (the
reference; transformers 5):

- the embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype
  (``Gemma*TextScaledWordEmbedding``): :func:`scale_embeddings`;
- RMSNorm multiplies by ``1 + weight`` in float32 and rounds once (Llama rounds the normed
  input, then multiplies): :func:`gemma_rms_norm`;
- sandwich norms: ``post_attention_layernorm`` norms the attention output before the residual
  add, ``pre_feedforward_layernorm``/``post_feedforward_layernorm`` wrap the MLP:
  :class:`GemmaDecoderLayer`;
- the MLP's activation is ``hidden_activation`` (``gelu_pytorch_tanh``), not ``hidden_act``;
- attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- Gemma 2 caps attention scores, ``cap * tanh(s / cap)`` with ``attn_logit_softcapping``
  (``AttentionSpec.logits_soft_cap``, computed by the attention backends); transformers' Gemma 3
  passes no cap to its attention whatever its config says, and norms queries and keys per head
  with the Gemma RMSNorm (``qk_norm``);
- both cap the logits with ``final_logit_softcapping`` when set (Gemma 3's default is none):
  :func:`soft_cap`;
- sliding-window and global layers interleave (``layer_types``; configs without them:
  every second layer global for Gemma 2, every ``sliding_window_pattern``-th for Gemma 3), so
  each layer has its window (``AttentionSpec.layer_windows``);
- Gemma 3 rotates sliding layers with their own RoPE (``rope_parameters["sliding_attention"]``;
  transformers 4 configs: ``rope_local_base_freq``) and global layers with
  ``rope_parameters["full_attention"]`` (``rope_theta`` and ``rope_scaling``, linear on the
  larger checkpoints);
- tied embeddings (``tie_word_embeddings``, true by default): as for every family.

Refused, with a ValueError naming the field: ``use_bidirectional_attention`` (not causal),
soft caps and ``query_pre_attn_scalar`` that are not positive numbers, a ``sliding_window``
that is not a positive int where layers slide, and what every family refuses
(:mod:`specdec.models.config_checks`: ``layer_types`` of other kinds, RoPE types recomputed as
sequences grow, pre-quantized weights, activations with weights).

On the CPU in bf16, Gemma layers run every layer in one kernel call (:func:`stack_layer_states`,
``gemma_layers``), or where that does not apply a Python loop over the kernel's fused ops with
Gemma's norms and gelu (:func:`fused_layer_states`); their linears are the packed bf16, int8 or
q4 kernels and their attention the CPU attention kernel (Gemma 2's capped scores: the float64
reference attention, and the loop).
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import nn

from specdec.models import config_checks
from specdec.models.config_checks import unsupported

__all__ = [
    "FAMILIES",
    "GemmaDecoderLayer",
    "GemmaRMSNorm",
    "GemmaTraits",
    "gemma_rms_norm",
    "layer_rope",
    "read_traits",
    "scale_embeddings",
    "soft_cap",
]

FAMILIES = frozenset({"gemma2", "gemma3_text"})  # the Architecture values of these decoders
_SLIDING = "sliding_attention"


@attrs.frozen(kw_only=True)
class GemmaTraits:
    """What a Gemma 2 or Gemma 3 config adds to a :class:`~specdec.models.llama.ModelConfig`."""

    embed_scale: float  # sqrt(hidden_size), applied rounded to the model's dtype
    query_pre_attn_scalar: float  # the attention scale is its inverse square root
    attn_logit_softcap: float | None  # Gemma 2; None: scores uncapped (Gemma 3 always)
    final_logit_softcap: float | None
    sliding_layers: tuple[bool, ...]  # [num_layers] whether layer_types calls it sliding_attention
    sliding_window: int | None  # their window (None: they attend to everything, as transformers')
    # Gemma 3: the sliding layers' RoPE inverse frequencies (scaling applied) and attention
    # scaling; None: every layer rotates with ModelConfig.inv_freq (Gemma 2).
    sliding_inv_freq: tuple[float, ...] | None = None
    sliding_rope_attention_scaling: float = 1.0

    @property
    def sm_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...]:  # [num_layers]
        """Each layer's window: ``sliding_window`` on the sliding layers, None on the others."""
        return tuple(self.sliding_window if s else None for s in self.sliding_layers)


def read_traits(hf_config: object, arch: str, head_dim: int) -> GemmaTraits:
    """The Gemma fields of a transformers ``Gemma2Config`` (``arch="gemma2"``) or
    ``Gemma3TextConfig`` (``"gemma3_text"``); ValueError naming a field specdec cannot honour."""
    if getattr(hf_config, "use_bidirectional_attention", None):
        raise unsupported("use_bidirectional_attention", True, "False or null (causal attention)")
    scalar = _positive(hf_config, "query_pre_attn_scalar", required=True)
    final_cap = _positive(hf_config, "final_logit_softcapping")
    attn_cap = _positive(hf_config, "attn_logit_softcapping") if arch == "gemma2" else None
    sliding_inv_freq, sliding_scaling = None, 1.0
    if arch == "gemma3_text":
        inv_freq, sliding_scaling = layer_rope(hf_config, head_dim, _SLIDING)
        sliding_inv_freq = tuple(inv_freq.tolist())
    return GemmaTraits(
        embed_scale=math.sqrt(hf_config.hidden_size),
        query_pre_attn_scalar=scalar,
        attn_logit_softcap=attn_cap,
        final_logit_softcap=final_cap,
        sliding_layers=_sliding_layers(hf_config, arch),
        sliding_window=_window(hf_config),
        sliding_inv_freq=sliding_inv_freq,
        sliding_rope_attention_scaling=float(sliding_scaling),
    )


def _positive(hf_config: object, field: str, *, required: bool = False) -> float | None:
    value = getattr(hf_config, field, None)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise unsupported(field, value, "a positive number" + ("" if required else ", or null (off)"))
    return float(value)


def _sliding_layers(hf_config: object, arch: str) -> tuple[bool, ...]:
    """Which layers ``layer_types`` calls ``sliding_attention`` (their window and, for Gemma 3,
    their RoPE are the sliding ones)."""
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:  # what transformers derives for configs without them
        pattern = 2 if arch == "gemma2" else getattr(hf_config, "sliding_window_pattern", None) or 6
        types = [_SLIDING if (i + 1) % pattern else "full_attention" for i in range(n)]
    types = list(types)
    config_checks.check_layer_types(types, n)
    return tuple(t == _SLIDING for t in types)


def _window(hf_config: object) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise unsupported("sliding_window", window, "a positive int, or null (no window)")
    return window


def layer_rope(hf_config: object, head_dim: int, layer_type: str) -> tuple[torch.Tensor, float]:
    """The RoPE (inverse frequencies ``[head_dim // 2]`` float32, attention scaling) of the
    layers of ``layer_type`` (``"sliding_attention"``/``"full_attention"``), as transformers
    computes it: Gemma 3's per-type ``rope_parameters`` (transformers 5), or its older
    ``rope_local_base_freq`` for sliding layers; otherwise the one RoPE of every layer."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return config_checks.rope_parameters(hf_config, head_dim, layer_type)
    local_theta = getattr(hf_config, "rope_local_base_freq", None)
    if layer_type == _SLIDING and local_theta is not None:
        return config_checks.default_inv_freq(local_theta, head_dim), 1.0
    return config_checks.rope_parameters(hf_config, head_dim)


def gemma_rms_norm(
    x: torch.Tensor,  # [..., size]
    weight: torch.Tensor,  # [size]
    eps: float,
) -> torch.Tensor:  # [..., size] in x.dtype
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32 (float64 kept), rounded to
    ``x.dtype`` once, as transformers' ``Gemma2RMSNorm``/``Gemma3RMSNorm`` compute it.

    Example:
        >>> gemma_rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([0.0, 1.0]), 0.0)
        tensor([[0.8485, 2.2627]])
    """
    xf = x if x.dtype == torch.float64 else x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.to(xf.dtype))).to(x.dtype)


def soft_cap(
    logits: torch.Tensor,  # [rows, vocab] float32 or float64
    cap: float,
) -> torch.Tensor:  # [rows, vocab]
    """``cap * tanh(logits / cap)`` (transformers' order); ``-inf`` stays ``-inf`` (the tokens a
    draft vocabulary leaves out, :mod:`specdec.models.sub_vocab`, keep probability 0).

    Example:
        >>> soft_cap(torch.tensor([0.0, 30.0, float("-inf")]), 30.0)
        tensor([ 0.0000, 22.8478,    -inf])
    """
    capped = torch.tanh(logits / cap) * cap
    return torch.where(torch.isneginf(logits), logits, capped)


def scale_embeddings(
    embeds: torch.Tensor,  # [num_tokens, hidden]
    scale: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """``embeds * scale`` with ``scale`` first rounded to float32 and then to the embeddings'
    dtype, as transformers multiplies (``sqrt(1152) = 33.94`` is 34.0 in bf16)."""
    return embeds * float(torch.tensor(scale, dtype=torch.float32).to(embeds.dtype))


class GemmaRMSNorm(nn.Module):
    """:func:`gemma_rms_norm` with its weight (zeros: a norm times 1, as transformers starts)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self._factor: tuple[tuple[int, int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)

    def factor(self) -> torch.Tensor:  # [size] float32
        """``1 + weight`` in float32, what the norm multiplies by (the fused CPU path's
        weight); computed once per weight storage and version, not per pass."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._factor is None or self._factor[0] != key:
            self._factor = (key, 1.0 + w.detach().float())
        return self._factor[1]


class GemmaDecoderLayer(nn.Module):
    """A Gemma decoder layer: Llama's attention and MLP modules (passed in, built by
    :mod:`specdec.models.llama`) between four Gemma norms.

    ``h + post_attention_norm(attn(input_norm(h)))``, then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``.
    """

    def __init__(self, hidden_size: int, eps: float, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] this layer's RoPE
        sin: torch.Tensor,
        layer_kv: tuple[torch.Tensor, torch.Tensor],  # k, v pages [num_pages, page_size, Hkv, D]
        backend: object,
        plan: object,  # this layer's plan (its window)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        attn = self.self_attn(self.input_layernorm(h), cos, sin, layer_kv, backend, plan)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


GELU_TANH = "gelu_pytorch_tanh"  # Gemma's activation, the one the fused CPU path computes


def fused_layer_states(
    layers: nn.ModuleList,  # GemmaDecoderLayer
    ropes: list[tuple[torch.Tensor, torch.Tensor]],  # per layer cos, sin [num_tokens, 1, head_dim] bf16
    ops: object,  # the CPU kernel module
    h: torch.Tensor,  # [num_tokens, hidden] bf16, the scaled embeddings
    kv: object,  # ModelKV
    backend: object,
    plan: object,
    wanted: set[int],
) -> dict[int, torch.Tensor]:  # layer index (len(layers): the last output) -> [num_tokens, hidden]
    """:meth:`LlamaModel.layer_states <specdec.models.llama.LlamaModel.layer_states>` of Gemma
    layers in bf16 on CPUs with the kernel's fused ops, one call each where the module path
    takes ~8 tensor ops a norm (four norms a layer, ~1100 ops a Gemma-3-1B token):
    ``add_rms_norm_f32w`` with ``1 + w`` in float32 (the residual add rounded to bf16, the
    normed row times the factor in float32, rounded once, as :func:`gemma_rms_norm`),
    ``rope_qk`` (bitwise the module path's RoPE) and ``gelu_tanh_mul`` (PyTorch's own ops).
    The post-feedforward output is added by the next layer's input norm (``delta``), as the
    Llama fused path does."""
    from specdec.attention.layered import layer_plan

    n = h.shape[0]
    delta, states = None, {}
    for i, (layer, (cos, sin)) in enumerate(zip(layers, ropes)):
        attn, mlp = layer.self_attn, layer.mlp
        h, x = _fused_norm(ops, h, delta, layer.input_layernorm)
        if i in wanted:
            states[i] = h
        qkv = attn.qkv_proj(x)  # [num_tokens, (Hq + 2 Hkv) * D]
        if attn.q_norm is not None:  # Gemma 3: per head, before RoPE
            qkv = _fused_norm_qk(ops, qkv, attn)
        q, k = ops.rope_qk(qkv, cos.view(n, -1), sin.view(n, -1), attn.num_heads, attn.num_kv_heads, attn.head_dim)
        v = qkv[:, attn.q_size + attn.kv_size :].view(n, attn.num_kv_heads, attn.head_dim)
        out = backend.run(layer_plan(plan, i), q, k, v, *kv.layer(i))  # [num_tokens, Hq, D]
        _, a = _fused_norm(ops, attn.o_proj(out.reshape(n, attn.q_size)), None, layer.post_attention_layernorm)
        h, x = _fused_norm(ops, h, a, layer.pre_feedforward_layernorm)
        m = mlp.down_proj(ops.gelu_tanh_mul(mlp.gate_up_proj(x)))
        _, delta = _fused_norm(ops, m, None, layer.post_feedforward_layernorm)
    states[len(layers)] = h if delta is None else h + delta
    return states


def stack_layer_states(
    layers: nn.ModuleList,  # GemmaDecoderLayer
    ropes: list[tuple[torch.Tensor, torch.Tensor]],  # per layer cos, sin [num_tokens, 1, head_dim] bf16
    ops: object,  # the CPU kernel module
    h: torch.Tensor,  # [num_tokens, hidden] bf16, the scaled embeddings
    kv: object,  # ModelKV
    backend: object,
    plan: object,
    wanted: tuple[int, ...],
) -> list[torch.Tensor] | None:  # len(wanted) x [num_tokens, hidden], or None
    """:func:`fused_layer_states` in one kernel call (``gemma_layers`` in
    ``kernels/cpu_decoder.cpp``: the same calls in the same order, so the same bits), where it
    applies: the CPU attention kernel over a bf16 pool for every layer (no soft-capped scores:
    Gemma 2's layers keep the loop), kernel linears with bf16 results, one eps; else None. The
    arguments are read afresh at every forward (~10 us a layer; nothing is kept, so nothing
    goes stale)."""
    from specdec.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan
    from specdec.attention.layered import layer_plan
    from specdec.kernels.cpu_linear import bf16_dot_mode, vnni_mode
    from specdec.kv.paged import ModelKV
    from specdec.models.cpu_decoder import decoder_disabled
    from specdec.models.kernel_args import kernel_args

    if (
        decoder_disabled() or type(backend) is not CpuAttentionBackend or not isinstance(kv, ModelKV)
        or kv.pool.cache.dtype != torch.bfloat16 or kv.pool.cache.device.type != "cpu"
    ):  # fmt: skip
        return None
    plans = [layer_plan(plan, i) for i in range(len(layers))]
    if not all(isinstance(p, CpuAttentionPlan) and p.torch_plan.spec.logits_soft_cap is None for p in plans):
        return None
    factors, qk_factors, columns, eps = [], [], ([], [], [], [], [], []), set()
    bf16_dot, vnni = bf16_dot_mode(), vnni_mode()
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)  # fmt: skip
        factors += (n.factor() for n in norms)
        eps.update(n.eps for n in norms)
        if attn.q_norm is not None:
            qk_factors += (attn.q_norm.factor(), attn.k_norm.factor())
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            args = kernel_args(linear, bf16_dot, vnni)
            if args is None:
                return None
            for column, value in zip(columns, args):
                column.append(value)
    qk_eps = {n.eps for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None}
    if len(eps) != 1 or len(qk_eps) > 1 or len(qk_factors) not in (0, 2 * len(layers)):
        return None
    n, first = h.shape[0], layers[0].self_attn
    tps = [p.torch_plan for p in plans]
    return ops.gemma_layers(
        h.contiguous(), factors, qk_factors, eps.pop(), qk_eps.pop() if qk_eps else 0.0, *columns,
        [c.view(n, -1) for c, _ in ropes], [s.view(n, -1) for _, s in ropes],
        first.num_heads, first.num_kv_heads, first.head_dim, kv.pool.cache, tps[0].slot_mapping,
        [p.row_seq for p in plans], [p.row_index for p in plans], [t.kv_gather for t in tps],
        [p.kv_lens for p in plans], [t.mask for t in tps], [t.spec.sm_scale for t in tps], list(wanted),
    )  # fmt: skip


def _fused_norm(ops, h, delta, norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, norm(h + delta))`` [num_tokens, size] bf16 each, one kernel call."""
    return ops.add_rms_norm_f32w(h, delta, norm.factor(), norm.eps)


def _fused_norm_qk(ops, qkv: torch.Tensor, attn: nn.Module) -> torch.Tensor:  # [T, (Hq + 2 Hkv) * D]
    """Gemma 3's per-head q/k norms on the fused projection, each head a row of the kernel's
    norm; v as it was."""
    n, d = qkv.shape[0], attn.head_dim
    q, k, v = qkv.split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = _fused_norm(ops, q.reshape(-1, d).contiguous(), None, attn.q_norm)[1]
    k = _fused_norm(ops, k.reshape(-1, d).contiguous(), None, attn.k_norm)[1]
    return torch.cat((q.view(n, -1), k.view(n, -1), v), dim=-1)
