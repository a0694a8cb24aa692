"""One rank's handle on the tensor-parallel group: collectives, step messages, failures.

Built on torch.distributed (gloo on CPU, NCCL on CUDA). Every collective runs under the
group's timeout, and a failure anywhere ends every rank with a :class:`TensorParallelError`
that names the rank that failed: a rank that raises writes its error to the group's store and
closes its connections, so its peers' pending collectives fail at once instead of waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["TensorParallelError", "TensorParallelGroup", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a follower waiting for the leader's next call
_FAILED_KEY = "specdec/failed/{}"


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed; the group cannot be used any more.

    Attributes:
        failed_rank: the rank that failed, or ``None`` when it cannot be told.
        peer_failure: ``True`` on ranks that fail because another rank did.
    """

    def __init__(self, message: str, *, failed_rank: int | None, peer_failure: bool) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.peer_failure = peer_failure

    def __reduce__(self):
        return (_rebuild_error, (str(self), self.failed_rank, self.peer_failure))


def _rebuild_error(message: str, failed_rank: int | None, peer_failure: bool) -> TensorParallelError:
    return TensorParallelError(message, failed_rank=failed_rank, peer_failure=peer_failure)


class TensorParallelGroup:
    """This process's rank in a group of ``world_size`` ranks; rank 0 is the leader.

    Example:
        >>> group = TensorParallelGroup.initialize(2)      # under torchrun or launch()
        >>> group.all_reduce(partial)                      # summed over the ranks, in place
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        store: dist.Store | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where messages and collectives live (CPU for gloo)
        self.timeout_s = timeout_s
        self.idle_timeout_s = IDLE_TIMEOUT_S
        self._store = store
        self._broken: TensorParallelError | None = None

    @classmethod
    def initialize(
        cls, world_size: int, *, device: torch.device | str = "cpu", timeout_s: float | None = None
    ) -> TensorParallelGroup:
        """Join the group this process was started in (``torchrun`` or
        :func:`~specdec.distributed.launch` set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT``); the default process group is created here unless it exists.

        ``timeout_s`` bounds every collective (default ``SPECDEC_TP_TIMEOUT_S`` or 300 s): a rank
        that stops answering fails its peers after at most that long.
        """
        device = torch.device(device)
        if timeout_s is None:
            timeout_s = float(os.environ.get("SPECDEC_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        env_world = os.environ.get("WORLD_SIZE")
        if not dist.is_initialized() and env_world is None:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} processes: launch them "
                f"with `torchrun --nproc-per-node {world_size} script.py` or "
                "specdec.distributed.launch(fn, world_size)"
            )
        actual = dist.get_world_size() if dist.is_initialized() else int(env_world)
        if actual != world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} but this process group has {actual} ranks; "
                "they must be equal"
            )
        store = None
        if not dist.is_initialized():
            rank = int(os.environ["RANK"])
            # Under torchrun the elastic agent already serves the store on MASTER_PORT.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ["MASTER_PORT"]),
                world_size,
                is_master=rank == 0 and not agent_store,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(
            rank=dist.get_rank(), world_size=world_size, device=device, store=store, timeout_s=timeout_s
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def broken(self) -> bool:
        """Whether a failure ended the group (every collective now raises)."""
        return self._broken is not None

    # ---- collectives ----------------------------------------------------------------------
    #
    # On CPU (gloo) every collective is built from point-to-point messages: on a 2-core VM a
    # gloo all_reduce of one hidden row took 2.2 ms and a broadcast 0.28 ms, where an exchange
    # of isend + recv took 0.21 ms (benchmarks/tensor_parallel.py times them); with two
    # all-reduces per layer that is the difference between a TP step slower than one process
    # and one that is faster. NCCL (CUDA) keeps its own collectives.

    @property
    def _point_to_point(self) -> bool:
        return self.device.type == "cpu"

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``x`` must be contiguous); returns ``x``.

        The sum is taken in rank order on every rank, so every rank gets the same bits."""
        with self.collective("all_reduce"):
            if not self._point_to_point:
                dist.all_reduce(x)
                return x
            parts: list[torch.Tensor | None] = [None] * self.world_size
            parts[self.rank] = x
            sends = [dist.isend(x, peer) for peer in self._peers()]
            for peer in self._peers():
                parts[peer] = torch.empty_like(x)
                dist.recv(parts[peer], peer)
            for send in sends:
                send.wait()
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def gather_to_leader(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on all ranks) on the leader, in rank order; ``None``
        elsewhere."""
        x = x.contiguous()
        with self.collective("gather"):
            if not self._point_to_point:
                parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_leader else None
                dist.gather(x, parts, dst=0)
                return parts
            if not self.is_leader:
                dist.send(x, 0)
                return None
            parts = [x]
            for peer in self._peers():
                parts.append(torch.empty_like(x))
                dist.recv(parts[-1], peer)
        return parts

    def send_message(self, message: torch.Tensor) -> None:
        """Leader: send a 1-D int64 message to every other rank (its length, then its words)."""
        size = torch.tensor([message.numel()], dtype=torch.int64, device=self.device)
        message = message.to(self.device)
        with self.collective("broadcast"):
            if not self._point_to_point:
                dist.broadcast(size, 0)
                dist.broadcast(message, 0)
                return
            sends = [dist.isend(t, peer) for peer in self._peers() for t in (size, message)]
            for send in sends:
                send.wait()

    def receive_message(self) -> torch.Tensor:
        """Follower: the leader's next message, as a 1-D int64 CPU tensor.

        The wait for a message's first word is bounded by ``idle_timeout_s``, not by the
        collective timeout: between its calls the leader may run for a long time on its own
        (tokenising, a one-process generator, the user's code). A leader that dies still ends
        the wait at once (its connections close)."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        with self.collective("broadcast"):
            if not self._point_to_point:
                dist.broadcast(size, 0)
            else:
                dist.irecv(size, 0).wait(datetime.timedelta(seconds=self.idle_timeout_s))
            message = torch.empty(int(size.item()), dtype=torch.int64, device=self.device)
            (dist.broadcast if not self._point_to_point else dist.recv)(message, 0)
        return message.cpu()

    # ---- failures ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run collectives; a failure (a peer died, closed its connections or timed out)
        becomes a :class:`TensorParallelError` naming the failed rank, and breaks the group."""
        if self._broken is not None:
            raise self._broken
        try:
            yield
        except TensorParallelError:
            raise
        except (RuntimeError, dist.DistBackendError) as err:
            failed, report = self._failure_report()
            who = f"rank {failed}" if failed is not None else "another rank"
            detail = f": {report}" if report else f" (its connection failed during {what}: {err})"
            error = TensorParallelError(
                f"tensor-parallel rank {self.rank}: {who} failed{detail}",
                failed_rank=failed,
                peer_failure=True,
            )
            self._break(error)
            raise error from err

    def fail(self, error: BaseException) -> TensorParallelError:
        """This rank failed with ``error``: tell the peers (store + closed connections) so
        they fail at once; returns the error to raise."""
        if isinstance(error, TensorParallelError):
            self._break(error)
            return error
        message = f"{type(error).__name__}: {error}"
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(_FAILED_KEY.format(self.rank), message)
        wrapped = TensorParallelError(
            f"tensor-parallel rank {self.rank} failed: {message}", failed_rank=self.rank, peer_failure=False
        )
        self._break(wrapped)
        return wrapped

    def _failure_report(self) -> tuple[int | None, str | None]:
        """The rank that reported a failure to the store (and its message), else the only
        peer of a two-rank group; ``(None, None)`` when it cannot be told."""
        if self._store is not None:
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                key = _FAILED_KEY.format(rank)
                with contextlib.suppress(Exception):
                    if self._store.check([key]):
                        return rank, self._store.get(key).decode()
        if self.world_size == 2:
            return 1 - self.rank, None
        return None, None

    def _break(self, error: TensorParallelError) -> None:
        """Every later collective raises ``error``; our connections close, so peers blocked
        on us fail now rather than at their timeout."""
        if self._broken is None:
            self._broken = error
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()

    def close(self) -> None:
        """Leave the group (idempotent)."""
        if dist.is_initialized() and self._broken is None:
            dist.destroy_process_group()
