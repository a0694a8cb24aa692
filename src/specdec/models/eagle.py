"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) on a Llama-family target, and their checkpoints.

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
import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import boolean, positive_int
from specdec.interfaces import AttentionBackend, AttentionSpec
from specdec.kv.paged import KVSpec, ModelKV
from specdec.models.llama import MLP, Attention, LlamaModel, ModelConfig, RMSNorm, apply_rope

__all__ = [
    "EagleKind",
    "EagleHeadConfig",
    "EagleHeadModel",
    "default_target_layers",
    "load_eagle_head",
    "save_eagle_head",
]

_FORMAT = "specdec-eagle-head"
_VERSION = 1
_TARGET_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers")
_WEIGHTS, _CONFIG = "model.safetensors", "config.json"


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


def _int_tuple(value: object) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _float_tuple(value: object) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else value


def _positive_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a float > 0, got {value!r}")


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
    target_layers: tuple[int, ...] = attrs.field(converter=_int_tuple)
    draft_vocab_size: int = attrs.field(validator=positive_int)
    fc_bias: bool = attrs.field(validator=boolean)
    input_norm: bool = attrs.field(default=False, validator=boolean)
    qkv_bias: bool = attrs.field(default=False, validator=boolean)
    intermediate_size: int = attrs.field(validator=positive_int)
    num_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    rms_norm_eps: float = attrs.field(converter=float, validator=_positive_float)
    inv_freq: tuple[float, ...] = attrs.field(converter=_float_tuple)  # [head_dim // 2]
    rope_attention_scaling: float = attrs.field(
        default=1.0, converter=float, validator=_positive_float
    )
    target: dict[str, object] = attrs.field(converter=dict)

    def __attrs_post_init__(self) -> None:
        n, vocab = self.target.get("num_layers"), self.target.get("vocab_size")
        if not isinstance(n, int) or not isinstance(vocab, int):
            raise ValueError(f"target must hold the fields {_TARGET_FIELDS}, got {self.target!r}")
        layers = self.target_layers
        if (
            not isinstance(layers, tuple)
            or not layers
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= n for i in layers)
        ):
            raise ValueError(
                f"target_layers must be a non-empty tuple of ints in 0..{n}, got {layers!r}"
            )
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
            target=_target_fingerprint(cfg),
        )

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError if ``cfg`` is not the kind of target this head was built for."""
        mine, theirs = self.target, _target_fingerprint(cfg)
        diff = {k: (mine.get(k), v) for k, v in theirs.items() if mine.get(k) != v}
        if diff:
            detail = ", ".join(
                f"{k}: head {a!r} vs target {b!r}" for k, (a, b) in sorted(diff.items())
            )
            raise ValueError(f"EAGLE head does not fit this target ({detail})")

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
        )

    def to_json(self) -> dict[str, object]:
        data = attrs.asdict(self, recurse=False)
        data.update(
            kind=self.kind.value,
            target_layers=list(self.target_layers),
            inv_freq=list(self.inv_freq),
        )
        return {"format": _FORMAT, "version": _VERSION, **data}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> EagleHeadConfig:
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ValueError(
                f"not a specdec EAGLE head config (format {data.get('format')!r}, "
                f"version {data.get('version')!r}; expected {_FORMAT!r} version {_VERSION})"
            )
        fields = {a.name for a in attrs.fields(cls)}
        return cls(
            **{k: v for k, v in data.items() if k in fields} | {"kind": EagleKind(data["kind"])}
        )


def _target_fingerprint(cfg: ModelConfig) -> dict[str, object]:
    out = {name: getattr(cfg, name) for name in _TARGET_FIELDS}
    out["architecture"] = cfg.architecture.value
    return out


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


class EagleHeadModel(nn.Module):
    """An EAGLE head's own weights plus the target's borrowed (unregistered) embedding, and for
    EAGLE-1 its final norm and LM head.

    Example:
        >>> out = target(layout, kv, backend, plan, hidden_layers=head.config.target_layers)
        >>> f = head.target_feature(out.hidden_states)                    # [rows, hidden]
        >>> g = head(f, next_tokens, positions, head_kv, backend, head_plan)  # [rows, hidden]
        >>> head.logits(g)                                                 # [rows, vocab]
    """

    def __init__(self, target: LlamaModel, config: EagleHeadConfig) -> None:
        super().__init__()
        cfg = target.config
        config.check_target(cfg)
        self.config = config
        self.target_config = cfg
        self.layer_config = config.layer_config(cfg)
        self._target = (target,)  # a tuple, so the target's modules are not registered (or saved)
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
    def target(self) -> LlamaModel:
        return self._target[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.post_attention_layernorm.weight.device

    @property
    def attention_spec(self) -> AttentionSpec:
        """The attention shape to plan the head's forward with."""
        return self.layer_config.attention_spec

    def kv_spec(self, name: str = "eagle") -> KVSpec:
        return self.layer_config.kv_spec(name, self.dtype)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """``[draft_vocab] int64``: the target token id of each draft-vocabulary id."""
        ids = torch.arange(self.config.draft_vocab_size, device=self.device)
        return ids + self.d2t if self.config.kind is EagleKind.EAGLE3 else ids

    # ------------------------------------------------------------------ math
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[rows, 1, head_dim]`` of the head's own RoPE, in the head's dtype."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.config.rope_attention_scaling
        return (emb.cos() * scale).to(self.dtype).unsqueeze(-2), (emb.sin() * scale).to(
            self.dtype
        ).unsqueeze(-2)

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
        b, t, _ = feature.shape
        attn_in, residual = self.layer_input(feature, tokens)
        cos, sin = self.rope(torch.arange(t, device=feature.device))  # [T, 1, D]
        attn = self.layer.self_attn
        q, k, v = attn.qkv_proj(attn_in).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
        q = apply_rope(q.view(b, t, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rope(k.view(b, t, attn.num_kv_heads, attn.head_dim), cos, sin)
        v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
        rep = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=attn.head_dim**-0.5,
        )  # [B, heads, T, D]
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))


# ---------------------------------------------------------------------- files
def save_eagle_head(head: EagleHeadModel, directory: str | Path) -> Path:
    """Write ``model.safetensors`` (the head's own weights only) and ``config.json``."""
    from safetensors.torch import save_file

    from specdec.models.heads import _plain_state_dict

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in _plain_state_dict(head).items()}
    save_file(state, str(directory / _WEIGHTS), metadata={"format": _FORMAT})
    (directory / _CONFIG).write_text(json.dumps(head.config.to_json(), indent=2) + "\n")
    return directory


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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdec.models.packed import pack_linears, should_pack
    from specdec.models.quantized import check_quantization, quantize_linears

    check_quantization(quantization, target.device)
    directory = Path(directory)
    config_path, weights_path = directory / _CONFIG, directory / _WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"EAGLE head directory {str(directory)!r} must hold {_CONFIG} and {_WEIGHTS} "
                f"(safetensors only: pytorch_model.bin is never read); {str(path)!r} is missing"
            )
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read {str(config_path)!r}: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{str(config_path)!r} must hold a JSON object")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"corrupt head weights {str(weights_path)!r}: {err}") from err
    if raw.get("format") == _FORMAT:
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
    device, dtype = target.device, dtype or target.dtype
    state = {
        n: t.to(device=device, dtype=dtype if t.is_floating_point() else torch.int64)
        for n, t in state.items()
    }
    head.load_state_dict(state, assign=True)
    head.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
    head.eval().requires_grad_(False)
    if quantization is not None:  # from the plain weights: packing first would be undone
        quantize_linears(head, quantization)
    elif should_pack(head):
        pack_linears(head)
    return head


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
            f"{str(path.with_name(_WEIGHTS))!r} is neither a specdec head ({_CONFIG} format "
            f"{_FORMAT!r}) nor a public EAGLE head (keys midlayer.* or layers.0.*): keys {sorted(tensors)[:8]}"
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
        target=_target_fingerprint(target),
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
            f"{str(path)!r} does not match its {_CONFIG} ({head.config.kind.value} head): missing {missing}, "
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
