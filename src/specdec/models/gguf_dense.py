"""GGUF files read densely (the ``[gguf]`` extra).

The loader (:func:`specdec.models.loading.load_model` on a ``.gguf`` file) takes the tensors of
its one parse of the file (:class:`~specdec.models.gguf_file.GgufFile`) through
:func:`gguf_state`: Hugging Face names and row order, dequantized to float32 one tensor at a
time. The fetcher (:func:`specdec.hub.convert_gguf`) writes a Hugging Face directory, so it
reads the file through transformers' GGUF reader (:func:`read_gguf_model`). Both live here,
apart from the loader and the fetcher, so neither has to import the other (the loader already
turns known names into paths through the hub). ``quantization="q4"`` reads a GGUF differently,
keeping its codes (:mod:`specdec.models.gguf_q4`).

Example::

    state = dict(gguf_state(GgufFile.read(Path("model.gguf"))))   # HF names -> float32
    model = read_gguf_model(Path("model.gguf"), torch.bfloat16)   # a transformers model
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from specdec.models.gguf_file import GgufFile, hf_row_order

__all__ = ["gguf_load_kwargs", "gguf_state", "hf_name", "read_gguf_model"]

# llama.cpp's names -> Hugging Face's: top-level modules, and the modules inside each ``blk.N``.
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's blocks (llama.cpp's gemma2 and gemma3): four norms, ffn_norm the one before the MLP.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# OLMo 2's blocks (llama.cpp's olmo2): no norm before the attention or the MLP, one after each,
# and q/k norms over whole projections.
_OLMO2_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if not k.endswith("_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Phi-3's blocks (llama.cpp's phi3): q/k/v fused in attn_qkv, gate and up in ffn_up, as in the
# Hugging Face checkpoint (and specdec's own layers).
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Qwen3's blocks (llama.cpp's qwen3): Llama's plus the per-head q/k norms (weights of head_dim).
_QWEN3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Qwen3-MoE's blocks (llama.cpp's qwen3moe): Qwen3's, with the router and the experts stacked in
# 3-D tensors (experts first in PyTorch order), split per expert by the loader
# (specdec.models.qwen3_moe.unstack_experts).
_QWEN3MOE_BLOCK_NAMES = {
    **_QWEN3_BLOCK_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_FAMILY_BLOCK_NAMES = {
    "gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES, "olmo2": _OLMO2_BLOCK_NAMES, "phi3": _PHI3_BLOCK_NAMES,
    "qwen3": _QWEN3_BLOCK_NAMES, "qwen3moe": _QWEN3MOE_BLOCK_NAMES,
}  # fmt: skip
# Tensors a Hugging Face model has no place for: Llama 3's RoPE frequency factors (transformers'
# GGUF reader drops them too; the rotary frequencies come from the config) and Phi-3's longrope
# factors (read into the config: GgufFile.config_dict).
_DROPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight`` (``architecture``:
    the file's, which decides Gemma's, OLMo 2's and Qwen3's norm names); a name of neither table
    comes back as it is (the model's loader then reports it as unexpected).

    >>> hf_name("blk.3.ffn_down.weight"), hf_name("output_norm.weight")
    ('model.layers.3.mlp.down_proj.weight', 'model.norm.weight')
    >>> hf_name("blk.0.ffn_norm.weight", "gemma3")
    'model.layers.0.pre_feedforward_layernorm.weight'
    >>> hf_name("blk.0.post_ffw_norm.weight", "olmo2")
    'model.layers.0.post_feedforward_layernorm.weight'
    >>> hf_name("blk.1.attn_k_norm.weight", "qwen3")
    'model.layers.1.self_attn.k_norm.weight'
    """
    blocks = _FAMILY_BLOCK_NAMES.get(architecture, _BLOCK_NAMES)
    module, _, leaf = gguf_name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{leaf}"
    block = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if block is not None and block.group(2) in blocks:
        return f"model.layers.{block.group(1)}.{blocks[block.group(2)]}.{leaf}"
    return gguf_name


def gguf_state(file: GgufFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``file`` by Hugging Face name, dequantized to float32, one at a time (as
    :func:`specdec.models.loading.model_from_state_dict` takes them), with Llama's q/k rows
    (weights and biases) back in Hugging Face order and Gemma's norm weights back to ``w``."""
    config = file.config_dict()
    heads = {
        ".attn_q.": config.get("num_attention_heads"),
        ".attn_k.": config.get("num_key_value_heads"),
    }
    for name, tensor in file.tensors.items():
        if name in _DROPPED:
            continue
        values = tensor.values()
        part = next((p for p in heads if p in name), None)
        if file.permutes_qk and part is not None:
            n_heads = heads[part] or config["num_attention_heads"]  # no head_count_kv: MHA
            values = values[hf_row_order(values.shape[0], int(n_heads))]
        if file.norm_shift and name.endswith("norm.weight"):
            values = values - file.norm_shift
        yield hf_name(name, file.architecture), values


def read_gguf_model(path: Path, dtype: torch.dtype) -> object:
    """The transformers causal-LM model of the GGUF file ``path``, dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **gguf_load_kwargs(dtype)
    )


def gguf_load_kwargs(dtype: torch.dtype) -> dict[str, object]:
    """``from_pretrained`` arguments that read a GGUF file into plain dense ``dtype`` weights.

    Newer transformers keep GGUF weights packed in their quantized blocks (such a model has no
    plain state dict and refuses ``save_pretrained``); ``GgufConfig(dequantize=True)`` asks for
    dense weights, which is what older versions always produced (they have no GgufConfig).
    """
    import transformers

    kwargs: dict[str, object] = {_dtype_kwarg(transformers.__version__): dtype}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    return kwargs


def _dtype_kwarg(version: str) -> str:
    """``transformers`` renamed ``torch_dtype`` to ``dtype`` in 4.56 (the old name warns in 5.x)."""
    major, minor = (int(p) for p in re.findall(r"\d+", version)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
