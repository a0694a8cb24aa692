"""Paged attention: plan records and backends (pure PyTorch reference; a batch-invariant
float32 kernel on CPUs; FlashInfer on CUDA)."""

import torch

from specdec.attention.cpu_backend import CpuAttentionBackend, CpuAttentionPlan
from specdec.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan

__all__ = [
    "CpuAttentionBackend",
    "CpuAttentionPlan",
    "TorchAttentionBackend",
    "TorchAttentionPlan",
    "default_backend",
]


def default_backend(device: str | object = "cpu") -> object:
    """The attention backend for ``device``: the float32 kernel on CPUs (it is the torch
    reference where the kernel does not apply: not built, float64), the reference elsewhere."""
    if torch.device(device).type == "cpu":
        return CpuAttentionBackend()
    return TorchAttentionBackend()
