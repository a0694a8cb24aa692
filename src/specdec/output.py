"""What a finished request gives back: :class:`GenerationOutput`."""

from __future__ import annotations

import attrs

from specdec.codec import TextCodec
from specdec.metrics import SpecMetrics
from specdec.request import Request, TokenLogprob

__all__ = ["GenerationOutput", "output_of"]


@attrs.frozen
class GenerationOutput:
    """One request's result. ``text`` excludes a matched stop string.

    Example:
        >>> out = gen.generate("def fib(n):", SamplingParams(max_new_tokens=16))
        >>> out.text, out.token_ids, out.finish_reason, out.metrics.mean_accepted_length
    """

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: SpecMetrics
    logprobs: list[TokenLogprob] | None = None
    # The prompt tokens' log-probabilities (``SamplingParams.prompt_logprobs``; None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def output_of(req: Request, codec: TextCodec) -> GenerationOutput:
    """``req``'s output as it stands (its text decoded by ``codec``), metrics a snapshot."""
    return GenerationOutput(
        text=codec.text_of(req.prompt_ids, req.output_ids, req.stop_text_len),
        token_ids=list(req.output_ids),
        prompt_token_ids=list(req.prompt_ids),
        finish_reason=req.finish_reason.value if req.finish_reason else "unknown",
        metrics=req.metrics.snapshot(),
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
    )
