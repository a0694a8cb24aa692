"""The server's engine thread: steps one Generator while requests are live, and after each
step hands every live request's snapshot to the asyncio task that serves it.

One thread drives the engine, so the event loop never runs (or waits for) a step, and a
hundred connected clients cost a hundred queue entries per step, not a hundred threads. The
handlers never step: they await their :class:`Subscription`. Cancelling (a client gone) is
``RequestHandle.cancel_soon``: the pages are free before the next step starts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import attrs

from specdec.handle import RequestHandle
from specdec.request import RequestView

__all__ = ["EngineDriver", "Subscription"]

log = logging.getLogger("specdec.server")


@attrs.define(eq=False)
class Subscription:
    """The live requests of one HTTP request (``n`` samples of each prompt), and the queue
    their snapshots arrive in as ``(index, view)`` from the engine thread."""

    handles: list[RequestHandle]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = attrs.field(factory=asyncio.Queue)
    done: list[bool] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.done = [h.done for h in self.handles]

    def publish(self, index: int, view: RequestView) -> None:
        """From the engine thread: queue ``view`` for the event loop (never blocks)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, view))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    async def next(self, timeout: float | None = None) -> tuple[int, RequestView] | None:
        """The next ``(index, view)``; ``None`` after ``timeout`` seconds without one."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None

    @property
    def finished(self) -> bool:
        return all(self.done)

    def cancel(self) -> None:
        """Cancel every request still running, without blocking the event loop."""
        for handle in self.handles:
            handle.cancel_soon()


class EngineDriver:
    """Steps ``generator`` on a thread of its own while any subscribed request is live.

    Example:
        >>> driver = EngineDriver(gen)
        >>> sub = driver.subscribe(gen.submit_samples("Hi", params), asyncio.get_running_loop())
        >>> index, view = await sub.next()
    """

    def __init__(self, generator) -> None:
        self._gen = generator
        self._subs: list[Subscription] = []
        self._cond = threading.Condition()
        self._closed = False
        self._num_live = 0
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def num_live(self) -> int:
        """Requests subscribed and not yet ended."""
        return self._num_live

    def subscribe(self, handles: Sequence[RequestHandle], loop: asyncio.AbstractEventLoop) -> Subscription:
        sub = Subscription(list(handles), loop)
        with self._cond:
            if self._closed:
                sub.cancel()
                raise RuntimeError("the engine driver is closed")
            self._subs.append(sub)
            self._num_live += sum(not d for d in sub.done)
            self._cond.notify()
        return sub

    def close(self, timeout: float | None = None) -> None:
        """Stop after the live requests end (``timeout`` seconds at most, then cancel them)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._cond:
                subs = list(self._subs)
            for sub in subs:
                sub.cancel()
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._subs and not self._closed:
                    self._cond.wait()
                if not self._subs:
                    return
                subs = list(self._subs)
            try:
                out = self._gen.step()
            except Exception:  # a bug in the engine itself: end every request, loudly
                log.exception("engine step failed; cancelling the live requests")
                for sub in subs:
                    sub.cancel()
                out = None
            self._publish(subs)
            if out is not None and not out.seq_ids:
                time.sleep(0.001)  # nothing ran (requests ending between steps): do not spin

    def _publish(self, subs: list[Subscription]) -> None:
        ended = 0
        for sub in subs:
            for i, handle in enumerate(sub.handles):
                if sub.done[i]:
                    continue
                view = handle.snapshot()
                if view.finished:
                    sub.done[i] = True
                    ended += 1
                sub.publish(i, view)
        with self._cond:
            self._num_live -= ended
            self._subs = [s for s in self._subs if not s.finished]
