"""Qwen3-MoE: what its decoder does differently from Qwen3's.

specdec runs ``Qwen3MoeForCausalLM`` (model type ``qwen3_moe``: Qwen3-30B-A3B, Qwen3-235B-A22B)
through the decoder of :mod:`specdec.models.llama` with Qwen3's attention (per-head q/k RMSNorm
before RoPE), with one difference, read off transformers' ``modeling_qwen3_moe.py`` (the
reference; transformers 5): the MLP of a *sparse* layer is a mixture of experts,
:class:`SparseMoeBlock`:

- a router ``mlp.gate`` (a linear ``hidden -> num_experts``, no bias, in the model's dtype);
  softmax of its logits in float32, the ``num_experts_per_tok`` largest probabilities and their
  experts (``torch.topk``), renormalised to sum to 1 when ``norm_topk_prob``, then rounded to the
  model's dtype (:func:`route`, bit for bit transformers' ``Qwen3MoeTopKRouter``);
- experts of ``moe_intermediate_size``, each a SiLU-gated MLP; a token's output is the sum of its
  experts' outputs, each times its routing weight, accumulated in the model's dtype in
  ascending expert order (transformers' eager ``Qwen3MoeExperts``: ``index_add_`` per expert).

Layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers``, when ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0``; the other layers keep Llama's MLP of
``intermediate_size``. A sliding window, if ``sliding_window`` is set, applies to every layer.

Experts are specdec's own fused layout, one module per expert (``experts.{e}.gate_up_proj``,
gate rows then up rows, and ``experts.{e}.down_proj``, plain ``nn.Linear``), so packing and
int8/q4 quantization replace them as any other linear; the router is quantized with them (it is
small; llama.cpp keeps it dense). The loader takes checkpoints as ``save_pretrained`` and the
released checkpoints write them (``mlp.experts.{e}.gate_proj``/``up_proj``/``down_proj``: fused
by :func:`specdec.models.loading.model_from_state_dict` as the dense MLP's are), and experts
stacked in 3-D tensors (transformers' in-memory ``mlp.experts.gate_up_proj``/``down_proj``, a
GGUF file's ``ffn_*_exps``) through :func:`unstack_experts`.

The sparse MLP runs batched by expert: one host read per layer of which experts got tokens,
then, per such expert, its rows gathered, two matrix products, and its weighted output added
into theirs. Each token's sum runs over its own experts in a fixed order, so a row's result does
not depend on the rows beside it: a verify pass computes what decoding each row alone computes.
That host read is why CUDA graphs refuse MoE models (:class:`specdec.graphs.PassGraphs`). On
the CPU in bf16 with kernel linears the block is one call (:meth:`SparseMoeBlock.kernel`,
``kernels/cpu_moe.cpp``: the same ops in the same order), inside the whole-stack kernel
(:mod:`specdec.models.cpu_decoder`) or the per-layer loop of fused ops.

Ignored, as they change nothing at inference: ``output_router_logits``,
``router_aux_loss_coef``. Refused with a ValueError naming the field: ``num_experts_per_tok``
outside ``1..num_experts``, ``decoder_sparse_step`` below 1, ``moe_intermediate_size`` below 1,
and ``mlp_only_layers`` that is not a list of ints. Refused elsewhere: tensor parallelism
(:mod:`specdec.distributed.sharding`), CUDA graphs, and ``quantization="q4"`` straight from a
GGUF file (:mod:`specdec.models.gguf_q4`; a dense GGUF load works, then ``"int8"``/``"q4"``
quantize it).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from specdec.models.config_checks import unsupported

__all__ = ["Expert", "MoeTraits", "SparseMoeBlock", "read_traits", "route", "unstack_experts"]


@attrs.frozen(kw_only=True)
class MoeTraits:
    """What a Qwen3-MoE config adds to a :class:`~specdec.models.llama.ModelConfig`."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts (the others: dense)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def read_traits(hf_config: object) -> MoeTraits:
    """The MoE fields of a transformers ``Qwen3MoeConfig``; ValueError naming a field specdec
    cannot honour. ``num_experts=0`` makes every layer dense, as in transformers."""
    n_layers = hf_config.num_hidden_layers
    experts = _int_field(hf_config, "num_experts", 0)
    top_k = _int_field(hf_config, "num_experts_per_tok", 1)
    width = _int_field(hf_config, "moe_intermediate_size", 1)
    step = _int_field(hf_config, "decoder_sparse_step", 1)
    dense = getattr(hf_config, "mlp_only_layers", None) or []
    if not isinstance(dense, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in dense
    ):
        raise unsupported("mlp_only_layers", dense, "a list of layer indices")
    if experts and not top_k <= experts:
        raise unsupported("num_experts_per_tok", top_k, f"1..num_experts ({experts})")
    sparse = tuple(
        i for i in range(n_layers) if experts > 0 and i not in dense and (i + 1) % step == 0
    )
    return MoeTraits(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _int_field(hf_config: object, field: str, least: int) -> int:
    value = getattr(hf_config, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise unsupported(field, value, f"an int >= {least}")
    return value


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] in the model's dtype
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] in the logits' dtype,
    # experts [num_tokens, top_k] int64 (largest probability first)
    """Each token's experts and their weights, as transformers' ``Qwen3MoeTopKRouter``: softmax
    in float32 (float64 logits too), top-k, renormalised when ``norm_topk_prob``, rounded to the
    logits' dtype.

    Example:
        >>> w, e = route(torch.tensor([[0.0, 2.0, 1.0]]), 2, True)
        >>> e.tolist(), [round(x, 4) for x in w[0].tolist()]
        ([[1, 2]], [0.7311, 0.2689])
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class Expert(nn.Module):
    """One expert: a SiLU-gated MLP of ``moe_intermediate_size``, gate and up fused as in
    specdec's dense MLP (gate rows first)."""

    def __init__(
        self, hidden_size: int, width: int, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.width, self.act = width, act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:  # [rows, hidden] -> same
        """``ops``: the CPU kernel module on the fused bf16 path, whose ``silu_mul`` is bitwise
        ``silu(gate) * up`` in one call (SiLU experts only)."""
        gate_up = self.gate_up_proj(x)
        if ops is not None and self.act is F.silu:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.width, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: the router ``gate`` and ``experts``, run batched by expert.

    Example:
        >>> block = SparseMoeBlock(64, traits, F.silu)
        >>> block(torch.randn(5, 64)).shape
        torch.Size([5, 64])
    """

    def __init__(
        self, hidden_size: int, traits: MoeTraits, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = traits.num_experts_per_tok, traits.norm_topk_prob
        self.gate = nn.Linear(hidden_size, traits.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(hidden_size, traits.moe_intermediate_size, act)
            for _ in range(traits.num_experts)
        )

    def forward(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:  # [num_tokens, hidden] -> same
        """``ops``: as :meth:`Expert.forward`; where every linear of the block is a kernel
        linear of this package with a bf16 result (packed bf16, int8, q4) and the experts are
        SiLU-gated, the whole block runs in one kernel call (``kernels/cpu_moe.cpp``: the same
        ops in the same order, bitwise this method's loop)."""
        if ops is not None and x.dim() == 2 and x.dtype == torch.bfloat16:
            kernel = self.kernel(ops)
            if kernel is not None:
                return kernel.forward(x.contiguous())
        return self.loop(x, ops)

    def loop(self, x: torch.Tensor, ops: object = None) -> torch.Tensor:  # [num_tokens, hidden] -> same
        """:meth:`forward` in Python, one module call per step (the kernel's specification)."""
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)  # [T, k] each
        if x.shape[0] == 1:  # a decode row: its k experts in ascending order, no gather/scatter
            return self._one_token(x, weights[0], experts[0], ops)
        flat = experts.reshape(-1)  # [T * k]: token t's slots at t * k .. t * k + k - 1
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        tokens, slot_weights = order // self.top_k, weights.reshape(-1)[order]  # [T * k] each
        # The one host read of the layer: which experts run, and on how many rows.
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count == 0:
                continue  # no token chose it: it does not run
            rows = tokens[start : start + count]  # [count] int64, distinct
            scaled = expert(x.index_select(0, rows), ops) * slot_weights[start : start + count, None]
            # In the model's dtype, experts in ascending order: transformers' eager accumulation.
            out.index_add_(0, rows, scaled)
            start += count
        return out

    def kernel(self, ops: object) -> object | None:
        """The block as the kernel's ``SparseMoe`` (its linears' arguments read once), kept
        between forwards while every linear is the same module holding the same packed weight,
        scale and bias (checked at every forward, ~50 us for 257 linears: reads ``_modules``
        and ``_buffers`` directly, as attribute lookups through ``nn.Module`` would cost ~300
        us); None where a linear (not a packed bf16, int8 or q4 linear with a bf16 result) or
        the activation (not SiLU) is not the kernel's."""
        cache = self.__dict__.get("_kernel_cache")
        if cache is not None and cache.ops is ops and cache.is_current(self):
            return cache.kernel
        cache = _KernelCache.read(self, ops)
        self.__dict__["_kernel_cache"] = cache
        return cache.kernel

    def _one_token(self, x, weights, experts, ops) -> torch.Tensor:  # x [1, hidden] -> [1, hidden]
        """:meth:`forward` of one token: the same sums in the same order (ascending expert, in
        the model's dtype, from zero), bitwise; ``weights``/``experts`` [k]."""
        order = torch.argsort(experts)
        out = torch.zeros_like(x)
        for e, w in zip(experts[order].tolist(), weights[order]):  # the one host read
            out.add_(self.experts[e](x, ops) * w)
        return out


@attrs.frozen(eq=False)
class _KernelCache:
    """What :meth:`SparseMoeBlock.kernel` keeps: the kernel object and the objects it was read
    from, in the kernel's order (the router, then gate_up and down of each expert)."""

    ops: object
    kernel: object | None
    experts: list  # the Expert modules
    expert_modules: list  # each expert's ``_modules`` dict
    linears: list  # the 1 + 2 E linear modules
    buffers: list  # each linear's ``_buffers`` dict
    packed: list  # each linear's packed weight

    @classmethod
    def read(cls, block: SparseMoeBlock, ops: object) -> _KernelCache:
        experts = list(block.experts._modules.values())
        expert_modules = [e._modules for e in experts]
        linears = [block._modules["gate"]]
        for modules in expert_modules:
            linears += (modules["gate_up_proj"], modules["down_proj"])
        buffers = [m._buffers for m in linears]
        packed = list(map(dict.get, buffers, repeat("packed")))
        kernel = None
        if all(e.act is F.silu for e in experts) and hasattr(ops, "SparseMoe"):
            from specdec.kernels.cpu_linear import bf16_dot_mode, vnni_mode
            from specdec.models.kernel_args import kernel_args

            rows = [kernel_args(m, bf16_dot_mode(), vnni_mode()) for m in linears]
            if all(r is not None for r in rows):
                kernel = ops.SparseMoe(*map(list, zip(*rows)), block.top_k, block.norm_topk_prob)
        return cls(ops, kernel, experts, expert_modules, linears, buffers, packed)

    def is_current(self, block: SparseMoeBlock) -> bool:
        """Whether ``block`` still holds exactly these objects."""
        linears = self.linears
        return (
            _same(self.experts, block.experts._modules.values())
            and linears[0] is block._modules["gate"]
            and _same(linears[1::2], map(dict.get, self.expert_modules, repeat("gate_up_proj")))
            and _same(linears[2::2], map(dict.get, self.expert_modules, repeat("down_proj")))
            # the packed weight only: every path that replaces a linear's scale or bias (its
            # constructor, load_state_dict(assign=True), the move to huge pages) replaces it too
            and _same(self.packed, map(dict.get, self.buffers, repeat("packed")))
        )


def _same(a: list, b: Iterable) -> bool:
    """Whether ``b`` yields the objects of ``a``, element for element (and no more)."""
    b = list(b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


# Experts stacked in one tensor, first dimension the expert: transformers' in-memory model
# (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], no ``.weight``) and a GGUF file's
# ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps`` (:mod:`specdec.models.gguf_dense`).
_STACKED = re.compile(
    r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?"
)


def unstack_experts(
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with every stacked expert tensor (3-D, experts first) split into one tensor
    per expert under the per-expert name (``...mlp.experts.{e}.{proj}.weight``), the rest as
    they are.

    >>> [n for n, _ in unstack_experts(iter([("m.mlp.experts.down_proj", torch.zeros(2, 3, 4))]))]
    ['m.mlp.experts.0.down_proj.weight', 'm.mlp.experts.1.down_proj.weight']
    """
    for name, tensor in tensors:
        stacked = _STACKED.fullmatch(name)
        if stacked is None or tensor.dim() != 3:
            yield name, tensor
            continue
        for e, part in enumerate(tensor.unbind(0)):
            yield f"{stacked['prefix']}.{e}.{stacked['proj']}.weight", part
