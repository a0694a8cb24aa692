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
from specdec.models.packed import PackedLinear, linear_weights

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


def check_quantization(quantization: str | None, device: str | torch.device) -> None:
    """The ``quantization`` argument: ``None``, ``"int8"`` or ``"q4"``, on the CPU only."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'int8' or 'q4', got {quantization!r}")
    if quantization is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on the CPU only, got device={device!r}"
        )


class Int8Linear(nn.Module):
    """A linear layer over int8 weights with per-output-feature float32 scales.

    ``out_dtype``: the model's dtype for hidden layers, float32 for the LM head."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``codes``: ``(q, scale)`` as :func:`~specdec.kernels.cpu_int8.quantize_int8` returns
        them, taken as they are (rows of another int8 layer) instead of quantizing ``weight``
        (which may then be a meta tensor: only its shape and dtype are read)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype, self.weight_dtype = out_dtype, weight.dtype
        if codes is not None:
            if tuple(codes[0].shape) != tuple(weight.shape):
                raise ValueError(f"codes {tuple(codes[0].shape)} do not fit a {tuple(weight.shape)} weight")
            packed, scale = pack_int8(*codes)
        elif weight.device.type == "meta":  # a shell for load_state_dict(assign=True)
            panels, groups = -(-self.out_features // FEATURES), -(-self.in_features // GROUP)
            packed = torch.empty(panels, groups, 256, dtype=torch.int8, device="meta")
            scale = torch.empty(panels * FEATURES, dtype=torch.float32, device="meta")
        else:
            packed, scale = pack_int8(*quantize_int8(weight))
        self.register_buffer("packed", packed)  # [ceil(out/8), ceil(in/32), 256] int8
        self.register_buffer("scale", scale)  # [ceil(out/8) * 8] float32
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        out = int8_linear(
            x.reshape(-1, self.in_features), self.packed, self.scale, self.out_features,
            self.bias, self.out_dtype,
        )  # fmt: skip
        return out.view(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        q = unpack_int8(self.packed, self.out_features, self.in_features)
        return q.float() * self.scale[: self.out_features, None]


class Q4Linear(nn.Module):
    """A linear layer over 4-bit weights (groups of 32 inputs, float16 scale and offset).

    ``out_dtype``: the model's dtype for hidden layers, float32 for the LM head."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``codes``: ``(q, d, c)`` as :func:`~specdec.kernels.cpu_q4.quantize_q4` returns them,
        taken as they are (a GGUF file's 4-bit blocks, rows of another q4 layer) instead of
        quantizing ``weight`` (which may then be a meta tensor)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype, self.weight_dtype = out_dtype, weight.dtype
        if codes is not None:
            groups = -(-self.in_features // GROUP)
            if tuple(codes[0].shape) != (self.out_features, groups, GROUP):
                raise ValueError(f"codes {tuple(codes[0].shape)} do not fit a {tuple(weight.shape)} weight")
            packed = pack_q4(*codes)
        elif weight.device.type == "meta":  # a shell for load_state_dict(assign=True)
            shape = (-(-self.out_features // FEATURES), -(-self.in_features // GROUP), BLOCK_BYTES)
            packed = torch.empty(shape, dtype=torch.uint8, device="meta")
        else:  # chunks of whole panels: the same bytes as one call, less float32 scratch
            packed = torch.cat([
                pack_q4(*quantize_q4(weight[r : r + _Q4_CHUNK_ROWS]))
                for r in range(0, self.out_features, _Q4_CHUNK_ROWS)
            ])  # fmt: skip
        self.register_buffer("packed", packed)  # [ceil(out/8), ceil(in/32), 160] uint8
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        lead = x.shape[:-1]
        out = q4_linear(
            x.reshape(-1, self.in_features),
            self.packed,
            self.out_features,
            self.bias,
            self.out_dtype,
        )
        return out.view(*lead, self.out_features)

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
    for name, module in list(model.named_modules()):
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
