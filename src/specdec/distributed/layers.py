"""The one layer tensor parallelism adds: a row-parallel projection summed across the group."""

from __future__ import annotations

import torch
from torch import nn

from specdec.distributed.group import TensorParallelGroup

__all__ = ["RowParallelLinear", "VocabParallelHead", "float32_output"]


def float32_output(linear: nn.Module) -> None:
    """Make a packed linear (:class:`~specdec.models.packed.PackedLinear`) return float32, so
    partial sums and logits are not rounded to bf16 first; other linears are left as they are."""
    if hasattr(linear, "out_dtype"):
        linear.out_dtype = torch.float32


class RowParallelLinear(nn.Module):
    """``linear`` over this rank's slice of the input features, summed over the ranks.

    o_proj and down_proj take the output of this rank's heads (MLP slice) only, so each rank
    computes a partial product and one all-reduce completes it. The partials are summed in
    float32 where the packed CPU kernel can produce them (:func:`float32_output`), then cast
    to ``out_dtype``: a bf16 model then rounds the sum once, as one process does.
    """

    def __init__(self, linear: nn.Module, group: TensorParallelGroup, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = linear
        self.group = group
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in / n] -> [num_tokens, out]
        partial = self.linear(x).contiguous()  # [num_tokens, out]
        return self.group.all_reduce(partial).to(self.out_dtype)


class VocabParallelHead(nn.Module):
    """This rank's rows of the LM head; the leader gathers every rank's logits.

    Rank ``r`` holds vocabulary rows ``r * shard_size ..`` (the last shard may be short: its
    logits are padded for the gather and cut after it). The logits come back in float32
    (float64 for a float64 model), on the leader only: the other ranks get ``[rows, 0]``.
    """

    def __init__(self, linear: nn.Module, group: TensorParallelGroup, vocab_size: int, shard_size: int) -> None:
        super().__init__()
        self.linear = linear
        self.group = group
        self.vocab_size = vocab_size
        self.shard_size = shard_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] on rank 0
        local = self.linear(x)  # [rows, <= shard_size]
        local = local if local.dtype == torch.float64 else local.float()
        if local.shape[1] < self.shard_size:
            local = nn.functional.pad(local, (0, self.shard_size - local.shape[1]))
        parts = self.group.gather_to_leader(local)
        if parts is None:
            return local[:, :0]
        return torch.cat(parts, dim=1)[:, : self.vocab_size]  # [rows, vocab]
