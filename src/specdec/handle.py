"""A submitted request as the embedding application sees it: follow, stream, await, cancel.

Handles never own a stepping loop of their own: every way of waiting (``result()``,
``tokens()``, iteration, the async forms) advances the generator's one shared
:class:`~specdec.stepping.StepLoop`, one step at a time, which moves *every* submitted request
forward. A consumer steps only when no one has stepped since it last looked, so N consumers on
N threads (or asyncio tasks) share one step per round instead of multiplying them; a consumer
that finds another thread stepping waits on the loop's lock, not in a polling loop. The async
forms run that wait on a worker thread (``asyncio.to_thread``), so the event loop never blocks
on a step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from specdec.codec import TextCodec
from specdec.output import GenerationOutput, output_of
from specdec.request import FinishReason, Request, RequestView, TokenLogprob
from specdec.stepping import StepLoop, raise_if_failed

__all__ = ["RequestHandle", "TextDeltas"]


class RequestHandle:
    """One request submitted with :meth:`Generator.submit`.

    ``tokens()`` yields lists of newly emitted token ids, iterating the handle yields text
    deltas; ``tokens_async()`` / ``stream_async()`` are their asyncio forms. Each of these
    ends when the request ends and raises the request's error if it failed; a cancelled
    request just ends. ``result()`` steps until the request is done and returns its
    :class:`GenerationOutput` (``finish_reason == "cancelled"`` after a cancel, the partial
    output kept) or raises the exception that failed it. Abandoning an iterator before the
    request ends cancels it (a ``break``, ``close()``/``aclose()``, an exception in the loop,
    cancelling the task that iterates): a consumer that stops listening frees its pages
    within one step, as a disconnecting client must.

    Example:
        >>> h = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
        >>> for chunk in h.tokens():          # [token ids] per step that emitted some
        ...     print(chunk)
        >>> h.result().token_ids
    """

    def __init__(self, loop: StepLoop, codec: TextCodec, request: Request) -> None:
        self._loop = loop
        self._codec = codec
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
        return self._loop.cancel(self._req)

    def cancel_soon(self) -> None:
        """Cancel without waiting for a step in progress (for an event loop, which must not
        block): at once when no step runs, else before the next step; a no-op once ended."""
        if not self._req.finished:
            self._loop.cancel_soon(self._req)

    def snapshot(self) -> RequestView:
        """The request as it stands between two steps (its output so far, whether it ended),
        without stepping: for a consumer that lets another thread drive the engine."""
        return self._loop.progress(self._req, None)

    def output(self) -> GenerationOutput:
        """The output as it stands, without stepping (``result()`` once the request ended).
        An ended request no longer changes, so that read takes no lock (never waits for a
        step: an event loop may call it)."""
        if self._req.finished:
            return output_of(self._req, self._codec)
        with self._loop.lock:
            return output_of(self._req, self._codec)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (fixed at submission; read without a lock)."""
        return list(self._req.prompt_ids)

    def token_logprobs(self, start: int, stop: int) -> list[TokenLogprob]:
        """The log-probabilities of output tokens ``start .. stop - 1`` (``logprobs`` params;
        ``stop`` at most a snapshot's output length). Recorded entries never change, so this
        takes no lock."""
        return list(self._req.logprobs[start:stop])

    def text_deltas(self) -> TextDeltas:
        """A :class:`TextDeltas` that turns this request's snapshots into text deltas."""
        return TextDeltas(self._codec, self._req)

    def result(self) -> GenerationOutput:
        """Step the engine until this request is done; its output, or its error raised."""
        for _ in self._views():
            pass
        return output_of(self._req, self._codec)

    # ---------------------------------------------------------------- streaming
    def _views(self) -> Iterator[RequestView]:
        """The request's progress after each step that moved it (first: as it is now); raises
        its error once it has ended, if it failed."""
        try:
            view = self._loop.progress(self._req, None)
            while True:
                yield view
                if view.finished:
                    break
                view = self._loop.progress(self._req, view.steps)
        finally:  # abandoned before the end: nobody wants the rest
            if not self._req.finished:
                self._loop.cancel(self._req)
        raise_if_failed([self._req])

    async def _views_async(self) -> AsyncIterator[RequestView]:
        """:meth:`_views` for asyncio: each wait for a step runs on a worker thread."""
        try:
            view = await asyncio.to_thread(self._loop.progress, self._req, None)
            while True:
                yield view
                if view.finished:
                    break
                view = await asyncio.to_thread(self._loop.progress, self._req, view.steps)
        finally:  # abandoned (break, aclose, task cancelled): cancel without blocking the loop
            if not self._req.finished:
                self._loop.cancel_soon(self._req)
        raise_if_failed([self._req])

    def tokens(self) -> Iterator[list[int]]:
        """Yield each step's newly emitted token ids (``[int]``, non-empty) until done."""
        sent = 0
        with contextlib.closing(self._views()) as views:
            for view in views:
                if len(view.output_ids) > sent:
                    yield list(view.output_ids[sent:])
                    sent = len(view.output_ids)

    def __iter__(self) -> Iterator[str]:
        """Yield text deltas (needs a tokenizer; a delta never ends inside a character)."""
        deltas = TextDeltas(self._codec, self._req)
        with contextlib.closing(self._views()) as views:
            for view in views:
                if delta := deltas.pull(view):
                    yield delta

    async def tokens_async(self) -> AsyncIterator[list[int]]:
        """The asyncio form of :meth:`tokens`: ``async for chunk in handle.tokens_async()``.

        Waiting for a step (and running one, when no one else is) happens on a worker thread,
        so the event loop runs other tasks meanwhile; N concurrent consumers share one step
        per round.
        """
        sent = 0
        async with contextlib.aclosing(self._views_async()) as views:
            async for view in views:
                if len(view.output_ids) > sent:
                    yield list(view.output_ids[sent:])
                    sent = len(view.output_ids)

    async def stream_async(self) -> AsyncIterator[str]:
        """The asyncio form of iterating the handle: text deltas."""
        deltas = TextDeltas(self._codec, self._req)
        async with contextlib.aclosing(self._views_async()) as views:
            async for view in views:
                if delta := deltas.pull(view):
                    yield delta


class TextDeltas:
    """Turns a request's growing output into text deltas, holding back a partial character
    and, while the request runs, any end of the text that a stop string may yet complete: the
    streamed text is always a prefix of the text ``result()`` returns."""

    def __init__(self, codec: TextCodec, request: Request) -> None:
        self._codec = codec
        self._req = request
        self._sent = ""

    def pull(self, view: RequestView) -> str:
        text = self._codec.text_of(self._req.prompt_ids, view.output_ids, view.stop_text_len)
        # "\ufffd" at the end is a multi-byte character cut between tokens: wait for the rest.
        if not view.finished:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - stop_prefix_len(text, self._req.params.stop)]
        if len(text) <= len(self._sent):
            return ""
        delta = text[len(self._sent) :]
        self._sent = text
        return delta


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (which the next
    tokens may complete, and then the text is cut before it); 0 when none does.

    >>> stop_prefix_len("a big, red b", ("red ball",)), stop_prefix_len("a big", ("red ball",))
    (5, 0)
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
