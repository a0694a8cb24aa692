"""OLMo 2: what its decoder does differently from Llama's.

specdec runs ``Olmo2ForCausalLM`` (model type ``olmo2``) through the decoder of
:mod:`specdec.models.llama`, with the differences below, each read off transformers'
``modeling_olmo2.py`` (the reference; transformers 5):

- no norms before the sub-blocks (the layer has no ``input_layernorm``): the attention and MLP
  outputs are normed before their residual adds, ``h + post_attention_layernorm(attn(h))``,
  then ``h + post_feedforward_layernorm(mlp(h))``: :class:`Olmo2DecoderLayer`;
- ``q_norm``/``k_norm``: an RMSNorm over the whole q projection (``num_heads * head_dim``
  channels) and the whole k projection (``num_kv_heads * head_dim``), applied before the split
  into heads and before RoPE (Qwen3 and Gemma 3 norm each head alone): :class:`Olmo2Attention`;
- RMSNorm multiplies by its weight in float32 and rounds once (Llama rounds the normed input,
  then multiplies): :func:`olmo2_rms_norm`, also the final norm;
- RoPE is applied with float32 cos/sin tables and rounded once (transformers' Olmo2 rotary
  embedding returns float32 tables; Llama's are in the model's dtype): :func:`rotate`;
- the MLP has no biases, whatever ``mlp_bias`` says; ``attention_bias`` puts biases on q/k/v
  and o_proj (:func:`~specdec.models.config_checks.linear_biases`).

Everything else is Llama's and read as Llama's (:mod:`specdec.models.config_checks`): RoPE
scaling, ``hidden_act``, ``head_dim``, tied embeddings; refused there, with a ValueError naming
the field: ``layer_types`` with sliding windows (transformers' Olmo2 applies none), RoPE types
recomputed as sequences grow, pre-quantized weights, activations with weights. Refused
elsewhere: MTP heads (:mod:`specdec.models.mtp_head`) and tensor parallelism
(:mod:`specdec.distributed.sharding`: the q/k norms span every head, which one rank's share
lacks).

The CPU kernels' fused paths (the whole-stack kernel, the fused per-layer ops) compute Llama's
layer: OLMo 2 layers run their own modules, whose linears are still the packed bf16, int8 or
q4 kernels and whose attention is the CPU attention kernel.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Olmo2Attention", "Olmo2DecoderLayer", "Olmo2RMSNorm", "fused_layer_states", "olmo2_rms_norm", "rotate"]


def olmo2_rms_norm(
    x: torch.Tensor,  # [..., size]
    weight: torch.Tensor,  # [size]
    eps: float,
) -> torch.Tensor:  # [..., size] in x.dtype
    """OLMo 2's RMSNorm: ``weight * x / rms(x)`` in float32 (float64 kept), rounded to
    ``x.dtype`` once, as transformers' ``Olmo2RMSNorm`` computes it.

    Example:
        >>> olmo2_rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 0.0)
        tensor([[0.8485, 2.2627]])
    """
    xf = x if x.dtype == torch.float64 else x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(xf.dtype) * normed).to(x.dtype)


def rotate(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (float64 for a float64 model)
    sin: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, heads, head_dim] in x.dtype
    """Rotate-half RoPE computed in the tables' precision and rounded to ``x.dtype`` once, as
    transformers' ``apply_rotary_pos_emb`` does with Olmo2's float32 tables.

    Example:
        >>> one = torch.ones(1, 1, 2)
        >>> rotate(torch.tensor([[[1.0, 2.0]]]), 0 * one, one)  # a quarter turn
        tensor([[[-2.,  1.]]])
    """
    xc = x.to(torch.promote_types(x.dtype, cos.dtype))
    half = x.shape[-1] // 2
    rotated = torch.cat((-xc[..., half:], xc[..., :half]), dim=-1)
    return (xc * cos + rotated * sin).to(x.dtype)


class Olmo2RMSNorm(nn.Module):
    """:func:`olmo2_rms_norm` with its weight (ones, as transformers starts)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return olmo2_rms_norm(x, self.weight, self.eps)

    def factor(self) -> torch.Tensor:  # [size] float32
        """The weight in float32, what the norm multiplies by (the fused CPU path's weight);
        computed once per weight storage and version, not per pass."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        if getattr(self, "_factor", None) is None or self._factor[0] != key:
            self._factor = (key, w.detach().float())
        return self._factor[1]


class Olmo2Attention(nn.Module):
    """OLMo 2's attention: Llama's fused ``qkv_proj`` and ``o_proj``, with q and k each normed
    over the whole projection before RoPE (``q_norm`` of ``num_heads * head_dim`` channels,
    ``k_norm`` of ``num_kv_heads * head_dim``).

    ``cfg``: a :class:`specdec.models.llama.ModelConfig` (not imported: that module imports
    this one).
    """

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = Olmo2RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (see rotate)
        sin: torch.Tensor,
        layer_kv: tuple[torch.Tensor, torch.Tensor],  # k, v pages [num_pages, page_size, Hkv, D]
        backend: object,
        plan: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # whole projections: every head's channels at once
        q = rotate(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = backend.run(plan, q, k, v, layer_kv[0], layer_kv[1])
        return self.o_proj(out.reshape(n, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    """An OLMo 2 decoder layer: :class:`Olmo2Attention` and Llama's MLP module (passed in,
    built by :mod:`specdec.models.llama`), each output normed before its residual add.

    ``h + post_attention_norm(attn(h))``, then ``h + post_ff_norm(mlp(h))``.
    """

    def __init__(self, hidden_size: int, eps: float, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention
        self.post_attention_layernorm = Olmo2RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = Olmo2RMSNorm(hidden_size, eps)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (see rotate)
        sin: torch.Tensor,
        layer_kv: tuple[torch.Tensor, torch.Tensor],  # k, v pages [num_pages, page_size, Hkv, D]
        backend: object,
        plan: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, layer_kv, backend, plan))
        return h + self.post_feedforward_layernorm(self.mlp(h))


def fused_layer_states(
    layers: nn.ModuleList,  # Olmo2DecoderLayer
    cos: torch.Tensor,  # [num_tokens, 1, head_dim] float32 (see rotate)
    sin: torch.Tensor,
    ops: object,  # the CPU kernel module
    h: torch.Tensor,  # [num_tokens, hidden] bf16, the embeddings
    kv: object,  # ModelKV
    backend: object,
    plan: object,
    wanted: set[int],
) -> dict[int, torch.Tensor]:  # layer index (len(layers): the last output) -> [num_tokens, hidden]
    """:meth:`LlamaModel.layer_states <specdec.models.llama.LlamaModel.layer_states>` of OLMo 2
    layers in bf16 on CPUs with the kernel's fused ops: each of the four norms (q, k, the two
    post norms) one ``add_rms_norm_f32w`` call (the weight times ``x / rms`` in float32, rounded
    once, as :func:`olmo2_rms_norm`) and the MLP's ``silu_mul``, where the modules take ~8 tensor
    ops a norm; RoPE stays :func:`rotate` (float32 tables)."""
    from specdec.attention.layered import layer_plan

    n = h.shape[0]
    states = {}
    for i, layer in enumerate(layers):
        if i in wanted:
            states[i] = h
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv_proj(h).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
        q = _norm(ops, q.contiguous(), attn.q_norm)  # whole projections: every head's channels
        k = _norm(ops, k.contiguous(), attn.k_norm)
        q = rotate(q.view(n, attn.num_heads, attn.head_dim), cos, sin)
        k = rotate(k.view(n, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(n, attn.num_kv_heads, attn.head_dim)
        out = backend.run(layer_plan(plan, i), q, k, v, *kv.layer(i))  # [num_tokens, Hq, D]
        h = h + _norm(ops, attn.o_proj(out.reshape(n, attn.q_size)), layer.post_attention_layernorm)
        m = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(h)))
        h = h + _norm(ops, m, layer.post_feedforward_layernorm)
    states[len(layers)] = h
    return states


def _norm(ops, x: torch.Tensor, norm: Olmo2RMSNorm) -> torch.Tensor:  # [num_tokens, size] bf16
    return ops.add_rms_norm_f32w(x, None, norm.factor(), norm.eps)[1]
