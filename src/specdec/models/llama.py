"""Llama-family decoder (Llama, Llama 3, Qwen2, Qwen3, Mistral; Gemma 2 and Gemma 3 with the
differences of :mod:`specdec.models.gemma`, OLMo 2 with those of :mod:`specdec.models.olmo2`,
Phi-3 / Phi-4-mini with those of :mod:`specdec.models.phi3`, Qwen3-MoE with the sparse MLP of
:mod:`specdec.models.qwen3_moe`) over the paged KV cache.

Parameter names follow Hugging Face's except for two fusions that cut the number of matrix
products per layer on small batches: ``qkv_proj`` (q, k, v stacked) and ``gate_up_proj`` (gate
and up stacked; Phi-3 checkpoints have them already). :mod:`specdec.models.loading` maps
checkpoints onto them. The model holds only weights: the KV pages, the attention plan and the
backend arrive as arguments of ``forward``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention.layered import layer_plan
from specdec.interfaces import AttentionBackend, AttentionSpec
from specdec.kv.paged import KVSpec, ModelKV
from specdec.models import config_checks, gemma, olmo2, phi3, qwen3_moe
from specdec.types import BatchLayout, ModelOutput

__all__ = ["Architecture", "ModelConfig", "UnsupportedArchitecture", "LlamaModel", "rms_norm", "apply_rope", "rope_tables"]


class Architecture(enum.Enum):
    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MISTRAL = "mistral"
    GEMMA2 = "gemma2"
    GEMMA3 = "gemma3_text"  # Gemma3ForCausalLM, text only (Gemma3TextConfig)
    OLMO2 = "olmo2"
    PHI3 = "phi3"  # Phi-3, Phi-3.5-mini, Phi-4-mini
    QWEN3_MOE = "qwen3_moe"  # Qwen3-30B-A3B, Qwen3-235B-A22B


_ARCHITECTURES = {
    "LlamaForCausalLM": Architecture.LLAMA,
    "Qwen2ForCausalLM": Architecture.QWEN2,
    "Qwen3ForCausalLM": Architecture.QWEN3,
    "MistralForCausalLM": Architecture.MISTRAL,
    "Gemma2ForCausalLM": Architecture.GEMMA2,
    "Gemma3ForCausalLM": Architecture.GEMMA3,
    "Olmo2ForCausalLM": Architecture.OLMO2,
    "Phi3ForCausalLM": Architecture.PHI3,
    "Qwen3MoeForCausalLM": Architecture.QWEN3_MOE,
}


class UnsupportedArchitecture(ValueError):
    """A checkpoint of no native family (``model_impl='auto'`` then takes the transformers
    adapter, :mod:`specdec.models.hf_adapter`)."""


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a transformers config."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies (scaling already applied)
    rope_attention_scaling: float
    eos_token_ids: tuple[int, ...]
    # The MLP's activation, a key of transformers' ACT2FN; only SiLU takes the CPU kernels'
    # fused paths (see _fused_ops).
    hidden_act: str = "silu"
    # Qwen3's per-head RMSNorm of queries and keys (``self_attn.q_norm``/``k_norm``, weights of
    # ``head_dim``), applied before RoPE (the whole-stack kernel applies them too, _decoder_stack).
    # Gemma 3's too (Gemma's RMSNorm).
    qk_norm: bool = False
    # Gemma 2 / Gemma 3: what their decoder does differently (sandwich norms, per-layer windows,
    # soft caps, ...: see specdec.models.gemma); None for the other families.
    gemma: gemma.GemmaTraits | None = None
    # OLMo 2's decoder layer (see specdec.models.olmo2): norms after the attention and the MLP
    # only, q/k normed over whole projections, float32 norms and RoPE; False for the others.
    olmo2: bool = False
    # Phi-3 / Phi-4-mini: partial RoPE (q/k channels reordered at load) and the field bounding
    # the context (see specdec.models.phi3); None for the other families.
    phi3: phi3.Phi3Traits | None = None
    # Qwen3-MoE: the experts of its sparse layers and which layers those are (see
    # specdec.models.qwen3_moe); None for the dense families.
    moe: qwen3_moe.MoeTraits | None = None

    @classmethod
    def from_hf_config(cls, hf_config: object) -> ModelConfig:
        """Read a transformers ``PretrainedConfig``. Unsupported architectures, and config
        fields this decoder cannot honour (:mod:`specdec.models.config_checks`), raise
        ValueError naming them."""
        archs = tuple(getattr(hf_config, "architectures", None) or ())
        model_type = getattr(hf_config, "model_type", None)
        arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
        if arch is None and model_type in {a.value for a in Architecture}:
            arch = Architecture(model_type)
        if arch is None:
            supported = ", ".join(sorted(_ARCHITECTURES))
            raise UnsupportedArchitecture(
                f"unsupported architecture {archs or model_type!r}: specdec's native families are "
                f"{supported}; any other transformers causal LM runs on the transformers adapter "
                "(model_impl='transformers' or 'auto', docs/models.md)"
            )
        config_checks.check_quantization_config(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        qkv_bias, o_bias, mlp_bias = config_checks.linear_biases(hf_config, arch.value)
        phi = phi3.read_traits(hf_config, head_dim) if arch is Architecture.PHI3 else None
        moe = qwen3_moe.read_traits(hf_config) if arch is Architecture.QWEN3_MOE else None
        if arch.value in gemma.FAMILIES:  # windows per layer; RoPE of the global layers
            traits, window = gemma.read_traits(hf_config, arch.value, head_dim), None
            hidden_act = config_checks.check_activation(hf_config, "hidden_activation")
            inv_freq, attention_scaling = gemma.layer_rope(hf_config, head_dim, "full_attention")
        elif phi is not None:  # partial RoPE, longrope's short factors; one window on every layer
            traits, window = None, phi3.sliding_window(hf_config)
            hidden_act = config_checks.check_activation(hf_config)
            inv_freq, attention_scaling = phi3.rope_parameters(hf_config, head_dim)
        else:
            traits, window = None, config_checks.uniform_window(hf_config, arch.value)
            hidden_act = config_checks.check_activation(hf_config)
            inv_freq, attention_scaling = config_checks.rope_parameters(hf_config, head_dim)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
            or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings
            if phi is None
            else phi3.usable_context(hf_config),
            sliding_window=window,
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            eos_token_ids=eos_ids,
            hidden_act=hidden_act,
            qk_norm=arch in (Architecture.QWEN3, Architecture.GEMMA3, Architecture.QWEN3_MOE),
            gemma=traits,
            olmo2=arch is Architecture.OLMO2,
            phi3=phi,
            moe=moe,
        )

    @property
    def context_field(self) -> str:
        """The config field that bounds ``max_position_embeddings`` (for length errors): Phi-3's
        longrope models run at most ``original_max_position_embeddings`` tokens."""
        return "max_position_embeddings" if self.phi3 is None else self.phi3.context_field

    def kv_spec(self, name: str, dtype: torch.dtype) -> KVSpec:
        return KVSpec(
            name=name,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
        )

    @property
    def attention_spec(self) -> AttentionSpec:
        """What the attention backend plans for (Gemma: a window per layer, its scale and its
        score cap)."""
        g = self.gemma
        return AttentionSpec(
            num_qo_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            sm_scale=self.head_dim**-0.5 if g is None else g.sm_scale,
            sliding_window=self.sliding_window,
            layer_windows=() if g is None else g.layer_windows,
            logits_soft_cap=None if g is None else g.attn_logit_softcap,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as transformers does, cast back to ``x.dtype``."""
    xf = x.float() if x.dtype != torch.float64 else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]
) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face Llama convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(
    positions: torch.Tensor,  # [num_tokens] int64
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
    scale: float | torch.Tensor,  # the RoPE variant's attention scaling (1.0 for plain RoPE),
    # or one per frequency [head_dim // 2] float32 (Phi-3's partial RoPE: 1 on the passed pairs)
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim] in dtype
    """RoPE's cos/sin tables, computed in float32 (as transformers does) and cast to ``dtype``."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float()  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if isinstance(scale, torch.Tensor):
        scale = torch.cat((scale, scale))
    return (emb.cos() * scale).to(dtype).unsqueeze(-2), (emb.sin() * scale).to(dtype).unsqueeze(-2)


def _fused_ops(embeds: torch.Tensor) -> object | None:
    """The CPU kernel module when its fused bf16 layer ops apply to this forward, else None."""
    if embeds.dtype != torch.bfloat16 or embeds.device.type != "cpu" or embeds.dim() != 2:
        return None
    from specdec.kernels.cpu_linear import load_kernel

    return load_kernel()


def _decoder_stack(model: LlamaModel, ops: object | None, kv, backend, plan) -> object | None:
    """The layers' :class:`~specdec.models.cpu_decoder.StackArguments` when this forward can run
    every layer in one kernel call (the fused bf16 path, the CPU attention kernel, kernel-shaped
    linears; Qwen3's q/k norms and Qwen3-MoE's sparse MLPs included), else None. The arguments
    are kept on the model between forwards (a cache of what its layers hold, checked against
    them at every forward)."""
    if ops is None:
        return None
    from specdec.models import cpu_decoder

    if not cpu_decoder.applies(kv, backend, plan):
        return None
    args = cpu_decoder.stack_arguments(model.layers, ops, model.__dict__.get("_decoder_stack"))
    model.__dict__["_decoder_stack"] = args
    return args if args.fits else None


def _norm_qk(
    ops,
    qkv: torch.Tensor,  # [num_tokens, (Hq + 2 Hkv) * D] bf16
    attn: Attention,
) -> torch.Tensor:  # [num_tokens, (Hq + 2 Hkv) * D] bf16
    """``qkv`` with Qwen3's per-head RMSNorm applied to q and k (v as it was), each head a row
    of the kernel's ``add_rms_norm`` (the arithmetic of :func:`rms_norm`), so that ``rope_qk``
    then rotates the normed heads, as transformers does."""
    n, d = qkv.shape[0], attn.head_dim
    q, k, v = qkv.split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = ops.add_rms_norm(q.reshape(-1, d).contiguous(), None, attn.q_norm.weight, attn.q_norm.eps)
    k = ops.add_rms_norm(k.reshape(-1, d).contiguous(), None, attn.k_norm.weight, attn.k_norm.eps)
    return torch.cat((q[1].view(n, -1), k[1].view(n, -1), v), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _norm(cfg: ModelConfig, size: int) -> nn.Module:
    """The family's RMSNorm over ``size`` channels: Gemma's ``1 + weight`` one, OLMo 2's
    (float32 product), or Llama's."""
    if cfg.olmo2:
        return olmo2.Olmo2RMSNorm(size, cfg.rms_norm_eps)
    return RMSNorm(size, cfg.rms_norm_eps) if cfg.gemma is None else gemma.GemmaRMSNorm(size, cfg.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim]
        sin: torch.Tensor,
        layer_kv: tuple[torch.Tensor, torch.Tensor],  # k, v pages [num_pages, page_size, Hkv, D]
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3, Gemma 3: over each head's channels, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = backend.run(plan, q, k, v, layer_kv[0], layer_kv[1])
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_fn = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.silu`` for SiLU; else transformers' own ``ACT2FN[name]`` (checked parameter-free by
    :func:`~specdec.models.config_checks.check_activation`), the very function it applies."""
    if name in config_checks.SILU_NAMES:
        return F.silu
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _decoder_layer(cfg: ModelConfig, index: int) -> nn.Module:
    """Decoder layer ``index`` of the family: Gemma's sandwich-normed layer, OLMo 2's post-normed
    one, or Llama's (Qwen3-MoE's sparse layers: with the experts as their MLP)."""
    if cfg.olmo2:
        return olmo2.Olmo2DecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, olmo2.Olmo2Attention(cfg), MLP(cfg))
    if cfg.moe is not None and cfg.moe.is_sparse(index):
        experts = qwen3_moe.SparseMoeBlock(cfg.hidden_size, cfg.moe, _activation(cfg.hidden_act))
        return DecoderLayer(cfg, experts)
    if cfg.gemma is None:
        return DecoderLayer(cfg)
    return gemma.GemmaDecoderLayer(cfg.hidden_size, cfg.rms_norm_eps, Attention(cfg), MLP(cfg))


class DecoderLayer(nn.Module):
    """Llama's layer; ``mlp``: another MLP module in place of Llama's (Qwen3-MoE's experts)."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg) if mlp is None else mlp

    def forward(self, h, cos, sin, layer_kv, backend, plan):  # shapes as Attention.forward
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer_kv, backend, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """A Llama-family causal LM over paged KV.

    Example:
        >>> out = model(layout, kv, backend, backend.plan(layout, model.config.attention_spec),
        ...             logits_indices=layout.last_row_indices)
        >>> out.logits.shape  # [batch, vocab]
    """

    def __init__(self, cfg: ModelConfig, *, layer_config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        # The decoder layers' own shape: ``cfg`` itself, or under tensor parallelism one rank's
        # share of the heads and of the MLP width (see specdec.distributed.sharding).
        self.layer_config = layer_config or cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_decoder_layer(self.layer_config, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", torch.zeros(0), persistent=False)
        self.register_buffer("sliding_inv_freq", torch.zeros(0), persistent=False)  # Gemma 3
        self.register_buffer("rope_pair_scaling", torch.zeros(0), persistent=False)  # Phi-3
        self.init_rope()

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE frequency buffers from the config, on ``device`` (default: the
        CPU): loaders build the model on the meta device, where buffers hold no values."""
        cfg = self.config
        self.inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=device)
        sliding = () if cfg.gemma is None else cfg.gemma.sliding_inv_freq or ()
        self.sliding_inv_freq = torch.tensor(sliding, dtype=torch.float32, device=device)
        self.rope_pair_scaling = phi3.pair_scaling(cfg, device)  # [head_dim // 2] or empty

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def attention_spec(self) -> AttentionSpec:
        """What the attention backend plans for: the heads this model's layers hold."""
        return self.layer_config.attention_spec

    def kv_spec(self, name: str) -> KVSpec:
        """The KV pool shape of this model's layers (its share of the KV heads)."""
        return self.layer_config.kv_spec(name, self.dtype)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[num_tokens, 1, head_dim]`` in ``dtype`` (default: the model's), computed
        in float32."""
        pairs = self.rope_pair_scaling  # Phi-3's partial RoPE under longrope: not one number
        scale = pairs if pairs.numel() else self.config.rope_attention_scaling
        return rope_tables(positions, self.inv_freq, scale, dtype or self.dtype)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin (:meth:`rope`): Gemma 3's sliding layers have a RoPE of their
        own; OLMo 2's are float32 (float64 kept), as transformers' are; the tables are computed
        once per distinct RoPE."""
        dtype = torch.promote_types(self.dtype, torch.float32) if self.config.olmo2 else None
        tables = self.rope(positions, dtype)
        g = self.config.gemma
        if g is None or g.sliding_inv_freq is None:
            return [tables] * self.config.num_layers
        sliding = rope_tables(positions, self.sliding_inv_freq, g.sliding_rope_attention_scaling, self.dtype)
        return [sliding if s else tables for s in g.sliding_layers]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        """The input embeddings of ``token_ids`` (Gemma: times ``sqrt(hidden_size)``)."""
        embeds = self.embed_tokens(token_ids)
        g = self.config.gemma
        return embeds if g is None else gemma.scale_embeddings(embeds, g.embed_scale)

    def hidden_states(self, embeds, positions, kv, backend, plan) -> torch.Tensor:
        """The last layer's output before the final norm, ``[num_tokens, hidden]``: one of
        :meth:`layer_states` (the same arguments, without ``layers``)."""
        return self.layer_states(embeds, positions, kv, backend, plan, (self.config.num_layers,))[0]

    def layer_states(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        kv: ModelKV,
        backend: AttentionBackend,
        plan: object,
        layers: tuple[int, ...],
    ) -> list[torch.Tensor]:  # len(layers) x [num_tokens, hidden]
        """The residual stream entering each of ``layers`` (``i == num_layers``: the last
        layer's output before the final norm), in the given order; repeats allowed.

        Example:
            >>> first, last = model.layer_states(embeds, positions, kv, backend, plan, (0, 2))
        """
        n = self.config.num_layers
        bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= n]
        if not layers or bad:
            raise ValueError(f"layers must be a non-empty tuple of ints in 0..{n}, got {layers!r}")
        # The fused ops compute SiLU-and-multiply (silu_mul, and inside the whole-stack
        # kernel) and Llama's layer: a model of another activation, or Gemma's or OLMo 2's
        # layers, runs its layers' own modules.
        lc = self.layer_config
        if lc.gemma is not None and lc.hidden_act == gemma.GELU_TANH:
            ops = _fused_ops(embeds)  # Gemma's own fused path: its norms and gelu
            if ops is not None and hasattr(ops, "add_rms_norm_f32w"):
                ropes = self.layer_ropes(positions)
                stacked = gemma.stack_layer_states(self.layers, ropes, ops, embeds, kv, backend, plan, layers)
                if stacked is not None:  # every layer in one kernel call, bitwise the loop below
                    return stacked
                states = gemma.fused_layer_states(self.layers, ropes, ops, embeds, kv, backend, plan, set(layers))
                return [states[i] for i in layers]
        if lc.olmo2 and lc.hidden_act in config_checks.SILU_NAMES:
            ops = _fused_ops(embeds)  # OLMo 2's own fused path: its norms
            if ops is not None and hasattr(ops, "add_rms_norm_f32w"):
                cos, sin = self.layer_ropes(positions)[0]  # float32 tables, every layer
                states = olmo2.fused_layer_states(self.layers, cos, sin, ops, embeds, kv, backend, plan, set(layers))
                return [states[i] for i in layers]
        fusable = lc.hidden_act in config_checks.SILU_NAMES and lc.gemma is None and not lc.olmo2
        ops = _fused_ops(embeds) if fusable else None
        if ops is None:
            wanted, h, states = set(layers), embeds, {}
            for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self.layer_ropes(positions))):
                if i in wanted:
                    states[i] = h
                h = layer(h, cos, sin, kv.layer(i), backend, layer_plan(plan, i))
            states[n] = h
            return [states[i] for i in layers]
        cos, sin = self.rope(positions)
        stack = _decoder_stack(self, ops, kv, backend, plan)
        if stack is not None:  # every layer in one kernel call, bitwise the loops below
            from specdec.models.cpu_decoder import run_stack

            return run_stack(ops, self, stack, embeds, cos, sin, kv, plan, layers)
        states = self._fused_layer_states(ops, embeds, cos, sin, kv, backend, plan, set(layers))
        return [states[i] for i in layers]

    def _fused_layer_states(self, ops, h, cos, sin, kv, backend, plan, wanted) -> dict[int, torch.Tensor]:
        """:meth:`layer_states` for bf16 on CPUs with the kernel's fused small ops (see
        ``kernels/cpu_layer_ops.cpp``): one call each for residual add + RMSNorm, RoPE of q
        and k (after Qwen3's q/k norm, :func:`_norm_qk`), and SiLU-and-multiply (Qwen3-MoE's
        sparse layers: their experts' module), where the plain path takes ~55 tensor ops a
        layer. The residual of each sub-block is added by the
        next norm (``delta``), so the input of layer ``i`` exists only after its first norm;
        ``add_rms_norm`` returns a new tensor there, never overwritten later, so keeping it
        costs nothing."""
        n = h.shape[0]
        cos, sin = cos.view(n, -1), sin.view(n, -1)  # [num_tokens, head_dim]
        delta = None  # [num_tokens, hidden] still to be added to h
        states: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            h, x = ops.add_rms_norm(h, delta, norm1.weight, norm1.eps)
            if i in wanted:
                states[i] = h
            qkv = attn.qkv_proj(x)  # [num_tokens, (Hq + 2 Hkv) * D]
            if attn.q_norm is not None:
                qkv = _norm_qk(ops, qkv, attn)
            q, k = ops.rope_qk(qkv, cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            v = qkv[:, attn.q_size + attn.kv_size :].view(n, attn.num_kv_heads, attn.head_dim)
            out = backend.run(layer_plan(plan, i), q, k, v, *kv.layer(i))  # [num_tokens, Hq, D]
            h, x = ops.add_rms_norm(h, attn.o_proj(out.reshape(n, attn.q_size)), norm2.weight, norm2.eps)
            if isinstance(mlp, qwen3_moe.SparseMoeBlock):  # the experts, their SiLU fused too
                delta = mlp(x, ops)
            else:
                delta = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))
        states[len(self.layers)] = h if delta is None else h + delta
        return states

    def logits(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Final norm and LM head: ``[rows, hidden] -> [rows, vocab]`` float32 (float64 kept),
        Gemma's soft cap applied there. ``head`` replaces ``lm_head`` (a draft vocabulary,
        :mod:`specdec.models.sub_vocab`: its module gives full rows, its ``sub_logits`` the
        vocabulary's columns only)."""
        out = (self.lm_head if head is None else head)(self.norm(hidden))
        out = out if out.dtype == torch.float64 else out.float()
        cap = None if self.config.gemma is None else self.config.gemma.final_logit_softcap
        return out if cap is None else gemma.soft_cap(out, cap)

    @torch.inference_mode()
    def forward(
        self,
        layout: BatchLayout,
        kv: ModelKV,
        backend: AttentionBackend,
        plan: object,
        *,
        logits_indices: torch.Tensor | None = None,  # [rows] int64; None = every row
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run the batch; logits only for ``logits_indices`` (prefill needs the last rows only).

        ``hidden_layers`` asks for ``hidden_states`` ``[num_tokens, len(hidden_layers) * hidden]``:
        the inputs of those decoder layers concatenated in the given order, ``num_layers``
        meaning the last layer's output before the final norm (what ``return_hidden=True``
        returns, i.e. ``hidden_layers=(num_layers,)``). EAGLE heads feed on these. ``head``
        replaces the LM head (see :meth:`logits`).

        Example:
            >>> out = model(layout, kv, backend, plan, hidden_layers=(2, 16, 29))
            >>> out.hidden_states.shape  # [num_tokens, 3 * hidden]
        """
        if return_hidden and hidden_layers is not None:
            raise ValueError("pass return_hidden=True or hidden_layers, not both")
        last = self.config.num_layers
        wanted = (last,) if return_hidden else tuple(hidden_layers or ())
        if hidden_layers is not None and not wanted:
            raise ValueError(f"hidden_layers must name at least one layer in 0..{last}, got {hidden_layers!r}")
        embeds = self.embed(layout.token_ids)
        *captured, h = self.layer_states(embeds, layout.positions, kv, backend, plan, (*wanted, last))
        rows = h if logits_indices is None else h.index_select(0, logits_indices)
        hidden = None
        if captured:
            hidden = captured[0] if len(captured) == 1 else torch.cat(captured, dim=-1)
        return ModelOutput(logits=self.logits(rows, head), hidden_states=hidden)
