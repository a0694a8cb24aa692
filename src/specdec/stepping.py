"""The one stepping loop of a generator: requests in, one engine step at a time, from any thread.

Threading: one lock serialises everything that touches the engine (scheduler, KV pages,
proposer, policy, metrics) and is held for exactly one step, so callers on many threads
interleave step by step and share batches. Submissions go through an inbox that needs no
lock, so ``submit`` never waits for a step in progress; the next step (or cancel) moves them
into the scheduler. The step count is the clock consumers share: one that finds a step taken
since it last looked does not step again (see :meth:`StepLoop.advance`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from specdec.engine import Engine
from specdec.interfaces import Scheduler
from specdec.request import FinishReason, Request, RequestView
from specdec.types import StepOutput

__all__ = ["StepLoop", "cancel_all", "raise_if_failed"]


class StepLoop:
    """Steps ``engine`` over the requests of ``scheduler`` for every caller of a generator.

    Example:
        >>> loop = StepLoop(engine, scheduler)
        >>> loop.run([request])          # submit, step until done, raise its error if it failed
    """

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.lock = threading.RLock()
        self._inbox: deque[Request] = deque()
        self._cancels: deque[Request] = deque()  # cancel_soon's, applied before the next step
        self._ids_lock = threading.Lock()
        self._next_seq_id = 0
        self._num_steps = 0

    @property
    def num_steps(self) -> int:
        """Engine steps taken so far."""
        return self._num_steps

    @property
    def num_queued(self) -> int:
        """Requests submitted but not yet moved into the scheduler."""
        return len(self._inbox)

    def new_seq_id(self) -> int:
        """A fresh request id (from any thread, without waiting for a step)."""
        with self._ids_lock:
            seq_id = self._next_seq_id
            self._next_seq_id += 1
        return seq_id

    def submit(self, reqs: Sequence[Request]) -> None:
        """Queue ``reqs`` for the next step, at once unless a step is running."""
        self._inbox.extend(reqs)  # one call: a generate()'s requests arrive together
        if self.lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self.lock.release()

    def step(self) -> StepOutput:
        """One engine step over every submitted request (waits for a step in progress)."""
        with self.lock:
            self._drain_inbox()
            self._drain_cancels()
            out = self.engine.step()
            self._num_steps += 1
            return out

    def run(self, reqs: Sequence[Request]) -> None:
        """Submit ``reqs`` and step until all have ended; whatever is left (an exception
        interrupted the wait) is cancelled. Raises the first failed request's error."""
        try:
            self.submit(reqs)
            while not all(r.finished for r in reqs):
                self.advance(reqs, self._num_steps)
        finally:
            cancel_all(self, reqs)
        raise_if_failed(reqs)

    def advance(self, reqs: Sequence[Request], seen: int) -> None:
        """One engine step on behalf of the consumer of ``reqs``, unless they have all ended
        or some thread has stepped since the consumer saw step count ``seen``.

        While another thread steps, this blocks on the lock (no busy waiting) and then
        returns at once: that step moved these requests too. A step with nothing to run
        while one of ``reqs`` is unfinished would loop forever, so it is an error.
        """
        with self.lock:
            if self._num_steps != seen or all(r.finished for r in reqs):
                return
            out = self.step()
            if not out.seq_ids and not all(r.finished for r in reqs):
                req = next(r for r in reqs if not r.finished)
                raise RuntimeError(f"request {req.seq_id} is not queued in this generator's engine")

    def progress(self, req: Request, step_unless_since: int | None) -> RequestView:
        """``req``'s progress after stepping as :meth:`advance` does (``None``: no step)."""
        with self.lock:
            if step_unless_since is not None:
                self.advance([req], step_unless_since)
            return req.view(self._num_steps)

    def cancel(self, req: Request) -> bool:
        """Cancel ``req`` between steps (waits for a step in progress); ``False`` if it had
        already ended."""
        with self.lock:
            self._drain_inbox()
            if req.finished:
                return False
            self.engine.cancel(req)
            return True

    def cancel_soon(self, req: Request) -> None:
        """Cancel ``req`` without waiting for a step in progress (an event loop must not block):
        at once when no step runs, else before the next step begins. Its pages are free within
        one step either way."""
        self._cancels.append(req)
        if self.lock.acquire(blocking=False):
            try:
                self._drain_inbox()
                self._drain_cancels()
            finally:
                self.lock.release()

    def cancel_id(self, request_id: int) -> bool:
        """Cancel the request with this id: ``True`` if it was waiting or running, ``False``
        if it had already ended; KeyError if no request of this loop has this id."""
        with self.lock:
            self._drain_inbox()
            req = self.scheduler.find(request_id)
            if req is not None:
                return self.cancel(req)
        if 0 <= request_id < self._next_seq_id:
            return False
        raise KeyError(f"request_id {request_id} is not a request of this generator")

    def _drain_cancels(self) -> None:
        """Apply the cancels :meth:`cancel_soon` queued (call under the lock)."""
        while self._cancels:
            req = self._cancels.popleft()
            if not req.finished:
                self.engine.cancel(req)

    def _drain_inbox(self) -> None:
        """Queue the submitted requests in arrival order (call under the lock)."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())


def raise_if_failed(reqs: Sequence[Request]) -> None:
    """Raise the exception that failed the first failed request (its own type, so a plug-in's
    ValueError stays a ValueError); the other requests are already complete."""
    for req in reqs:
        if req.finish_reason is FinishReason.ERROR:
            raise req.error or RuntimeError(f"request {req.seq_id} failed")


def cancel_all(loop: StepLoop, reqs: Sequence[Request]) -> None:
    """Cancel every unfinished request of ``reqs``; an exception from one (a proposer's end
    hook) is raised after all the others are cancelled too, so none keeps its pages."""
    error: Exception | None = None
    for req in reqs:
        try:
            loop.cancel(req)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the rest
            error = error or exc
    if error is not None:
        raise error
