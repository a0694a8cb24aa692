"""A submitted request as the embedding application sees it: follow, stream, await, cancel.

Handles never own a stepping loop of their own: every way of waiting (``result()``,
``tokens()``, iteration, the async forms) advances the one shared engine through
``Generator.step()``, which moves *every* submitted request forward. Several consumers, sync
or async, can therefore follow their own requests at once; the async forms step only when no
other consumer has stepped since they last yielded control, so concurrent ``async for`` loops
share one step per round instead of multiplying them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from specdec.request import FinishReason, Request

if TYPE_CHECKING:
    from specdec.generator import GenerationOutput, Generator

__all__ = ["RequestHandle"]


class RequestHandle:
    """One request submitted with :meth:`Generator.submit`.

    ``tokens()`` yields lists of newly emitted token ids, iterating the handle yields text
    deltas; ``tokens_async()`` / ``stream_async()`` are their asyncio forms. Each of these
    ends when the request ends and raises the request's error if it failed; a cancelled
    request just ends. ``result()`` steps until the request is done and returns its
    :class:`GenerationOutput` (``finish_reason == "cancelled"`` after a cancel, the partial
    output kept) or raises the exception that failed it. Abandoning an iterator does not
    cancel the request: call ``cancel()``.

    Example:
        >>> h = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
        >>> for chunk in h.tokens():          # [token ids] per step that emitted some
        ...     print(chunk)
        >>> h.result().token_ids
    """

    def __init__(self, generator: Generator, request: Request) -> None:
        self._gen = generator
        self._req = request

    def __repr__(self) -> str:
        state = self._req.finish_reason.value if self._req.finished else self._req.status.value
        return f"RequestHandle(request_id={self.request_id}, {state})"

    @property
    def request_id(self) -> int:
        return self._req.seq_id

    @property
    def done(self) -> bool:
        """True once the request finished, was cancelled or failed."""
        return self._req.finished

    @property
    def finish_reason(self) -> str | None:
        """``"length"``, ``"stop"``, ``"cancelled"``, ``"error"``, or ``None`` while running."""
        return self._req.finish_reason.value if self.done else None

    @property
    def error(self) -> BaseException | None:
        """The exception that failed the request, if it failed."""
        return self._req.error if self._req.finish_reason is FinishReason.ERROR else None

    @property
    def output_ids(self) -> list[int]:
        """The tokens emitted so far."""
        return self._req.output_ids

    def cancel(self) -> bool:
        """Cancel the request, waiting or running; its pages are freed at once.

        Returns ``True`` if it was cancelled now, ``False`` if it had already ended
        (finished, failed or cancelled before): a no-op.
        """
        return self._gen._cancel_request(self._req)

    def result(self) -> GenerationOutput:
        """Step the engine until this request is done; its output, or its error raised."""
        while not self.done:
            self._gen._step_for(self._req)
        return self._gen._finished_output(self._req)

    # ---------------------------------------------------------------- streaming
    def tokens(self) -> Iterator[list[int]]:
        """Yield each step's newly emitted token ids (``[int]``, non-empty) until done."""
        sent = 0
        while True:
            ids = self._req.output_ids
            if len(ids) > sent:
                yield ids[sent:]
                sent = len(ids)
            if self.done:
                break
            self._gen._step_for(self._req)
        self._gen._raise_if_failed([self._req])

    def __iter__(self) -> Iterator[str]:
        """Yield text deltas (needs a tokenizer; a delta never ends inside a character)."""
        deltas = _TextDeltas(self._gen, self._req)
        for _ in self.tokens():
            if delta := deltas.pull():
                yield delta
        if delta := deltas.pull():
            yield delta

    async def tokens_async(self) -> AsyncIterator[list[int]]:
        """The asyncio form of :meth:`tokens`: ``async for chunk in handle.tokens_async()``.

        Steps run on the event loop's thread (a step is short and holds no lock); between
        steps the loop runs other tasks. A consumer steps only when no one else has stepped
        since it last yielded control, so N concurrent consumers share one step per round.
        """
        sent, seen = 0, -1
        while True:
            ids = self._req.output_ids
            if len(ids) > sent:
                yield ids[sent:]
                sent = len(ids)
            if self.done:
                break
            if self._gen.num_steps == seen:  # no one stepped since this consumer last waited
                self._gen._step_for(self._req)
            seen = self._gen.num_steps
            await asyncio.sleep(0)
        self._gen._raise_if_failed([self._req])

    async def stream_async(self) -> AsyncIterator[str]:
        """The asyncio form of iterating the handle: text deltas."""
        deltas = _TextDeltas(self._gen, self._req)
        async for _ in self.tokens_async():
            if delta := deltas.pull():
                yield delta
        if delta := deltas.pull():
            yield delta


class _TextDeltas:
    """Turns a request's growing output into text deltas, holding back a partial character."""

    def __init__(self, generator: Generator, request: Request) -> None:
        self._gen = generator
        self._req = request
        self._sent = ""

    def pull(self) -> str:
        text = self._gen._text(self._req)
        # "\ufffd" at the end is a multi-byte character cut between tokens: wait for the rest.
        if (not self._req.finished and text.endswith("\ufffd")) or len(text) <= len(self._sent):
            return ""
        delta = text[len(self._sent) :]
        self._sent = text
        return delta
