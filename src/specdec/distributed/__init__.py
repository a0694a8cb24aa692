"""Tensor parallelism on torch.distributed: the target sharded over the ranks, the proposer,
scheduler, sampling and verification on the leader (rank 0). See docs/distributed.md.

Example:
    >>> from specdec.distributed import launch
    >>> def work(prompt):
    ...     gen = Generator.from_pretrained("qwen2.5-coder-1.5b-instruct", tensor_parallel_size=2)
    ...     return gen.generate(prompt)          # None on rank 1
    >>> launch(work, 2, "def fib(n):").text
"""

from specdec.distributed.group import TensorParallelError, TensorParallelGroup
from specdec.distributed.launch import RankFailedError, launch

__all__ = ["launch", "RankFailedError", "TensorParallelError", "TensorParallelGroup"]
