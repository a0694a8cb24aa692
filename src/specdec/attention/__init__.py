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


def default_backend(device: str | object = "cpu", dtype: torch.dtype | None = None) -> object:
    """The attention backend for ``device``: the float32 kernel on CPUs (it is the torch
    reference where the kernel does not apply: not built, float64); on CUDA FlashInfer for
    half-precision models when it is installed (the ``[gpu]`` extra), else the reference."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuAttentionBackend()
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        from specdec.attention.flashinfer_backend import FlashInferBackend

        try:
            return FlashInferBackend(device, dtype)
        except ImportError:
            pass
    return TorchAttentionBackend()
