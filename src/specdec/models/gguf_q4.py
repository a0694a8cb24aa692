"""``load_model(x.gguf, quantization="q4")``: a q4 model read from a GGUF file tensor by tensor.

:func:`load_gguf_q4` builds the q4 model on the meta device and assigns it the file's tensors one
at a time (the dense model is never built: for a 1.5B model that would be 3+ GB of bfloat16 at
peak). Its 4-bit tensors keep their codes as they are.

A GGUF tensor in Q4_0, Q4_1 or Q4_K is already what specdec's q4 format holds: codes 0..15 in
groups of 32 inputs with one scale and one offset per group (``w = d * q + c``):

- Q4_0 (blocks of 32): ``w = d * (q - 8)``, so ``c = -8 d``.
- Q4_1 (blocks of 32): ``w = d * q + m``.
- Q4_K (super-blocks of 256 = 8 groups of 32): ``w = (d * sc_j) * q - dmin * m_j`` with 6-bit
  ``sc_j``, ``m_j`` per group; the products are rounded to float16 (a relative error of at most
  2^-11 on a group's scale and offset, far below the 4-bit step).

Those tensors keep the file's codes (re-quantizing their dequantized values would move some
codes by one step); every other type (Q6_K, Q8_0, F16...) is dequantized, rounded to the model's
dtype (the values a dense load would hold) and quantized by
:func:`specdec.kernels.cpu_q4.quantize_q4`, and the loader warns naming which. For Llama, the q/k
rows llama.cpp permutes for its RoPE are put back in Hugging Face order, as transformers' GGUF
reader does; for Phi-3 (``attn_qkv`` and ``ffn_up`` already fused as specdec's layers are),
the q/k rows under partial RoPE go in specdec's channel order (:mod:`specdec.models.phi3`), as a
dense load puts them. Norms, biases and the input embedding are dequantized (Gemma's norms, which
llama.cpp stores as ``1 + w``, back to ``w``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from specdec.kernels.cpu_q4 import pack_q4, quantize_q4
from specdec.models import phi3
from specdec.models.gguf_dense import hf_name
from specdec.models.gguf_file import GgufFile, hf_row_order
from specdec.models.llama import LlamaModel, ModelConfig
from specdec.models.quantized import quantize_linears

__all__ = ["Q4Codes", "load_gguf_q4"]

Q4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [out, G, 32] uint8, d, c [out, G] f16

_CHUNK_ROWS = 4096  # rows dequantized or decoded at once: bounds the scratch of a large head

# llama.cpp's tensor names inside ``blk.N``, per (module, part) of specdec's fused layers.
_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
# Phi-3's (llama.cpp's phi3): q/k/v fused in attn_qkv and gate/up in ffn_up, as specdec's are.
_PHI3_PARTS = {**_PARTS, "self_attn.qkv_proj": ("attn_qkv",), "mlp.gate_up_proj": ("ffn_up",)}


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


def _reverse_permute_rows(codes: Q4Codes, heads: int) -> Q4Codes:
    """Undo llama.cpp's q/k row order for Llama (its RoPE pairs adjacent rows): the rows the
    Hugging Face layout (and specdec) has, for per-row codes."""
    inverse = hf_row_order(codes[0].shape[0], heads)
    return tuple(part[inverse] for part in codes)  # type: ignore[return-value]


def load_gguf_q4(file: GgufFile, dtype: torch.dtype) -> tuple[LlamaModel, object]:
    """A q4 model read from a GGUF file (parsed once, ``file``) tensor by tensor:
    ``(model, hf_config)``.

    The model is a q4 skeleton on the meta device whose state is assigned from the file: each
    linear layer's packed codes (the file's own for Q4_0/Q4_1/Q4_K parts, the quantized
    dequantized weight otherwise), biases in float32, norms and input embedding in ``dtype``.
    At most one dense tensor exists at a time (a chunk of rows of a large one), never the
    whole dense model. Warns naming the tensors quantized anew."""
    hf_config = file.hf_config()
    cfg = ModelConfig.from_hf_config(hf_config)
    if cfg.moe is not None:  # its experts are 3-D tensors, whose codes are not split per expert here
        raise ValueError(
            f"{file.path.name}: quantization='q4' straight from a GGUF file is not implemented for "
            "qwen3moe (Qwen3-MoE) files; load it densely (quantization=None), or quantized from "
            "the dense load with quantization='int8'"
        )
    with torch.device("meta"):
        model = LlamaModel(cfg).to(dtype)
        quantize_linears(model, "q4")
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    state, adopted, requantized = _q4_state(cfg, file, expected, dtype)
    _check_state(file.path, state, expected)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope()
    if requantized:
        kinds = sorted({re.sub(r"^blk\.\d+\.|\.weight$", "", n) for n in requantized})
        warnings.warn(
            f"{file.path.name}: q4 kept the file's 4-bit codes of {len(adopted)} tensors and quantized "
            f"{len(requantized)} others ({', '.join(kinds)}) from their dequantized weights",
            stacklevel=3,  # the caller of load_model
        )
    return model.eval().requires_grad_(False), hf_config


def _q4_state(
    cfg: ModelConfig,
    file: GgufFile,
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The q4 skeleton's state by specdec name, read from the file, with ``(adopted,
    re-quantized)`` GGUF names of the linear weights."""
    state: dict[str, torch.Tensor] = {}
    adopted: list[str] = []
    requantized: list[str] = []

    def linear(module: str, names: list[str]) -> None:
        groups = expected[f"{module}.packed"][0][1]
        sizes = _part_sizes(cfg, names)
        orders = [_row_order(cfg, file, n, size) for n, size in zip(names, sizes)]
        codes, own = zip(*(
            _part_codes(file.tensor(n), size, groups, o, dtype) for n, size, o in zip(names, sizes, orders)
        ))  # fmt: skip
        state[f"{module}.packed"] = pack_q4(*(torch.cat(p) for p in zip(*codes)))
        for name, kept in zip(names, own):
            (adopted if kept else requantized).append(name)
        if f"{module}.bias" in expected:  # the model's dtype first: as a dense load rounds it
            bias = [_vector(file.tensor(n.replace(".weight", ".bias")), o) for n, o in zip(names, orders)]
            state[f"{module}.bias"] = torch.cat(bias).to(dtype).float()

    for i in range(cfg.num_layers):
        for module, parts in (_PHI3_PARTS if file.architecture == "phi3" else _PARTS).items():
            linear(f"layers.{i}.{module}", [f"blk.{i}.{part}.weight" for part in parts])
    for name, tensor in file.tensors.items():  # every norm: 2 a layer (Gemma: 4), q/k norms
        if name.endswith("norm.weight"):
            values = _vector(tensor) - file.norm_shift  # Gemma's are stored as 1 + w
            state[hf_name(name, file.architecture).removeprefix("model.")] = values.to(dtype)
    linear("lm_head", ["token_embd.weight" if cfg.tie_word_embeddings else "output.weight"])
    state["embed_tokens.weight"] = _embedding(file.tensor("token_embd.weight"), dtype)
    return state, adopted, requantized


def _check_state(path: Path, state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple]) -> None:
    """Raise naming ``path`` where the state read does not fit the skeleton of its config."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(
        f"{name} {tuple(state[name].shape)} {state[name].dtype} != {expected[name][0]} {expected[name][1]}"
        for name in set(expected) & set(state)
        if (tuple(state[name].shape), state[name].dtype) != expected[name]
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"{path.name} does not match the q4 model of its config: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, wrong shape or dtype (file != config) {wrong[:5]}"
        )


def _part_sizes(cfg: ModelConfig, names: list[str]) -> list[int]:
    """Rows of each GGUF part (``names``) of one of specdec's linear modules, by the config."""
    if ".attn_qkv." in names[0]:  # Phi-3's fused q/k/v; its ffn_up holds gate and up
        return [(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim]
    if ".ffn_up." in names[0]:
        return [2 * cfg.intermediate_size]
    if ".attn_q." in names[0]:
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    if ".ffn_gate." in names[0]:
        return [cfg.intermediate_size] * 2
    if ".attn_output." in names[0] or ".ffn_down." in names[0]:
        return [cfg.hidden_size]
    return [cfg.vocab_size]


def _row_order(cfg: ModelConfig, file: GgufFile, gguf_name: str, rows: int) -> torch.Tensor | None:
    """The file rows of a tensor's ``rows`` specdec rows (the q/k and their biases of a file
    llama.cpp wrote as "llama", Mistral's included; Phi-3's attn_qkv under partial RoPE,
    :func:`~specdec.models.phi3.qkv_row_order`), or ``None`` where the file already has
    specdec's order."""
    if cfg.phi3 is not None and ".attn_qkv." in gguf_name:
        return phi3.qkv_row_order(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.phi3.rotary_dim)
    if not file.permutes_qk or not re.search(r"\.attn_[qk]\.", gguf_name):
        return None
    return hf_row_order(rows, cfg.num_heads if ".attn_q." in gguf_name else cfg.num_kv_heads)


def _matrix_rows(tensor) -> np.ndarray:  # [rows, bytes per row] uint8, a view of the file
    rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    return tensor.data.reshape(rows, -1)


def _row_chunks(rows: int, order: torch.Tensor | None) -> list[slice | np.ndarray]:
    """File-row selections of ``_CHUNK_ROWS`` specdec rows each, in specdec's order."""
    chunks = [slice(r, min(r + _CHUNK_ROWS, rows)) for r in range(0, rows, _CHUNK_ROWS)]
    return chunks if order is None else [order[c].numpy() for c in chunks]


def _part_codes(
    tensor, rows: int, groups: int, order: torch.Tensor | None, dtype: torch.dtype
) -> tuple[Q4Codes, bool]:
    """One GGUF matrix as q4 codes ``(q [rows, G, 32], d, c [rows, G])`` in specdec's row order,
    and whether they are the file's own (its type is 4-bit) rather than quantized anew."""
    from gguf import GGML_QUANT_SIZES

    if len(tensor.shape) != 2 or (-(-int(tensor.shape[0]) // 32), int(tensor.shape[1])) != (groups, rows):
        raise ValueError(
            f"GGUF tensor {tensor.name} has shape {tuple(int(s) for s in reversed(tensor.shape))}, "
            f"its config wants {rows} rows of {groups} groups of 32 inputs"
        )
    cols = int(tensor.shape[0])
    raw = _matrix_rows(tensor)
    decode = _DECODERS.get(tensor.tensor_type.name)
    chunks: list[Q4Codes] = []
    for rows_sel in _row_chunks(rows, order):
        if decode is None:  # the model's dtype first: the values a dense load would quantize
            chunks.append(quantize_q4(_dequantized(tensor, raw[rows_sel]).to(dtype)))
            continue
        blocks = np.ascontiguousarray(raw[rows_sel])
        n = blocks.shape[0]
        q, d, c = decode(blocks.reshape(-1, GGML_QUANT_SIZES[tensor.tensor_type][1]))
        chunks.append((
            torch.from_numpy(np.ascontiguousarray(q)).view(n, cols // 32, 32),
            torch.from_numpy(np.ascontiguousarray(d)).view(n, cols // 32),
            torch.from_numpy(np.ascontiguousarray(c)).view(n, cols // 32),
        ))  # fmt: skip
    return tuple(torch.cat(p) for p in zip(*chunks)), decode is not None  # type: ignore[return-value]


def _dequantized(tensor, raw_rows: np.ndarray) -> torch.Tensor:
    """Some rows of a GGUF matrix (``[n, bytes per row]`` as stored) -> ``[n, cols]`` float32."""
    from gguf.quants import dequantize

    values = dequantize(np.ascontiguousarray(raw_rows), tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).view(raw_rows.shape[0], -1)


def _vector(tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """A 1-D GGUF tensor (norm, bias) as ``[n]`` float32, in specdec's order."""
    values = _dequantized(tensor, _matrix_rows(tensor)).view(-1)
    return values if order is None else values[order]


def _embedding(tensor, dtype: torch.dtype) -> torch.Tensor:
    """``token_embd.weight`` as ``[vocab, hidden]`` ``dtype``, dequantized a chunk of rows at a time."""
    cols, rows = (int(s) for s in tensor.shape)
    raw, out = _matrix_rows(tensor), torch.empty(rows, cols, dtype=dtype)
    for chunk in _row_chunks(rows, None):
        out[chunk] = _dequantized(tensor, raw[chunk])
    return out
