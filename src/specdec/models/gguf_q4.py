"""4-bit codes taken from a GGUF file as they are, for ``load_model(x.gguf, quantization="q4")``.

A GGUF tensor in Q4_0, Q4_1 or Q4_K is already what specdec's q4 format holds: codes 0..15 in
groups of 32 inputs with one scale and one offset per group (``w = d * q + c``):

- Q4_0 (blocks of 32): ``w = d * (q - 8)``, so ``c = -8 d``.
- Q4_1 (blocks of 32): ``w = d * q + m``.
- Q4_K (super-blocks of 256 = 8 groups of 32): ``w = (d * sc_j) * q - dmin * m_j`` with 6-bit
  ``sc_j``, ``m_j`` per group; the products are rounded to float16 (a relative error of at most
  2^-11 on a group's scale and offset, far below the 4-bit step).

Those tensors keep the file's codes (re-quantizing their dequantized values would move some
codes by one step); every other type (Q6_K, Q8_0, F16...) is quantized from its dequantized
weights by :func:`specdec.kernels.cpu_q4.quantize_q4`, and the loader says which.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from specdec.kernels.cpu_q4 import quantize_q4
from specdec.models.llama import Architecture, ModelConfig

__all__ = ["Q4Codes", "gguf_q4_codes", "module_q4_codes"]

Q4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [out, G, 32] uint8, d, c [out, G] f16

# llama.cpp's tensor names inside ``blk.N``, per (module, part) of specdec's fused layers.
_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # [n, 18] uint8
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # weight j: low nibble, j + 16: high
    return q, d, (-8 * d.astype(np.float32)).astype(np.float16)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # [n, 20] uint8
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16)[:, 0]
    qs = blocks[:, 4:]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1), d, m


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # [n, 144] uint8
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n * 8, 32)  # group 2l: low nibbles of bytes 32l.., 2l + 1: high
    scale = (d * sc.astype(np.float32)).astype(np.float16).reshape(-1)
    offset = (-(dmin * m.astype(np.float32))).astype(np.float16).reshape(-1)
    return q, scale, offset


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def gguf_q4_codes(path: str | Path) -> dict[str, Q4Codes]:
    """The 4-bit tensors of a GGUF file as q4 codes, by GGUF tensor name (others are absent)."""
    from gguf import GGUFReader

    out: dict[str, Q4Codes] = {}
    for t in GGUFReader(str(path)).tensors:
        decode = _DECODERS.get(t.tensor_type.name)
        if decode is None or len(t.shape) != 2:
            continue
        cols, rows = (int(s) for s in t.shape)  # GGUF lists the fastest dimension first
        blocks = np.ascontiguousarray(t.data).reshape(rows * cols // _block_size(t.tensor_type.name), -1)
        q, d, c = decode(blocks)
        groups = cols // 32
        out[t.name] = (
            torch.from_numpy(np.ascontiguousarray(q)).view(rows, groups, 32),
            torch.from_numpy(np.ascontiguousarray(d)).view(rows, groups),
            torch.from_numpy(np.ascontiguousarray(c)).view(rows, groups),
        )
    return out


def _block_size(type_name: str) -> int:
    return 256 if type_name.endswith("_K") else 32


def _reverse_permute_rows(codes: Q4Codes, heads: int) -> Q4Codes:
    """Undo llama.cpp's q/k row order for Llama (its RoPE pairs adjacent rows): the rows the
    Hugging Face layout (and specdec) has, for per-row codes."""
    rows = codes[0].shape[0]
    order = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    inverse = torch.argsort(order)
    return tuple(part[inverse] for part in codes)  # type: ignore[return-value]


def module_q4_codes(
    cfg: ModelConfig, model: torch.nn.Module, file_codes: Mapping[str, Q4Codes]
) -> tuple[dict[str, Q4Codes], list[str], list[str]]:
    """q4 codes for every linear module of ``model`` (specdec names, fused parts joined): the
    file's where it has them, the quantized dequantized weight elsewhere. Returns ``(codes,
    adopted GGUF names, re-quantized GGUF names)``."""
    codes: dict[str, Q4Codes] = {}
    adopted: list[str] = []
    requantized: list[str] = []
    for i in range(cfg.num_layers):
        layer = model.layers[i]
        for module_name, parts in _PARTS.items():
            module = layer.get_submodule(module_name)
            weight = module.weight.detach()
            sizes = _part_sizes(cfg, parts, weight.shape[0])
            pieces, start = [], 0
            for part, size in zip(parts, sizes):
                gguf_name = f"blk.{i}.{part}.weight"
                found = file_codes.get(gguf_name)
                if found is not None and found[0].shape[0] == size and found[0].shape[1] * 32 == weight.shape[1]:
                    if cfg.architecture == Architecture.LLAMA and part in ("attn_q", "attn_k"):
                        heads = cfg.num_heads if part == "attn_q" else cfg.num_kv_heads
                        found = _reverse_permute_rows(found, heads)
                    pieces.append(found)
                    adopted.append(gguf_name)
                else:
                    pieces.append(quantize_q4(weight[start : start + size]))
                    requantized.append(gguf_name)
                start += size
            codes[f"layers.{i}.{module_name}"] = tuple(torch.cat(p) for p in zip(*pieces))  # type: ignore[assignment]
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    found = file_codes.get(head)
    if found is not None and found[0].shape[0] == model.lm_head.weight.shape[0]:
        codes["lm_head"] = found
        adopted.append(head)
    else:
        requantized.append(head)
    return codes, adopted, requantized


def _part_sizes(cfg: ModelConfig, parts: tuple[str, ...], rows: int) -> list[int]:
    if parts[0] == "attn_q":
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    return [rows // len(parts)] * len(parts)
