"""Every decoder layer of a bf16 model in one kernel call on the CPU (``kernels/cpu_decoder.cpp``).

The Python loop over layers (:meth:`LlamaModel._fused_layer_states`) makes ~10 calls per layer,
each paying Python and pybind dispatch on an interpreter whose working set the weight stream has
just evicted; the kernel runs the same functions on the same tensors in C++, so its result is
bitwise the loop's. It applies when the forward would take the fused bf16 path anyway, the
attention backend is exactly :class:`~specdec.attention.cpu_backend.CpuAttentionBackend` over a
bf16 :class:`~specdec.kv.paged.PagePool`, and every projection is a packed bf16, int8 or q4
linear of this package; anything else (tensor-parallel layers, other backends, float32 models)
keeps the Python loop. ``SPECDEC_DISABLE_CPU_DECODER=1`` keeps it too (``benchmarks.profile_step``
uses that to time the parts of a layer).
"""

from __future__ import annotations

import operator
import os

import attrs
import torch
from torch import nn

from specdec.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan
from specdec.kernels.cpu_linear import bf16_dot_mode, vnni_mode
from specdec.kv.paged import ModelKV
from specdec.models.kernel_args import kernel_args
from specdec.models.qwen3_moe import SparseMoeBlock

__all__ = ["StackArguments", "applies", "decoder_disabled", "kernel_args", "run_stack", "stack_arguments"]

def decoder_disabled() -> bool:
    """Whether ``SPECDEC_DISABLE_CPU_DECODER`` keeps the Python loop (read at every forward)."""
    return bool(os.environ.get("SPECDEC_DISABLE_CPU_DECODER"))


_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@attrs.frozen(eq=False)
class StackArguments:
    """The per-layer weights the kernel reads: 2 norms (and Qwen3's 2 q/k norms), the attention's
    2 linears, and the MLP's 2 linears or its ``SparseMoe`` per layer, in order; ``fits`` False
    when some layer does not fit the kernel (the other fields are then empty)."""

    fits: bool
    tensors: list  # every tensor read (None where absent), to tell whether the layers changed
    norms: list[torch.Tensor] = attrs.field(factory=list)  # 2 L x [hidden] bf16
    eps: float = 0.0
    qk_norms: list[torch.Tensor] = attrs.field(factory=list)  # [] or 2 L x [head_dim] bf16
    qk_eps: float = 0.0
    linears: tuple[list, ...] = ()  # six lists (kind, packed, scale, out, bias, mode): 2 or 4 a layer
    moes: list = attrs.field(factory=list)  # L x the layer's SparseMoe kernel, or None (dense MLP)

    def is_current(self, layers: nn.ModuleList, ops: object) -> bool:
        """Whether ``layers`` still hold exactly these tensors (~45 us for 28 dense layers,
        where reading the arguments afresh costs ~300 us; a sparse layer checks its block's
        kernel, ~50 us)."""
        return all(map(operator.is_, _tensors(layers, ops), self.tensors))


def _tensors(layers: nn.ModuleList, ops: object) -> list:
    """The norm weights, each projection's packed weight, scale and bias, or None, and each
    sparse MLP's kernel object (:meth:`SparseMoeBlock.kernel`), in order."""
    out: list = []
    for layer in layers._modules.values():
        children = layer._modules
        attn, mlp = children["self_attn"], children["mlp"]
        out += (
            children["input_layernorm"]._parameters.get("weight"),
            children["post_attention_layernorm"]._parameters.get("weight"),
        )
        for norm in (attn._modules.get("q_norm"), attn._modules.get("k_norm")):
            out.append(None if norm is None else norm._parameters.get("weight"))
        sparse = isinstance(mlp, SparseMoeBlock)
        for block, name in _LINEARS[:2] if sparse else _LINEARS:
            buffers = children[block]._modules[name]._buffers
            out += (buffers.get("packed"), buffers.get("scale"), buffers.get("bias"))
        if sparse:
            out.append(mlp.kernel(ops))
    return out


def stack_arguments(layers: nn.ModuleList, ops: object, cached: StackArguments | None = None) -> StackArguments:
    """The layers' kernel arguments: ``cached`` itself while it is current, else read afresh."""
    if cached is not None and cached.is_current(layers, ops):
        return cached
    tensors = _tensors(layers, ops)
    norms: list[torch.Tensor] = []
    qk_norms: list[torch.Tensor] = []
    moes: list = []
    columns: tuple[list, ...] = ([], [], [], [], [], [])
    eps, qk_eps, bf16_dot, vnni = None, None, bf16_dot_mode(), vnni_mode()
    misfit = StackArguments(fits=False, tensors=tensors)
    for layer in layers._modules.values():
        children = layer._modules
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = children[name]
            eps = norm.eps if eps is None else eps
            weight = norm._parameters["weight"]
            if norm.eps != eps or weight.dtype != torch.bfloat16:
                return misfit
            norms.append(weight)
        attn_modules = children["self_attn"]._modules
        for name in ("q_norm", "k_norm"):
            norm = attn_modules.get(name)
            if norm is None:
                continue
            qk_eps = norm.eps if qk_eps is None else qk_eps
            weight = norm._parameters["weight"]
            if norm.eps != qk_eps or weight.dtype != torch.bfloat16:
                return misfit
            qk_norms.append(weight)
        mlp = children["mlp"]
        moe = mlp.kernel(ops) if isinstance(mlp, SparseMoeBlock) else None
        if isinstance(mlp, SparseMoeBlock) and moe is None:
            return misfit
        moes.append(moe)
        for block, name in _LINEARS[:2] if moe is not None else _LINEARS:
            args = kernel_args(children[block]._modules[name], bf16_dot, vnni)
            if args is None:
                return misfit
            for column, value in zip(columns, args):
                column.append(value)
    if eps is None or len(qk_norms) not in (0, len(norms)):
        return misfit
    return StackArguments(
        fits=True, tensors=tensors, norms=norms, eps=eps, qk_norms=qk_norms,
        qk_eps=qk_eps or 0.0, linears=columns, moes=moes,
    )  # fmt: skip


def applies(kv: object, backend: object, plan: object) -> bool:
    """Whether the attention of this forward is what the kernel computes."""
    return (
        not decoder_disabled()
        and type(backend) is CpuAttentionBackend
        and isinstance(plan, CpuAttentionPlan)
        and isinstance(kv, ModelKV)
        and kv.pool.cache.dtype == torch.bfloat16
        and kv.pool.cache.device.type == "cpu"
    )


def run_stack(
    ops: object,
    model: nn.Module,  # a LlamaModel
    args: StackArguments,
    h: torch.Tensor,  # [num_tokens, hidden] bf16 embeddings
    cos: torch.Tensor,  # [num_tokens, 1, head_dim] bf16
    sin: torch.Tensor,
    kv: ModelKV,
    plan: CpuAttentionPlan,
    layers: tuple[int, ...],
) -> list[torch.Tensor]:  # len(layers) x [num_tokens, hidden]
    """:meth:`LlamaModel.layer_states` through the kernel."""
    cfg, tp, n = model.layer_config, plan.torch_plan, h.shape[0]
    return ops.decoder_layers(
        h.contiguous(), args.norms, args.eps, args.qk_norms, args.qk_eps, *args.linears, args.moes,
        cos.view(n, -1), sin.view(n, -1),
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv.pool.cache,
        tp.slot_mapping, plan.row_seq, plan.row_index, tp.kv_gather, plan.kv_lens, tp.mask,
        tp.spec.sm_scale, list(layers),
    )  # fmt: skip
