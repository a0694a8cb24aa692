"""Paged attention: the plan record and backends (pure PyTorch reference; FlashInfer on CUDA)."""

from specdec.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan

__all__ = ["TorchAttentionBackend", "TorchAttentionPlan", "default_backend"]


def default_backend(device: str | object = "cpu") -> object:
    """The attention backend for ``device``: the torch reference everywhere for now."""
    return TorchAttentionBackend()
