"""One generation request's mutable state: tokens, progress, stop detection, result."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import attrs
import torch

from specdec.config import SamplingParams
from specdec.logits.request_logits import RequestLogits
from specdec.metrics import SpecMetrics
from specdec.noise import SeededNoise
from specdec.types import RequestEnd

__all__ = [
    "Request",
    "RequestError",
    "RequestStatus",
    "RequestView",
    "FinishReason",
    "TokenLogprob",
]


class RequestError(RuntimeError):
    """A request failed inside the engine for a reason of its own (for example NaN logits in
    its rows); the other requests of its batch went on."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens or the context limit
    STOP = "stop"  # EOS, a stop token id or a stop string
    CANCELLED = "cancelled"
    ERROR = "error"
    # Every token was masked at the next position (a finished or dead-ended grammar, or
    # allowed_token_ids / bad_words / min_tokens leaving nothing): plain decoding stops too.
    NO_ALLOWED_TOKEN = "no_allowed_token"

    @property
    def request_end(self) -> RequestEnd:
        """How a proposer that tracks requests hears of this finish."""
        return _REQUEST_END[self]


_REQUEST_END = {  # a data table: every FinishReason ends a request one way
    FinishReason.LENGTH: RequestEnd.FINISHED,
    FinishReason.STOP: RequestEnd.FINISHED,
    FinishReason.NO_ALLOWED_TOKEN: RequestEnd.FINISHED,
    FinishReason.CANCELLED: RequestEnd.CANCELLED,
    FinishReason.ERROR: RequestEnd.FAILED,
}


@attrs.frozen
class TokenLogprob:
    """An emitted token's log-probability under the target's processed distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the top-n (token id, logprob) alternatives


@attrs.frozen(eq=False)
class RequestView:
    """A consistent picture of one request, taken between two engine steps: what a
    consumer on another thread may read while the next step mutates the request."""

    steps: int  # the generator's engine steps when the view was taken
    output_ids: tuple[int, ...]
    stop_text_len: int | None
    finished: bool


@attrs.define(eq=False)
class Request:
    """A request inside the engine. ``token_ids`` = prompt + output; the target's KV holds
    the first ``num_computed`` of them (the rest are run by the next target pass)."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # the stream of an unseeded sampled request
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + max_new_tokens (checked against the maximum sequence length)
    decode: Callable[[Sequence[int]], str] | None = None  # for stop strings
    # The options that transform the logits with the history (penalties, bias, bans, grammar):
    # applied to every verify row with that row's own history; None when the params have none.
    transform: RequestLogits | None = None
    token_ids: list[int] = attrs.field(init=False)
    num_computed: int = 0
    # Of the first num_computed slots, how many the proposer's pool holds too when a prefix
    # cache hit started the request (the rest were final in the target's pool only).
    num_cached_for_proposer: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    stop_text_len: int | None = None  # output text is cut here when a stop string matched
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    # One entry per prompt token (None for the first) once the prefill ran, if asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: SpecMetrics = attrs.field(factory=SpecMetrics)
    arrival: int = 0
    # Another sample of the same prompt (n > 1): this one is admitted only after that one's
    # prefill, so it starts on the prompt's cached pages instead of computing them again.
    after_prefill_of: Request | None = None
    _checked_text_len: int = 0

    def __attrs_post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    def randomness(self) -> torch.Generator | SeededNoise | None:
        """This step's source of random draws for the request (one per row, see
        :data:`specdec.sampling.RowRandom`): a seeded sampled request's noise at the position
        of its next token, so its draws depend on its own history alone; else its stream."""
        if self.params.seed is not None and not self.params.is_greedy:
            return SeededNoise(seed=self.params.seed, position=len(self.token_ids))
        return self.generator

    def view(self, steps: int) -> RequestView:
        """A copy of the progress a consumer reads (call between steps, under the lock)."""
        return RequestView(
            steps=steps,
            output_ids=tuple(self.output_ids),
            stop_text_len=self.stop_text_len,
            finished=self.finished,
        )

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def remaining(self) -> int:
        """How many more tokens this request may emit."""
        return min(
            self.params.max_new_tokens - self.num_output, self.max_total_tokens - len(self.token_ids)
        )

    def append(self, tokens: Sequence[int]) -> int:
        """Append emitted tokens one by one, stopping exactly where plain decoding would.

        Returns how many of ``tokens`` were kept; sets ``finish_reason`` when one ends the
        request (the caller then finishes it and releases its pages).
        """
        kept = 0
        for tok in tokens:
            self.token_ids.append(int(tok))
            kept += 1
            reason = self._stop_reason(int(tok))
            if reason is not None:
                self.finish_reason = reason
                break
        return kept

    def _stop_reason(self, tok: int) -> FinishReason | None:
        p = self.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self.decode is not None and self._match_stop_string():
            return FinishReason.STOP
        if self.num_output >= p.max_new_tokens or len(self.token_ids) >= self.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _match_stop_string(self) -> bool:
        # Search only where a match could newly end: from just before the text already checked
        # (a stop string may straddle the old end), so the cost per token stays bounded.
        text = self.decode(self.output_ids)
        longest = max(len(s) for s in self.params.stop)
        tail_start = max(0, self._checked_text_len - longest + 1)
        self._checked_text_len = len(text)
        hits = [text.find(s, tail_start) for s in self.params.stop]
        hits = [h for h in hits if h >= 0]
        if not hits:
            return False
        self.stop_text_len = min(hits)
        return True
