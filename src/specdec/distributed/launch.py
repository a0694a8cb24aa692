"""Start the ranks of a tensor-parallel group from Python (notebooks, tests): ``launch``.

``torchrun --nproc-per-node N script.py`` is the other way in; both set the same environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) that
:meth:`~specdec.distributed.group.TensorParallelGroup.initialize` reads.
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from specdec.distributed.group import TensorParallelError

__all__ = ["launch", "RankFailedError"]


class RankFailedError(RuntimeError):
    """A rank started by :func:`launch` failed; ``rank`` is the one that failed first (the
    others' errors followed from it)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads_per_rank: int = 1,
    timeout_s: float | None = None,
    grace_s: float = 30.0,
) -> Any:
    """Run ``fn(*args)`` in ``world_size`` new processes (ranks 0..world_size-1, spawned) and
    return rank 0's return value.

    ``fn`` must be importable by name (defined at module level), and its rank-0 result
    picklable. Each rank uses ``threads_per_rank`` torch threads. If a rank raises or dies,
    the others are given ``grace_s`` seconds to end (their collectives fail at once when the
    failed rank's connections close) and are then killed; :class:`RankFailedError` names the
    rank that failed first. ``timeout_s`` bounds the whole run.

    Example:
        >>> def work(prompt):
        ...     gen = Generator.from_pretrained("qwen2.5-coder-1.5b-instruct", tensor_parallel_size=2)
        ...     return gen.generate(prompt)        # rank 0: the output; other ranks: None
        >>> out = launch(work, 2, "def fib(n):")
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for name, value in (("world_size", world_size), ("threads_per_rank", threads_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_run_rank,
            args=(fn, args, rank, world_size, port, threads_per_rank, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, timeout_s, grace_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(fn, args, rank, world_size, port, threads, results) -> None:
    import torch

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    try:
        value = fn(*args)
        results.put(("ok", rank, value if rank == 0 else None, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        peer = isinstance(exc, TensorParallelError) and exc.peer_failure
        summary = f"{type(exc).__name__}: {exc}"
        results.put(("peer" if peer else "error", rank, summary, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, results, timeout_s: float | None, grace_s: float) -> Any:
    """Wait for every rank; rank 0's value, or RankFailedError for the first failure."""
    start = time.monotonic()
    reports: dict[int, tuple[str, Any, str]] = {}  # rank -> (status, value or summary, traceback)
    dead_since: dict[int, float] = {}
    first_failure_at = None
    while True:
        try:
            status, rank, value, tb = results.get(timeout=0.05)
            reports[rank] = (status, value, tb)
        except queue_module.Empty:
            pass
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank not in reports and not proc.is_alive():
                # A dead rank's report may still be in the queue's pipe: wait a moment for it.
                if now - dead_since.setdefault(rank, now) > 2.0:
                    reports[rank] = ("error", _exit_reason(proc.exitcode), "")
        if len(reports) == len(procs):
            break
        if first_failure_at is None and any(r[0] != "ok" for r in reports.values()):
            first_failure_at = now
        if first_failure_at is not None and now - first_failure_at > grace_s:
            break
        if timeout_s is not None and now - start > timeout_s:
            running = [r for r in range(len(procs)) if r not in reports]
            raise TimeoutError(f"launch: ranks {running} still running after timeout_s={timeout_s}")
    failures = [(rank, *r) for rank, r in sorted(reports.items()) if r[0] != "ok"]
    if failures:
        # The root cause before its echoes (ranks that failed because a peer did).
        rank, _, summary, tb = min(failures, key=lambda f: f[1] == "peer")
        others = "".join(f"\n  rank {r}: {s}" for r, _, s, _ in failures if r != rank)
        others = f"\nthen:{others}" if others else ""
        details = f"\n--- rank {rank} traceback ---\n{tb}" if tb else ""
        raise RankFailedError(f"rank {rank} of {len(procs)} failed: {summary}{others}{details}", rank)
    return reports[0][1]


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"the process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the process was killed by signal {-code}"
    return f"the process exited with code {code} without reporting"
