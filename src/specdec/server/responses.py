"""JSON shapes of OpenAI responses built from specdec outputs (pure functions).

``token_text`` turns one token id into its text (special tokens shown), as OpenAI's logprobs
list tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.metrics import SpecMetrics
from specdec.request import TokenLogprob

__all__ = ["chat_logprobs", "completion_logprobs", "prompt_logprobs", "speculation", "usage"]

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def speculation(metrics: Sequence[SpecMetrics]) -> dict:
    """The speculation figures of a response's requests together (not part of OpenAI's schema:
    clients read it as an extra field, ``response.model_extra["speculation"]``)."""
    total = SpecMetrics()
    for m in metrics:
        total.merge(m)
    return {
        "drafted_tokens": total.num_drafted,
        "accepted_tokens": total.num_accepted,
        "acceptance_rate": total.acceptance_rate,
        "mean_accepted_length": total.mean_accepted_length,
        "target_passes": total.num_target_forwards,
        "verify_steps": total.num_verify_steps,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object of ``entries``; ``text_offset`` counts from
    ``offset`` characters."""
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}  # fmt: skip


def prompt_logprobs(entries: Sequence[TokenLogprob | None] | None, token_text: TokenText) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or
    ``{token id: {"logprob", "decoded_token"}}`` for the token and its top alternatives."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        pairs = [(e.token_id, e.logprob), *e.top]
        out.append({str(t): {"logprob": lp, "decoded_token": token_text(t)} for t, lp in pairs})
    return out
