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
from specdec.models.packed import PackedLinear
from specdec.models.quantized import Int8Linear, Q4Linear

__all__ = ["StackArguments", "applies", "decoder_disabled", "kernel_args", "run_stack", "stack_arguments"]

_PACKED_BF16, _INT8, _Q4 = 0, 1, 2  # the kernel's LinearKind


def decoder_disabled() -> bool:
    """Whether ``SPECDEC_DISABLE_CPU_DECODER`` keeps the Python loop (read at every forward)."""
    return bool(os.environ.get("SPECDEC_DISABLE_CPU_DECODER"))


def kernel_args(linear: nn.Module, bf16_dot: int, vnni: int) -> tuple | None:
    """``(kind, packed, scale, out_features, bias, mode)`` of a linear with a bf16 result, as its
    own forward passes them to the kernel (``bf16_dot``, ``vnni``: the modes it would pass); None
    for any other module. Reads ``_buffers`` directly: this runs for every linear at every forward
    (nn.Module attribute lookups cost ~1 us each, 1.4 ms a step of a 28-layer model)."""
    kind = _KINDS.get(type(linear))
    if kind is None or linear.__dict__["out_dtype"] != torch.bfloat16:
        return None
    buffers = linear._buffers
    mode = bf16_dot if kind == _PACKED_BF16 else vnni
    return kind, buffers["packed"], buffers.get("scale"), linear.__dict__["out_features"], buffers["bias"], mode


_KINDS = {PackedLinear: _PACKED_BF16, Int8Linear: _INT8, Q4Linear: _Q4}
_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


@attrs.frozen(eq=False)
class StackArguments:
    """The per-layer weights the kernel reads: 2 norms and 4 linears per layer, in order;
    ``fits`` False when some layer does not fit the kernel (the other fields are then empty)."""

    fits: bool
    tensors: list  # every tensor read (None where absent), to tell whether the layers changed
    norms: list[torch.Tensor] = attrs.field(factory=list)  # 2 L x [hidden] bf16
    eps: float = 0.0
    linears: tuple[list, ...] = ()  # six lists of 4 L entries: kind, packed, scale, out, bias, mode

    def is_current(self, layers: nn.ModuleList) -> bool:
        """Whether ``layers`` still hold exactly these tensors (~45 us for 28 layers, where
        reading the arguments afresh costs ~300 us)."""
        return all(map(operator.is_, _tensors(layers), self.tensors))


def _tensors(layers: nn.ModuleList) -> list:
    """The norm weights and each projection's packed weight, scale and bias, or None, in order."""
    out: list = []
    for layer in layers._modules.values():
        children = layer._modules
        out += (
            children["input_layernorm"]._parameters.get("weight"),
            children["post_attention_layernorm"]._parameters.get("weight"),
        )
        for block, name in _LINEARS:
            buffers = children[block]._modules[name]._buffers
            out += (buffers.get("packed"), buffers.get("scale"), buffers.get("bias"))
    return out


def stack_arguments(layers: nn.ModuleList, cached: StackArguments | None = None) -> StackArguments:
    """The layers' kernel arguments: ``cached`` itself while it is current, else read afresh."""
    if cached is not None and cached.is_current(layers):
        return cached
    tensors = _tensors(layers)
    norms: list[torch.Tensor] = []
    columns: tuple[list, ...] = ([], [], [], [], [], [])
    eps, bf16_dot, vnni = None, bf16_dot_mode(), vnni_mode()
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
        for block, name in _LINEARS:
            args = kernel_args(children[block]._modules[name], bf16_dot, vnni)
            if args is None:
                return misfit
            for column, value in zip(columns, args):
                column.append(value)
    if eps is None:
        return misfit
    return StackArguments(fits=True, tensors=tensors, norms=norms, eps=eps, linears=columns)


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
        h.contiguous(), args.norms, args.eps, *args.linears, cos.view(n, -1), sin.view(n, -1),
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv.pool.cache,
        tp.slot_mapping, plan.row_seq, plan.row_index, tp.kv_gather, plan.kv_lens, tp.mask,
        tp.spec.sm_scale, list(layers),
    )  # fmt: skip
