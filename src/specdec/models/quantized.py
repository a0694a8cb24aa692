"""Swap a model's linear layers for weight-only quantized ones (CPU kernels).

Two formats: ``"int8"`` (one float32 scale per output feature; :mod:`specdec.kernels.cpu_int8`)
and ``"q4"`` (4 bits, a float16 scale and offset per group of 32 inputs;
:mod:`specdec.kernels.cpu_q4`). A quantized *draft* changes what it proposes, never what the
generator emits (verifiers use the draft's own probabilities); a quantized *target* is a
different model, and speculation over it reproduces its greedy output exactly (both kernels
compute each row on its own, whatever the number of rows in a verify pass).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from specdec.kernels.cpu_int8 import int8_linear, pack_int8, quantize_int8, unpack_int8
from specdec.kernels.cpu_q4 import (
    BLOCK_BYTES,
    FEATURES,
    GROUP,
    dequantize_q4,
    pack_q4,
    q4_linear,
    quantize_q4,
    unpack_q4,
)
from specdec.models.packed import PackedLinear, linear_weights, parent_modules

__all__ = [
    "Int8Linear",
    "Q4Linear",
    "quantize_linears",
    "QUANTIZATIONS",
    "WEIGHT_FORMATS",
    "check_quantization",
]

QUANTIZATIONS = ("int8", "q4")  # what ``quantization=`` accepts besides None
WEIGHT_FORMATS = ("bfloat16", *QUANTIZATIONS)  # what a model's linear layers may be stored as
_Q4_CHUNK_ROWS = 4096  # rows quantized at once: bounds the float32 temporaries of a large head
_Codes = tuple[torch.Tensor, ...]  # a format's codes: (q, scale) for int8, (q, d, c) for q4


def check_quantization(quantization: str | None, device: str | torch.device) -> None:
    """The ``quantization`` argument: ``None``, ``"int8"`` or ``"q4"``, on the CPU only."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'int8' or 'q4', got {quantization!r}")
    if quantization is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only, got device={device!r}"
        )


class _QuantizedLinear(nn.Module):
    """What :class:`Int8Linear` and :class:`Q4Linear` share: a linear layer whose kernel takes the
    rows flattened, with a float32 bias and ``out_dtype`` (the model's dtype for hidden layers,
    float32 for the LM head). A subclass packs the weight (``_pack``: its buffers, in order)
    and runs its kernel (``_linear``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        codes: _Codes | None = None,
    ) -> None:
        """``codes``: the format's codes, taken as they are instead of quantizing ``weight``
        (which may then be a meta tensor: only its shape and dtype are read)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype, self.weight_dtype = out_dtype, weight.dtype
        if codes is not None and tuple(codes[0].shape) != self._codes_shape():
            raise ValueError(f"codes {tuple(codes[0].shape)} do not fit a {tuple(weight.shape)} weight")
        for name, buffer in self._pack(weight, codes).items():
            self.register_buffer(name, buffer)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def _codes_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _pack(self, weight: torch.Tensor, codes: _Codes | None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, out] out_dtype
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        return self._linear(x.reshape(-1, self.in_features)).view(*lead, self.out_features)


class Int8Linear(_QuantizedLinear):
    """A linear layer over int8 weights with per-output-feature float32 scales.

    ``codes``: ``(q, scale)`` as :func:`~specdec.kernels.cpu_int8.quantize_int8` returns them
    (rows of another int8 layer)."""

    def _codes_shape(self) -> tuple[int, ...]:
        return (self.out_features, self.in_features)

    def _pack(self, weight: torch.Tensor, codes: _Codes | None) -> dict[str, torch.Tensor]:
        if codes is not None:
            packed, scale = pack_int8(*codes)
        elif weight.device.type == "meta":  # a shell for load_state_dict(assign=True)
            panels, groups = -(-self.out_features // FEATURES), -(-self.in_features // GROUP)
            packed = torch.empty(panels, groups, 256, dtype=torch.int8, device="meta")
            scale = torch.empty(panels * FEATURES, dtype=torch.float32, device="meta")
        else:
            packed, scale = pack_int8(*quantize_int8(weight))
        # packed: [ceil(out/8), ceil(in/32), 256] int8; scale: [ceil(out/8) * 8] float32
        return {"packed": packed, "scale": scale}

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.packed, self.scale, self.out_features, self.bias, self.out_dtype)

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        q = unpack_int8(self.packed, self.out_features, self.in_features)
        return q.float() * self.scale[: self.out_features, None]


class Q4Linear(_QuantizedLinear):
    """A linear layer over 4-bit weights (groups of 32 inputs, float16 scale and offset).

    ``codes``: ``(q, d, c)`` as :func:`~specdec.kernels.cpu_q4.quantize_q4` returns them (a GGUF
    file's 4-bit blocks, rows of another q4 layer)."""

    def _codes_shape(self) -> tuple[int, ...]:
        return (self.out_features, -(-self.in_features // GROUP), GROUP)

    def _pack(self, weight: torch.Tensor, codes: _Codes | None) -> dict[str, torch.Tensor]:
        if codes is not None:
            packed = pack_q4(*codes)
        elif weight.device.type == "meta":  # a shell for load_state_dict(assign=True)
            shape = (-(-self.out_features // FEATURES), -(-self.in_features // GROUP), BLOCK_BYTES)
            packed = torch.empty(shape, dtype=torch.uint8, device="meta")
        else:  # chunks of whole panels: the same bytes as one call, less float32 scratch
            packed = torch.cat([
                pack_q4(*quantize_q4(weight[r : r + _Q4_CHUNK_ROWS]))
                for r in range(0, self.out_features, _Q4_CHUNK_ROWS)
            ])  # fmt: skip
        return {"packed": packed}  # [ceil(out/8), ceil(in/32), 160] uint8

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return q4_linear(x, self.packed, self.out_features, self.bias, self.out_dtype)

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        return dequantize_q4(*unpack_q4(self.packed, self.out_features), self.in_features)


_CLASSES = {"int8": Int8Linear, "q4": Q4Linear}


def quantize_linears(
    model: nn.Module,
    quantization: str = "int8",
    codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` and :class:`PackedLinear` (LM head included) by an
    :class:`Int8Linear` or a :class:`Q4Linear`, in place; the input embedding is left as it is
    (one row of it is read per token). ``codes``: q4 codes to take as they are, by module name
    (see :mod:`specdec.models.gguf_q4`)."""
    check_quantization(quantization, "cpu")
    cls = _CLASSES[quantization]
    codes = codes or {}
    for name, module in parent_modules(model):  # replaced layers freed as the loop goes
        for child_name, child in list(module.named_children()):
            if isinstance(child, (nn.Linear, PackedLinear)):
                weight, bias = linear_weights(child)
                is_head = f"{name}.{child_name}".lstrip(".") == "lm_head"
                dtype = weight.dtype if isinstance(child, nn.Linear) else child.out_dtype
                out_dtype = torch.float32 if is_head else dtype
                given = codes.get(f"{name}.{child_name}".lstrip("."))
                if given is not None and quantization != "q4":
                    raise ValueError("codes are q4 codes; quantization must be 'q4'")
                layer = cls(weight, bias, out_dtype) if given is None else Q4Linear(weight, bias, out_dtype, given)
                setattr(module, child_name, layer)
    return model
