"""The machine's memory read bandwidth and the decode-time bound it puts on a model.

A decode step of a small batch must read every weight once, so ``weight bytes / read bandwidth``
is the floor on its time. The bandwidth is the best of two readers over a 1 GiB buffer (far
larger than the caches, in huge pages like the weights), best of a few runs, at the current ``torch.get_num_threads()``:
PyTorch's float32 ``sum`` and the packed kernel's own streaming read (``read_stream``: 32-byte
loads with its software prefetch), so the bound is what this machine's memory delivers, not
what one reader happens to get.

    python -m benchmarks.bandwidth [--threads 1,2]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

__all__ = ["BandwidthProbe", "read_bandwidth", "weight_bytes", "decode_bound_s"]


class BandwidthProbe:
    """Reads one buffer again and again: the read bandwidth *now*, for pairing with a timing
    taken right next to it (the machine's bandwidth drifts by 10-30% within minutes)."""

    def __init__(self, gib: float = 1.0) -> None:
        from specdec.kernels.cpu_linear import load_kernel
        from specdec.models.hugepages import hugepage_buffer

        # Same memory as the weights: huge pages where the system gives them (see models/hugepages).
        self.buf = hugepage_buffer(int(gib * 2**30)).view(torch.float32).fill_(1.0)
        self.readers = [self.buf.sum]
        kernel = load_kernel()
        if kernel is not None:
            self.readers.append(lambda: kernel.read_stream(self.buf))
        for read in self.readers:
            read()  # fault the pages in, warm the code

    def __call__(self, repeats: int = 5) -> float:
        """Bytes per second: best reader, best of ``repeats``, at the current thread count."""
        best = float("inf")
        for read in self.readers:
            for _ in range(repeats):
                start = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - start)
        return self.buf.numel() * 4 / best


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second read from a ``gib`` GiB buffer: best reader, best of ``repeats``."""
    return BandwidthProbe(gib)(repeats)


def weight_bytes(model: nn.Module) -> int:
    """Bytes a one-token forward reads: every parameter and buffer except the input embedding
    (one row of it is read) and the RoPE table."""
    skip = {"embed_tokens.weight", "inv_freq"}
    seen: set[int] = set()
    total = 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for name, t in tensors:  # a tied LM head appears as lm_head.weight and is read in full
        if name in skip or t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_bound_s(model: nn.Module, bandwidth: float) -> float:
    """The weight-read floor of one decode step, in seconds."""
    return weight_bytes(model) / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        print(f"{t} thread(s): {read_bandwidth() / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
