"""The MTP head's network: one decoder layer that predicts the token after next from the target's
hidden state (used by the :class:`~specdec.proposers.MTPHead` proposer).

DeepSeek-V3's multi-token-prediction module, for any Llama-family target::

    x_i  = W_proj [enorm(embed(t_{i+1})) ; hnorm(h_i)]      # [hidden], W_proj: [hidden, 2 hidden]
    g_i  = DecoderLayer(x_0 .. x_i)                           # causal over this sequence's pairs
    p_i  = softmax(lm_head(norm(g_i)))                        # the head's guess for t_{i+2}

``h_i`` is the target's last hidden state (before its final norm) at position ``i``, which
predicted ``t_{i+1}``; ``g_i`` is trained to match ``h_{i+1}``, so for later draft positions the
head feeds on its own ``g`` in place of the target's ``h``. The decoder layer is the target's own
block type (:class:`~specdec.models.llama.DecoderLayer`) and uses the target's RoPE. The token
embedding and the LM head are the *target's* modules, borrowed, frozen and never copied: a saved
head holds only its own weights (``model.safetensors`` plus ``config.json``,
:mod:`specdec.models.head_io`).

Names: the proposer is ``MTPHead``; the ``nn.Module`` is :class:`MTPModule` (DeepSeek-V3's name
for it) and :class:`MTPModuleConfig` is its record. ``MTPHeadModel`` and ``MTPHeadConfig`` are
their deprecated names.

Two forwards share the weights: :meth:`MTPModule.forward` over the paged KV cache (inference)
and :meth:`MTPModule.forward_dense` over whole ``[batch, time]`` chunks with causal attention
and autograd (training). A parity test keeps them equal.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from torch import nn

from specdec.config import boolean, check_arg, positive_int
from specdec.deprecation import moved_names
from specdec.interfaces import AttentionBackend
from specdec.kv.paged import ModelKV
from specdec.models.head_io import (
    check_format,
    check_target_fingerprint,
    head_files,
    place_weights,
    read_config,
    read_weights,
    save_head,
    target_fingerprint,
)
from specdec.models.head_module import HeadModule, dense_block
from specdec.models.llama import DecoderLayer, LlamaModel, ModelConfig, RMSNorm

__all__ = [
    "DRAFT_VOCAB_FILE",
    "MTPModule",
    "MTPModuleConfig",
    "load_draft_vocab",
    "load_mtp_head",
    "read_mtp_config",
    "save_draft_vocab",
    "save_mtp_head",
]

_FORMAT = "specdec-mtp-head"
_VERSION = 1
_WHAT = "MTP head"  # in messages
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
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"

__getattr__ = moved_names(
    __name__,
    {"MTPHeadModel": f"{__name__}:MTPModule", "MTPHeadConfig": f"{__name__}:MTPModuleConfig"},
)


@attrs.frozen(kw_only=True)
class MTPModuleConfig:
    """What an MTP head file records besides its weights.

    ``use_input_norms=False`` drops ``enorm``/``hnorm`` (the projection then sees the raw
    embedding and hidden state), for measuring what the norms are worth.
    """

    use_input_norms: bool = attrs.field(default=True, validator=boolean)
    target: dict[str, object] = attrs.field(factory=dict)  # _TARGET_FIELDS of the target config

    @classmethod
    def for_target(cls, cfg: ModelConfig, *, use_input_norms: bool = True) -> MTPModuleConfig:
        return cls(use_input_norms=use_input_norms, target=target_fingerprint(cfg, _TARGET_FIELDS))

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError if ``cfg`` is not the kind of target this head was trained for."""
        check_target_fingerprint(self.target, cfg, _TARGET_FIELDS, _WHAT)

    def to_json(self) -> dict[str, object]:
        return {"format": _FORMAT, "version": _VERSION, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> MTPModuleConfig:
        check_format(data, _FORMAT, _VERSION, _WHAT)
        return cls(use_input_norms=data["use_input_norms"], target=dict(data["target"]))


class MTPModule(HeadModule):
    """The MTP head's own weights plus the target's borrowed (unregistered) embedding and LM head.

    Example:
        >>> head = MTPModule(target, MTPModuleConfig.for_target(target.config))
        >>> g = head(h_prev, next_tokens, positions, kv, backend, plan)    # [rows, hidden]
        >>> head.logits(g)                                                  # [rows, vocab]
    """

    kv_name = "mtp"

    def __init__(self, target: LlamaModel, config: MTPModuleConfig) -> None:
        cfg = target.config
        if cfg.gemma is not None or cfg.olmo2:  # its layer is the target's kind: not built here
            family = "OLMo 2" if cfg.olmo2 else "Gemma"
            raise ValueError(
                f"MTP heads are not implemented for {cfg.architecture.value} targets ({family}); "
                "use an EAGLE head (EAGLETree), a DraftModel or PromptLookup"
            )
        super().__init__(target, config, attrs.evolve(cfg, num_layers=1))
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)

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
        x = self.fuse(hidden, next_tokens)  # [B, T, H]
        cos, sin = self.target.rope(torch.arange(x.shape[1], device=x.device), x.dtype)  # [T, 1, D]
        return dense_block(self.layer, self.layer.input_layernorm(x), x, cos, sin)


# ---------------------------------------------------------------------- files
save_mtp_head = save_head  # (head, directory) -> directory: the head's own weights and config


def load_mtp_head(
    directory: str | Path,
    target: LlamaModel,
    *,
    dtype: torch.dtype | None = None,
    quantization: str | None = None,
) -> MTPModule:
    """Load a head saved by :func:`save_mtp_head` onto ``target`` (checked to fit it).

    Weights take ``dtype`` (default: the target's) on the target's device. Only safetensors are
    read. A bf16 head on a CPU with the packed kernel gets packed linears, like the target.
    ``quantization`` (``"int8"`` or ``"q4"``, CPU only) stores the head's own linear layers in
    that format (the LM head it shares with the target stays as the target stores it).
    """
    from specdec.models.quantized import check_quantization

    check_quantization(quantization, target.device)
    config_path, weights_path = head_files(directory, _WHAT)
    config = _parse_config(config_path)
    with torch.device("meta"):
        head = MTPModule(target, config)
    state = read_weights(weights_path)
    expected = {name: tuple(p.shape) for name, p in head.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in state.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
        raise ValueError(f"MTP head weights do not match its config: missing {missing}, unexpected {extra}, wrong shape {wrong}")
    return place_weights(head, state, device=target.device, dtype=dtype or target.dtype, quantization=quantization)


def read_mtp_config(directory: str | Path) -> MTPModuleConfig:
    """The :class:`MTPModuleConfig` of the head in ``directory`` (both files checked present);
    ValueError if ``config.json`` is not one."""
    return _parse_config(head_files(directory, _WHAT)[0])


def _parse_config(config_path: Path) -> MTPModuleConfig:
    try:
        return MTPModuleConfig.from_json(read_config(config_path))
    except (KeyError, TypeError) as err:
        raise ValueError(f"cannot read {str(config_path)!r}: {err}") from err


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

    check_arg(positive_int, "draft_vocab_size", size)
    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(f"draft_vocab_size needs {str(path)!r} (written by specdec train-mtp)")
    return load_file(str(path))["ids"][:size]
