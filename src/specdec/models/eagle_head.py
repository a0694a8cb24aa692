"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) on a Llama-family target: the network (used by the
:class:`~specdec.proposers.EAGLETree` proposer; its files: :mod:`specdec.models.eagle_checkpoints`).

An EAGLE head is one decoder layer that extrapolates the target's features one token ahead.
Row ``p`` of a sequence pairs the feature ``f_p`` of target position ``p`` with the token
``t_{p+1}`` that followed it, at RoPE position ``p``, and yields ``g_p``: logits for ``t_{p+2}``
and, while drafting, the next row's feature (``f_{p+1} := g_p``, paired with the drafted token)::

    EAGLE-1/2  f = norm_target(h_N)                                   # post-final-norm
               x = fc([embed(t) ; f])                                 # fc: [H, 2H] (+ bias)
               g = x + Attn(x) ; g = g + MLP(post_norm(g))            # no input norm on x
               logits = lm_head_target(g)                             # no norm before it
    EAGLE-3    f = fc([h_a ; h_b ; h_c])                              # fc: [H, 3H], no bias
               a = [input_norm(embed(t)) ; hidden_norm(f)]            # [2H]: q/k/v take 2H
               g = f + Attn(a) ; g = g + MLP(post_norm(g))
               logits = lm_head(norm(g))  over the draft vocab, id d -> d + d2t[d]

``h_i`` is the residual stream entering target layer ``i`` (:meth:`LlamaModel.forward` with
``hidden_layers``; ``i = N`` is the last layer's output before the final norm).

What the reference does (github.com/SafeAILab/EAGLE at cb7e084, ``eagle/model/``):

- EAGLE-1/2 feature: ``outputs[0]`` of the base ``LlamaModel`` (``ea_model.py:183-191``), which
  is *after* the final norm (``modeling_llama_kv.py:1179``); logits are ``head(out_hidden)``
  with ``head = base_model.lm_head`` and no norm (``cnets1.py:702,732``; ``utils.py:253``).
- EAGLE-1/2 ``fc`` takes ``cat((inputs_embeds, hidden_states))``, embedding first
  (``cnets1.py:622-623``), bias on unless config.json says ``"bias": false``
  (``cnets1.py:524``, ``ea_model.py:51-54``); layer 0 has no ``input_layernorm``
  (``cnets1.py:399-400,428-429``); q/k/v bias from ``config.qkv_bias`` (``cnets1.py:209-216``);
  ``head_dim = hidden_size // num_attention_heads`` (``cnets1.py:199``).
- EAGLE-3 features: the inputs of target layers ``idx == 2 or N // 2 or N - 3``, in layer
  order, before any norm (``modeling_llama_kv.py:1137-1139``), concatenated
  (``utils.py:252,328``). The ``or`` collapses repeats: fc needs 3, so N = 3 or N >= 7.
- EAGLE-3 ``fc`` has no bias (``cnets.py:532-534``) and runs only on 3H-wide input, i.e. on
  target features, never on the head's own output (``cnets.py:639-640``). The residual is the
  un-normed feature (``cnets.py:425``); ``hidden_norm`` on it, ``input_layernorm`` on the
  embedding, embedding first (``cnets.py:427-430``); q/k/v over 2H (``cnets.py:209-211``).
  Logits ``lm_head(norm(g))`` (``cnets.py:700,734``), token ``d + d2t[d]`` (``cnets.py:712,754``).
  With ``draft_vocab_size == vocab_size`` d2t/t2d are dropped (``ea_model.py:74-75``).
- Both feed ``out_hidden`` (before any norm) back as the next feature (``cnets.py:714,747``;
  ``cnets1.py:712,745``) and pair features with the next token (``input_ids[:, 1:]``,
  ``cnets.py:683``); tree drafts share one position per depth (``cnets.py:721``).
- The head's RoPE comes from *its own* config.json (``rope_theta``, default 10000; linear or
  dynamic ``rope_scaling``; ``cnets.py:215-236``), which may differ from the target's.

Differences, on purpose: a checkpoint's ``embed_tokens.weight`` is only shape-checked and the
target's embedding is used (the reference lets the file's copy win via ``strict=False``,
``ea_model.py:76``; public heads store the target's); ``dynamic`` RoPE scaling is applied as
unscaled (the reference rescales only past ``max_position_embeddings``); ``target_layers`` may be
any layers (for targets under 7 layers, or heads trained on other layers).
"""

from __future__ import annotations

import enum

import attrs
import torch
from torch import nn

from specdec.config import boolean, layer_indices, positive_float, positive_int, sequence_to_tuple
from specdec.interfaces import AttentionBackend
from specdec.kv.paged import ModelKV
from specdec.models.head_io import check_format, check_target_fingerprint, target_fingerprint
from specdec.models.head_module import HeadModule, dense_block
from specdec.models.llama import MLP, Attention, LlamaModel, ModelConfig, RMSNorm, rope_tables

__all__ = [
    "FORMAT",
    "TARGET_FIELDS",
    "EagleKind",
    "EagleHeadConfig",
    "EagleHeadModel",
    "default_target_layers",
]

FORMAT = "specdec-eagle-head"  # config.json's "format" in specdec's own head files
_VERSION = 1
TARGET_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers")  # the fingerprint


class EagleKind(enum.Enum):
    EAGLE1 = "eagle1"  # EAGLE-1 and EAGLE-2 (same head, EAGLE-2 only drafts dynamic trees)
    EAGLE3 = "eagle3"


def default_target_layers(kind: EagleKind, num_layers: int) -> tuple[int, ...]:
    """The target layers the reference feeds a head (see the module docstring).

    >>> default_target_layers(EagleKind.EAGLE3, 32)
    (2, 16, 29)
    """
    if kind is EagleKind.EAGLE1:
        return (num_layers,)
    # The reference appends layer idx's input when idx == 2 or N // 2 or N - 3, in layer order.
    layers = tuple(sorted({2, num_layers // 2, num_layers - 3} & set(range(num_layers))))
    if len(layers) != 3:
        raise ValueError(
            f"EAGLE-3's default layers (2, N // 2, N - 3) are not 3 distinct layers of a "
            f"{num_layers}-layer target (N = 3 or N >= 7 needed): pass target_layers"
        )
    return layers


def _float_tuple(value: object) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


@attrs.frozen(kw_only=True)
class EagleHeadConfig:
    """What a head file records besides its weights: its kind, the target layers it feeds on,
    its layer's shape and RoPE, and the target it fits (``target``: architecture, vocab size,
    hidden size, layer count).

    ``fc_bias`` (EAGLE-1 only) and ``input_norm`` (EAGLE-1 only: apply ``input_layernorm`` to
    the ``fc`` output, which the reference skips) reproduce the variants of the reference.

    Example:
        >>> cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=(0, 1, 2))
    """

    kind: EagleKind = attrs.field(validator=attrs.validators.instance_of(EagleKind))
    target_layers: tuple[int, ...] = attrs.field(converter=sequence_to_tuple, validator=layer_indices)
    draft_vocab_size: int = attrs.field(validator=positive_int)
    fc_bias: bool = attrs.field(validator=boolean)
    input_norm: bool = attrs.field(default=False, validator=boolean)
    qkv_bias: bool = attrs.field(default=False, validator=boolean)
    intermediate_size: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    rms_norm_eps: float = attrs.field(converter=float, validator=positive_float)
    inv_freq: tuple[float, ...] = attrs.field(converter=_float_tuple)  # [head_dim // 2]
    rope_attention_scaling: float = attrs.field(default=1.0, converter=float, validator=positive_float)
    target: dict[str, object] = attrs.field(converter=dict)

    def __attrs_post_init__(self) -> None:
        n, vocab = self.target.get("num_layers"), self.target.get("vocab_size")
        if not isinstance(n, int) or not isinstance(vocab, int):
            raise ValueError(f"target must hold the fields {TARGET_FIELDS}, got {self.target!r}")
        layers = self.target_layers
        if max(layers) > n:
            raise ValueError(f"target_layers must be ints in 0..{n}, got {layers!r}")
        if self.kind is EagleKind.EAGLE1:
            if layers != (n,) or self.draft_vocab_size != vocab:
                raise ValueError(
                    f"an EAGLE-1 head feeds on target_layers ({n},) over the whole vocabulary "
                    f"({vocab}), got {layers} and {self.draft_vocab_size}"
                )
        elif self.fc_bias or self.input_norm or self.qkv_bias or self.draft_vocab_size > vocab:
            raise ValueError(
                f"an EAGLE-3 head has no fc_bias, input_norm or qkv_bias and draft_vocab_size <= "
                f"{vocab}, got {self.fc_bias}, {self.input_norm}, {self.qkv_bias}, {self.draft_vocab_size}"
            )
        if self.num_heads % self.num_kv_heads or len(self.inv_freq) != self.head_dim // 2:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                f"and inv_freq must hold head_dim // 2 = {self.head_dim // 2} values, got {len(self.inv_freq)}"
            )

    @classmethod
    def for_target(
        cls,
        cfg: ModelConfig,
        kind: EagleKind,
        *,
        target_layers: tuple[int, ...] | None = None,
        draft_vocab_size: int | None = None,
        fc_bias: bool | None = None,
        input_norm: bool = False,
    ) -> EagleHeadConfig:
        """A new head shaped like one target layer, with the target's RoPE. Defaults: the
        reference's layers, the whole vocabulary, ``fc_bias`` on for EAGLE-1 only."""
        return cls(
            kind=kind,
            target_layers=default_target_layers(kind, cfg.num_layers)
            if target_layers is None
            else target_layers,
            draft_vocab_size=cfg.vocab_size if draft_vocab_size is None else draft_vocab_size,
            fc_bias=kind is EagleKind.EAGLE1 if fc_bias is None else fc_bias,
            input_norm=input_norm,
            qkv_bias=kind is EagleKind.EAGLE1 and cfg.qkv_bias,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            inv_freq=cfg.inv_freq,
            rope_attention_scaling=cfg.rope_attention_scaling,
            target=target_fingerprint(cfg, TARGET_FIELDS),
        )

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError if ``cfg`` is not the kind of target this head was built for."""
        check_target_fingerprint(self.target, cfg, TARGET_FIELDS, "EAGLE head")

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The :class:`ModelConfig` of the head's one decoder layer on ``target``."""
        return attrs.evolve(
            target,
            num_layers=1,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            qkv_bias=self.qkv_bias,
            o_bias=False,
            mlp_bias=False,
            sliding_window=None,
            inv_freq=self.inv_freq,
            rope_attention_scaling=self.rope_attention_scaling,
            # EAGLE heads are Llama layers whatever the target (public EAGLE-3 heads for Qwen3
            # have no q/k norms): the target's architecture-specific fields do not carry over
            # (Gemma's: norms, windows per layer, attention scale and soft caps; OLMo 2's layer).
            qk_norm=False,
            hidden_act="silu",
            gemma=None,
            olmo2=False,
            phi3=None,
            moe=None,  # a dense MLP of intermediate_size on a Qwen3-MoE target too
        )

    def to_json(self) -> dict[str, object]:
        data = attrs.asdict(self, recurse=False)
        data.update(
            kind=self.kind.value,
            target_layers=list(self.target_layers),
            inv_freq=list(self.inv_freq),
        )
        return {"format": FORMAT, "version": _VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> EagleHeadConfig:
        check_format(data, FORMAT, _VERSION, "EAGLE head")
        fields = {a.name for a in attrs.fields(cls)}
        return cls(
            **{k: v for k, v in data.items() if k in fields} | {"kind": EagleKind(data["kind"])}
        )


class EagleLayer(nn.Module):
    """The head's decoder layer: attention over ``attn_in`` (H wide for EAGLE-1, [embedding ;
    feature] 2H wide for EAGLE-3) added to ``residual``, then the MLP block."""

    def __init__(self, cfg: ModelConfig, config: EagleHeadConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.self_attn = Attention(cfg)
        if config.kind is EagleKind.EAGLE3:
            width = self.self_attn.q_size + 2 * self.self_attn.kv_size
            self.self_attn.qkv_proj = nn.Linear(2 * hidden, width, bias=False)
            self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        if config.kind is EagleKind.EAGLE3 or config.input_norm:
            self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, attn_in, residual, cos, sin, layer_kv, backend, plan):  # as Attention.forward
        h = residual + self.self_attn(attn_in, cos, sin, layer_kv, backend, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHeadModel(HeadModule):
    """An EAGLE head's own weights plus the target's borrowed (unregistered) embedding, and for
    EAGLE-1 its final norm and LM head.

    Example:
        >>> out = target(layout, kv, backend, plan, hidden_layers=head.config.target_layers)
        >>> f = head.target_feature(out.hidden_states)                    # [rows, hidden]
        >>> g = head(f, next_tokens, positions, head_kv, backend, head_plan)  # [rows, hidden]
        >>> head.logits(g)                                                 # [rows, vocab]
    """

    kv_name = "eagle"

    def __init__(self, target: LlamaModel, config: EagleHeadConfig) -> None:
        cfg = target.config
        super().__init__(target, config, config.layer_config(cfg))
        hidden, eagle3 = cfg.hidden_size, config.kind is EagleKind.EAGLE3
        fc_in = len(config.target_layers) * hidden if eagle3 else 2 * hidden
        self.fc = nn.Linear(fc_in, hidden, bias=config.fc_bias)
        self.layer = EagleLayer(self.layer_config, config)
        if eagle3:
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_buffer(
                "d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64)
            )  # [draft_vocab]
        self.register_buffer(
            "inv_freq", torch.tensor(config.inv_freq, dtype=torch.float32), persistent=False
        )

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``[draft_vocab] int64``: the target token id of each draft-vocabulary id."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.device)
        return ids + self.d2t if self.config.kind is EagleKind.EAGLE3 else ids

    # ------------------------------------------------------------------ math
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[rows, 1, head_dim]`` of the head's own RoPE, in the head's dtype."""
        return rope_tables(positions, self.inv_freq, self.config.rope_attention_scaling, self.dtype)

    def target_feature(
        self,
        target_hidden: torch.Tensor,  # [..., len(target_layers) * hidden] as the target returns them
    ) -> torch.Tensor:  # [..., hidden]
        """The feature of rows that follow committed tokens (EAGLE-1: the target's final norm;
        EAGLE-3: ``fc``)."""
        width = len(self.config.target_layers) * self.target_config.hidden_size
        if target_hidden.shape[-1] != width:
            raise ValueError(
                f"target_hidden must be [..., {width}], got {tuple(target_hidden.shape)}"
            )
        if self.config.kind is EagleKind.EAGLE1:
            return self.target.norm(target_hidden.to(self.target.dtype)).to(self.dtype)
        return self.fc(target_hidden.to(self.dtype))

    def layer_input(
        self,
        feature: torch.Tensor,  # [..., hidden]
        tokens: torch.Tensor,  # [...] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # attention input [..., H or 2H], residual [..., H]
        emb = self.target.embed_tokens(tokens).to(self.dtype)
        feature = feature.to(self.dtype)
        layer = self.layer
        if self.config.kind is EagleKind.EAGLE3:
            return torch.cat(
                (layer.input_layernorm(emb), layer.hidden_norm(feature)), dim=-1
            ), feature
        x = self.fc(torch.cat((emb, feature), dim=-1))
        return (layer.input_layernorm(x) if self.config.input_norm else x), x

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden] -> [rows, draft vocab]`` float32 (float64 kept): column ``j`` is
        target token ``draft_to_target[j]``. Drafting ranks these; spreading them over the whole
        target vocabulary (:meth:`logits`) would make every top-k and softmax ~19x wider on a
        Qwen target with an 8k draft vocabulary."""
        if self.config.kind is EagleKind.EAGLE1:
            out = self.target.lm_head(g.to(self.target.dtype))
        else:
            out = self.lm_head(self.norm(g))
        return out if out.dtype == torch.float64 else out.float()

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden] -> [rows, target vocab]`` float32 (float64 kept); EAGLE-3 gives
        ``-inf`` to target tokens outside its draft vocabulary."""
        out = self.draft_logits(g)
        vocab = self.target_config.vocab_size
        if self.config.draft_vocab_size != vocab:
            full = out.new_full((out.shape[0], vocab), float("-inf"))
            out = full.index_copy_(1, self.draft_to_target, out)
        return out

    @torch.inference_mode()
    def forward(
        self,
        feature: torch.Tensor,  # [rows, hidden] target feature, or the head's previous output
        tokens: torch.Tensor,  # [rows] int64, the token following each row's feature
        positions: torch.Tensor,  # [rows] int64, RoPE positions
        kv: ModelKV,
        backend: AttentionBackend,
        plan: object,  # planned with self.attention_spec
    ) -> torch.Tensor:  # [rows, hidden] g: fed back as a feature, and logits(g)
        """Paged forward: the rows' K/V are written at the layout's slots, then attended with the
        plan's mask (causal or tree)."""
        cos, sin = self.rope(positions)
        attn_in, residual = self.layer_input(feature, tokens)
        return self.layer(attn_in, residual, cos, sin, kv.layer(0), backend, plan)

    def forward_dense(
        self,
        feature: torch.Tensor,  # [batch, time, hidden]
        tokens: torch.Tensor,  # [batch, time] int64
    ) -> torch.Tensor:  # [batch, time, hidden]
        """Training forward with autograd: row ``b`` is one sequence's rows 0..time-1, causal
        attention within it, RoPE position = row index (as a paged prefill)."""
        attn_in, residual = self.layer_input(feature, tokens)
        cos, sin = self.rope(torch.arange(feature.shape[1], device=feature.device))  # [T, 1, D]
        return dense_block(self.layer, attn_in, residual, cos, sin)
