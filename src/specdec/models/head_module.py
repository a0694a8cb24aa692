"""What every draft head on a target's features shares (the MTP module, the EAGLE head): one
decoder layer of its own, the target's modules borrowed, and the dense training forward.

A head borrows the target's embedding (and, by kind, its norm and LM head) without registering
them: they are neither trained, saved nor copied with the head. The head's one layer has its own
KV pool (one layer, the same page ids as the target) and plans attention with its own shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.interfaces import AttentionSpec
from specdec.kv.paged import KVSpec
from specdec.models.llama import LlamaModel, ModelConfig, apply_rope

__all__ = ["HeadModule", "copy_matching_layer", "dense_block", "dense_qkv", "inference_copy"]


class HeadModule(nn.Module):
    """Base of the heads: the borrowed target, the head's layer shape, its dtype and device.

    ``config`` is the head's own record (it must have ``check_target(ModelConfig)``);
    ``layer_config`` the :class:`ModelConfig` of its one decoder layer (``self.layer``, which
    the subclass builds, and whose ``post_attention_layernorm`` every head kind has).
    """

    kv_name = "head"  # the default name of the head's KV pool

    def __init__(self, target: LlamaModel, config: object, layer_config: ModelConfig) -> None:
        super().__init__()
        config.check_target(target.config)
        self.config = config
        self.target_config = target.config
        self.layer_config = layer_config
        self._target = (target,)  # a tuple, so the target's modules are not registered (or saved)

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

    def kv_spec(self, name: str | None = None) -> KVSpec:
        """The head's KV pool: one layer of its own shape (``name`` default: :attr:`kv_name`)."""
        return self.layer_config.kv_spec(name or self.kv_name, self.dtype)


def dense_qkv(
    attn: nn.Module,  # a specdec.models.llama.Attention
    attn_in: torch.Tensor,  # [batch, time, attention input width]
    cos: torch.Tensor,  # [time, 1, head_dim]
    sin: torch.Tensor,  # [time, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, k, v: [batch, heads, time, head_dim]
    """Queries, keys and values of ``attn`` over dense rows, RoPE applied, the KV heads repeated
    to the query heads (training forwards: no KV cache, autograd through everything)."""
    b, t, _ = attn_in.shape
    q, k, v = attn.qkv_proj(attn_in).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    q = q.view(b, t, attn.num_heads, attn.head_dim)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:  # Qwen3 layers: each head's channels normed before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def dense_block(
    layer: nn.Module,  # a decoder layer: self_attn, mlp, post_attention_layernorm
    attn_in: torch.Tensor,  # [batch, time, attention input width] (already normed)
    residual: torch.Tensor,  # [batch, time, hidden]
    cos: torch.Tensor,  # [time, 1, head_dim]
    sin: torch.Tensor,  # [time, 1, head_dim]
) -> torch.Tensor:  # [batch, time, hidden]
    """One decoder layer over dense rows with causal attention within each row of the batch:
    the training twin of the paged forward (a parity test holds them equal)."""
    b, t, _ = residual.shape
    attn = layer.self_attn
    q, k, v = dense_qkv(attn, attn_in, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.head_dim**-0.5)
    h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, t, attn.q_size))  # [B, T, H]
    return h + layer.mlp(layer.post_attention_layernorm(h))


def copy_matching_layer(layer: nn.Module, source: nn.Module) -> None:
    """Start a head's decoder ``layer`` as ``source`` (a target layer) where shapes agree: each
    linear of the same name and shape, and the norms (``hidden_norm`` from the input norm)."""
    from specdec.models.packed import linear_weights

    with torch.no_grad():
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                weight, bias = linear_weights(source.get_submodule(name))
                if tuple(weight.shape) == tuple(module.weight.shape):
                    module.weight.copy_(weight.float())
                    if module.bias is not None and bias is not None:
                        module.bias.copy_(bias.float())
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            if hasattr(layer, name):
                own = "post_attention_layernorm" if name == "post_attention_layernorm" else "input_layernorm"
                getattr(layer, name).weight.copy_(getattr(source, own).weight.float())


def inference_copy(head: HeadModule, target: LlamaModel) -> HeadModule:
    """A frozen copy of a (float32 training) ``head`` in the target's dtype and on its device,
    its linears packed on bf16 CPUs like the target's."""
    from specdec.models.packed import pack_linears, should_pack

    out = type(head)(target, head.config)
    out.load_state_dict(
        {k: v.detach().to(target.dtype) if v.is_floating_point() else v.detach() for k, v in head.state_dict().items()}
    )
    out = out.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return pack_linears(out) if should_pack(out) else out
