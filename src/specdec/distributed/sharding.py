"""Megatron-style sharding of a Llama-family decoder over a tensor-parallel group.

Rank ``r`` of ``n`` holds, in every decoder layer, the query heads ``r * Hq/n ..`` and the KV
heads ``r * Hkv/n ..`` (so each query head keeps its KV group), the rows of q/k/v and of
gate/up for those heads and for its ``I/n`` slice of the MLP (column parallel), and the matching
columns of o_proj and down_proj (row parallel: their partial products are summed across the
group by one all-reduce each, see :class:`~specdec.distributed.layers.RowParallelLinear`). The
embedding, the norms and the LM head are replicated. A row-parallel bias is added once, on rank 0.

Weights are read from safetensors slice by slice (``safe_open(...).get_slice``), so no rank
ever holds more than its own share of a layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

from specdec.models.llama import ModelConfig

__all__ = ["check_shardable", "shard_config", "shard_slice", "read_shard"]

# HF parameter name (without the "model." prefix) -> how it is split: ("rows", part) slices
# the output features of a column-parallel projection, ("cols", None) the input features of a
# row-parallel one. Unlisted tensors are replicated.
_SPLITS = (
    (re.compile(r"layers\.\d+\.self_attn\.q_proj\.(weight|bias)$"), "rows", "q"),
    (re.compile(r"layers\.\d+\.self_attn\.[kv]_proj\.(weight|bias)$"), "rows", "kv"),
    (re.compile(r"layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)$"), "rows", "mlp"),
    (re.compile(r"layers\.\d+\.self_attn\.o_proj\.weight$"), "cols", "q"),
    (re.compile(r"layers\.\d+\.mlp\.down_proj\.weight$"), "cols", "mlp"),
    (re.compile(r"layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.bias$"), "once", None),
)


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """ValueError naming ``tensor_parallel_size`` unless the heads and the MLP width divide
    (and for Gemma models, whose vocab-parallel logits would miss the soft cap, and OLMo 2
    models, whose q/k norms span every head: not sharded)."""
    if (cfg.gemma is not None or cfg.olmo2) and world_size > 1:
        family = "OLMo 2" if cfg.olmo2 else "Gemma"
        raise ValueError(
            f"tensor_parallel_size={world_size}: tensor parallelism is not implemented for "
            f"{cfg.architecture.value} ({family}) models; use tensor_parallel_size=1"
        )
    if cfg.moe is not None and world_size > 1:  # read_shard slices dense MLPs only
        raise ValueError(
            f"tensor_parallel_size={world_size}: tensor parallelism is not implemented for "
            "qwen3_moe (Qwen3-MoE) models, whose experts are not sharded; use tensor_parallel_size=1"
        )
    if cfg.phi3 is not None and world_size > 1:  # read_shard slices q/k/v and gate/up by name
        raise ValueError(
            f"tensor_parallel_size={world_size}: tensor parallelism is not implemented for phi3 "
            "(Phi-3) models, whose checkpoints fuse q/k/v and gate/up; use tensor_parallel_size=1"
        )
    counts = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "MLP intermediate size": cfg.intermediate_size,
    }
    bad = {name: n for name, n in counts.items() if n % world_size}
    if bad:
        listed = ", ".join(f"{n} {name}" for name, n in bad.items())
        raise ValueError(
            f"tensor_parallel_size={world_size} must divide the model's attention heads, KV heads "
            f"and MLP intermediate size; this model has {listed}"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The decoder-layer shape one rank holds: ``1/world_size`` of the heads and MLP width.

    Example:
        >>> shard_config(cfg, 2).num_kv_heads == cfg.num_kv_heads // 2
        True
    """
    check_shardable(cfg, world_size)
    return attrs.evolve(
        cfg,
        num_heads=cfg.num_heads // world_size,
        num_kv_heads=cfg.num_kv_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


def shard_slice(name: str, cfg: ModelConfig, rank: int, world_size: int) -> tuple[str, slice | None]:
    """How rank ``rank`` reads HF tensor ``name``: ``(axis, slice)`` with axis ``"rows"``
    (dim 0), ``"cols"`` (dim 1), ``"once"`` (whole on rank 0, zeros elsewhere) or ``"all"``
    (replicated, slice ``None``).

    Example:
        >>> shard_slice("layers.0.self_attn.k_proj.weight", cfg, 1, 2)   # Hkv = 2, D = 64
        ('rows', slice(64, 128, None))
    """
    width = {
        "q": cfg.num_heads * cfg.head_dim,
        "kv": cfg.num_kv_heads * cfg.head_dim,
        "mlp": cfg.intermediate_size,
    }
    for pattern, axis, part in _SPLITS:
        if pattern.search(name):
            if part is None:
                return axis, None
            size = width[part] // world_size
            return axis, slice(rank * size, (rank + 1) * size)
    return "all", None


def read_shard(
    files: list[Path], cfg: ModelConfig, rank: int, world_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, this rank's part)`` for every tensor of the checkpoint ``files``,
    reading only that part from disk."""
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for raw_name in handle.keys():
                    axis, part = shard_slice(raw_name.removeprefix("model."), cfg, rank, world_size)
                    if axis == "rows":
                        yield raw_name, handle.get_slice(raw_name)[part]
                    elif axis == "cols":
                        yield raw_name, handle.get_slice(raw_name)[:, part]
                    elif axis == "once" and rank != 0:
                        yield raw_name, torch.zeros_like(handle.get_tensor(raw_name))
                    else:
                        yield raw_name, handle.get_tensor(raw_name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"corrupt or unreadable checkpoint file {str(f)!r}: {err}") from err
