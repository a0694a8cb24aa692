"""MTP head: one decoder layer that predicts the token after next from the target's hidden state.

DeepSeek-V3's multi-token-prediction module, for any Llama-family target::

    x_i  = W_proj [enorm(embed(t_{i+1})) ; hnorm(h_i)]      # [hidden], W_proj: [hidden, 2 hidden]
    g_i  = DecoderLayer(x_0 .. x_i)                           # causal over this sequence's pairs
    p_i  = softmax(lm_head(norm(g_i)))                        # the head's guess for t_{i+2}

``h_i`` is the target's last hidden state (before its final norm) at position ``i``, which
predicted ``t_{i+1}``; ``g_i`` is trained to match ``h_{i+1}``, so for later draft positions the
head feeds on its own ``g`` in place of the target's ``h``. The decoder layer is the target's own
block type (:class:`~specdec.models.llama.DecoderLayer`) and uses the target's RoPE. The token
embedding and the LM head are the *target's* modules, borrowed, frozen and never copied: a saved
head holds only its own weights (``model.safetensors`` plus ``config.json``).

Two forwards share the weights: :meth:`MTPHeadModel.forward` over the paged KV cache (inference)
and :meth:`MTPHeadModel.forward_dense` over whole ``[batch, time]`` chunks with causal attention
and autograd (training). A parity test keeps them equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specdec.interfaces import AttentionBackend
from specdec.kv.paged import KVSpec, ModelKV
from specdec.models.llama import DecoderLayer, LlamaModel, ModelConfig, RMSNorm, apply_rope

__all__ = ["MTPHeadConfig", "MTPHeadModel", "load_draft_vocab", "load_mtp_head", "save_draft_vocab", "save_mtp_head"]

_FORMAT = "specdec-mtp-head"
_VERSION = 1
# The target's shape a head was built for; a head only loads onto a target that matches.
_TARGET_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)


def _bool(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen(kw_only=True)
class MTPHeadConfig:
    """What a head file records besides its weights.

    ``use_input_norms=False`` drops ``enorm``/``hnorm`` (the projection then sees the raw
    embedding and hidden state), for measuring what the norms are worth.
    """

    use_input_norms: bool = attrs.field(default=True, validator=_bool)
    target: dict[str, object] = attrs.field(factory=dict)  # _TARGET_FIELDS of the target config

    @classmethod
    def for_target(cls, cfg: ModelConfig, *, use_input_norms: bool = True) -> MTPHeadConfig:
        return cls(use_input_norms=use_input_norms, target=_target_fingerprint(cfg))

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError if ``cfg`` is not the kind of target this head was trained for."""
        mine, theirs = self.target, _target_fingerprint(cfg)
        diff = {k: (mine.get(k), v) for k, v in theirs.items() if mine.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: head {a!r} vs target {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"MTP head does not fit this target ({detail})")

    def to_json(self) -> dict[str, object]:
        return {"format": _FORMAT, "version": _VERSION, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> MTPHeadConfig:
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ValueError(
                f"not a specdec MTP head config (format {data.get('format')!r}, "
                f"version {data.get('version')!r}; expected {_FORMAT!r} version {_VERSION})"
            )
        return cls(use_input_norms=data["use_input_norms"], target=dict(data["target"]))


def _target_fingerprint(cfg: ModelConfig) -> dict[str, object]:
    out = {name: getattr(cfg, name) for name in _TARGET_FIELDS}
    out["architecture"] = cfg.architecture.value
    return out


class MTPHeadModel(nn.Module):
    """The head's own weights plus borrowed (unregistered) target embedding and LM head.

    Example:
        >>> head = MTPHeadModel(target, MTPHeadConfig.for_target(target.config))
        >>> g = head(h_prev, next_tokens, layout, kv, backend, plan)    # [rows, hidden]
        >>> head.logits(g)                                               # [rows, vocab]
    """

    def __init__(self, target: LlamaModel, config: MTPHeadConfig) -> None:
        super().__init__()
        cfg = target.config
        config.check_target(cfg)
        self.config = config
        self.target_config = cfg
        self._target = (target,)  # a tuple, so the target's modules are not registered (or saved)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)

    @property
    def target(self) -> LlamaModel:
        return self._target[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def kv_spec(self, name: str = "mtp") -> KVSpec:
        cfg = self.target_config
        return KVSpec(name=name, num_layers=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=self.dtype)

    # ------------------------------------------------------------------ math
    def fuse(
        self,
        hidden: torch.Tensor,  # [..., hidden] h_i (target's) or g_{i-1} (the head's own)
        next_tokens: torch.Tensor,  # [...] int64 t_{i+1}
    ) -> torch.Tensor:  # [..., hidden] the decoder layer's input
        emb = self.target.embed_tokens(next_tokens).to(self.dtype)
        hidden = hidden.to(self.dtype)
        if self.config.use_input_norms:
            emb, hidden = self.enorm(emb), self.hnorm(hidden)
        return self.eh_proj(torch.cat((emb, hidden), dim=-1))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden] -> [rows, vocab]`` float32 (float64 kept), through the target's LM head."""
        out = self.target.lm_head(self.norm(g).to(self.target.dtype))
        return out if out.dtype == torch.float64 else out.float()

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,  # [rows, hidden]
        next_tokens: torch.Tensor,  # [rows] int64
        positions: torch.Tensor,  # [rows] int64, this row's slot in the head's KV
        kv: ModelKV,
        backend: AttentionBackend,
        plan: object,
    ) -> torch.Tensor:  # [rows, hidden] g, before the final norm
        """Paged forward: the rows' K/V are written at the layout's slots, then attended."""
        cos, sin = self.target.rope(positions, self.dtype)
        return self.layer(self.fuse(hidden, next_tokens), cos, sin, kv.layer(0), backend, plan)

    def forward_dense(
        self,
        hidden: torch.Tensor,  # [batch, time, hidden]
        next_tokens: torch.Tensor,  # [batch, time] int64
    ) -> torch.Tensor:  # [batch, time, hidden]
        """Training forward: each row of ``[batch, time]`` is one sequence's pairs 0..time-1,
        causal attention within the row, RoPE position = pair index (as the paged forward)."""
        b, t, _ = hidden.shape
        cfg = self.target_config
        x = self.fuse(hidden, next_tokens)  # [B, T, H]
        cos, sin = self.target.rope(torch.arange(t, device=x.device), x.dtype)  # [T, 1, D]
        layer = self.layer
        attn = layer.self_attn
        q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(
            (attn.q_size, attn.kv_size, attn.kv_size), dim=-1
        )
        q = apply_rope(q.view(b, t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=cfg.head_dim**-0.5,
        )  # [B, heads, T, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))
        return x + layer.mlp(layer.post_attention_layernorm(x))


def save_mtp_head(head: MTPHeadModel, directory: str | Path) -> Path:
    """Write ``model.safetensors`` (the head's own weights only) and ``config.json``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in _plain_state_dict(head).items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": _FORMAT})
    (directory / "config.json").write_text(json.dumps(head.config.to_json(), indent=2) + "\n")
    return directory


def _plain_state_dict(head: MTPHeadModel) -> dict[str, torch.Tensor]:
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


def load_mtp_head(
    directory: str | Path,
    target: LlamaModel,
    *,
    dtype: torch.dtype | None = None,
    quantization: str | None = None,
) -> MTPHeadModel:
    """Load a head saved by :func:`save_mtp_head` onto ``target`` (checked to fit it).

    Weights take ``dtype`` (default: the target's) on the target's device. Only safetensors are
    read. A bf16 head on a CPU with the packed kernel gets packed linears, like the target.
    ``quantization`` (``"int8"`` or ``"q4"``, CPU only) stores the head's own linear layers in
    that format (the LM head it shares with the target stays as the target stores it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from specdec.models.packed import pack_linears, should_pack
    from specdec.models.quantized import check_quantization, quantize_linears

    check_quantization(quantization, target.device)

    directory = Path(directory)
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"MTP head directory {str(directory)!r} must hold config.json and model.safetensors"
        )
    try:
        config = MTPHeadConfig.from_json(json.loads((directory / "config.json").read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read {str(directory / 'config.json')!r}: {err}") from err
    dtype = dtype or target.dtype
    with torch.device("meta"):
        head = MTPHeadModel(target, config)
    try:
        state = load_file(str(directory / "model.safetensors"))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"corrupt head weights {str(directory / 'model.safetensors')!r}: {err}") from err
    expected = {name: tuple(p.shape) for name, p in head.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
        raise ValueError(f"MTP head weights do not match its config: missing {missing}, unexpected {extra}, wrong shape {wrong}")
    state = {n: t.to(device=target.device, dtype=dtype) for n, t in state.items()}
    head.load_state_dict(state, assign=True)
    head.eval().requires_grad_(False)
    if quantization is not None:  # from the plain weights: packing first would be undone
        quantize_linears(head, quantization)
    elif should_pack(head):
        pack_linears(head)
    return head


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def save_draft_vocab(directory: str | Path, token_ids: torch.Tensor) -> Path:
    """Write the token ids a head saw in training, most frequent first (``[n]`` int64), beside
    the head: ``MTPHead(draft_vocab_size=N)`` drafts from the first N only."""
    from safetensors.torch import save_file

    path = Path(directory) / DRAFT_VOCAB_FILE
    save_file({"ids": token_ids.to(torch.int64).contiguous().cpu()}, str(path))
    return path


def load_draft_vocab(directory: str | Path, size: int) -> torch.Tensor:
    """The ``size`` most frequent training tokens of the head in ``directory`` (``[size]``)."""
    from safetensors.torch import load_file

    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(f"draft_vocab_size needs {str(path)!r} (written by specdec train-mtp)")
    ids = load_file(str(path))["ids"]
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size:
        raise ValueError(f"draft_vocab_size must be a positive int, got {size!r}")
    return ids[:size]
