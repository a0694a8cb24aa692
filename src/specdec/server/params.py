"""OpenAI request bodies -> :class:`~specdec.SamplingParams`, one field to one field.

Pure functions: no model, no I/O. A value the library rejects becomes an :class:`APIError`
whose ``param`` is the *request's* field name (``max_tokens``, not ``max_new_tokens``).
"""

from __future__ import annotations

import re

from specdec.config import SamplingParams, StructuredOutput
from specdec.server.errors import APIError, field_of_message
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["chat_sampling_params", "completion_sampling_params", "renamed", "request_field", "structured_fields", "structured_message"]

OPENAI_TEMPERATURE = 1.0  # OpenAI's default; greedy decoding is temperature 0
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def completion_sampling_params(body: CompletionRequest, *, salt: str | None) -> SamplingParams:
    """The params of a ``/v1/completions`` body (``salt``: the API key's cache salt)."""
    if body.suffix is not None:
        raise APIError("suffix is not supported (no fill-in-the-middle)", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(f"best_of must equal n ({body.n}) or be omitted; got {body.best_of}", param="best_of")
    max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens  # null: the default
    return _sampling_params(body, max_tokens=max_tokens, max_tokens_field="max_tokens",
                            logprobs=body.logprobs, logprobs_field="logprobs", salt=salt)  # fmt: skip


def chat_sampling_params(body: ChatCompletionRequest, *, salt: str | None, max_tokens: int) -> SamplingParams:
    """The params of a ``/v1/chat/completions`` body; ``max_tokens`` is the default length
    (what the context leaves after the prompt)."""
    if body.tools:
        raise APIError("tools are not supported by this server", param="tools")
    if body.tool_choice not in (None, "none"):
        raise APIError("tool_choice is not supported by this server", param="tool_choice")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, max_tokens=max_tokens if requested is None else requested,
                            max_tokens_field=field, logprobs=logprobs, logprobs_field="top_logprobs",
                            salt=salt)  # fmt: skip


def request_field(name: str, *, max_tokens_field: str = "max_tokens", logprobs_field: str = "logprobs") -> str:
    """The request field behind a ``SamplingParams`` field name."""
    return {
        "max_new_tokens": max_tokens_field,
        "logprobs": logprobs_field,
        "structured_output": "response_format",
        "json_schema": "response_format",
        "params": "prompt",
    }.get(name, name)


def _sampling_params(body, *, max_tokens, max_tokens_field, logprobs, logprobs_field, salt) -> SamplingParams:
    fields = dict(
        max_new_tokens=max_tokens,
        temperature=OPENAI_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        allowed_token_ids=body.allowed_token_ids,
        bad_words=tuple(body.bad_words or ()),
        min_tokens=body.min_tokens,
        structured_output=structured_output(body),
        n=body.n,
        prompt_logprobs=body.prompt_logprobs,
        cache_salt=_salt(salt, body.cache_salt),
    )
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        name = field_of_message(str(exc)) or ""
        field = request_field(name, max_tokens_field=max_tokens_field, logprobs_field=logprobs_field)
        raise APIError(renamed(str(exc), name, field), param=field) from None


def renamed(message: str, name: str, field: str) -> str:
    """``message`` with its leading library field ``name`` told as the request's ``field``.

    >>> renamed("max_new_tokens must be >= 1, got 0", "max_new_tokens", "max_tokens")
    'max_tokens must be >= 1, got 0'
    """
    if name and name != field and message.startswith(name):
        return field + message[len(name):]
    return message


def structured_fields(body) -> list[str]:
    """The request fields that ask for structured output (``response_format`` of type text
    does not)."""
    given = [name for name in _STRUCTURED_FIELDS if getattr(body, name) is not None]
    if body.response_format is not None and body.response_format.type == "text":
        given.remove("response_format")
    return given


def structured_output(body) -> StructuredOutput | None:
    """The one constraint of ``response_format`` or a ``guided_*`` field (more than one: 400)."""
    fmt = body.response_format
    given = structured_fields(body)
    if len(given) > 1:
        raise APIError(f"at most one of {', '.join(given)} may be given", param=given[1])
    if not given:
        return None
    field = given[0]
    try:
        if field == "response_format":
            if fmt.type == "json_object":
                return StructuredOutput(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError("response_format of type json_schema needs json_schema.schema",
                               param="response_format")  # fmt: skip
            return StructuredOutput(json_schema=fmt.json_schema.schema_)
        value = getattr(body, field)
        kind = {"guided_json": "json_schema", "guided_regex": "regex",
                "guided_choice": "choice", "guided_grammar": "grammar"}[field]  # fmt: skip
        return StructuredOutput(**{kind: value})
    except (TypeError, ValueError) as exc:
        raise APIError(structured_message(str(exc), field), param=field) from None


def structured_message(message: str, field: str) -> str:
    """A ``structured_output`` message told with the request's ``field``.

    >>> structured_message("structured_output.regex is not a valid regex: ...", "guided_regex")
    'guided_regex is not a valid regex: ...'
    """
    if field.startswith("guided_"):
        return re.sub(r"^structured_output(\.\w+)?", field, message)
    return re.sub(r"^structured_output", field, message)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        out[token] = value
    return out


def _salt(key_salt: str | None, request_salt: str | None) -> str | None:
    """One salt from the API key's and the request's: each key's prefixes are apart, and a
    request may part its own further."""
    if not request_salt and request_salt is not None:
        raise APIError(f"cache_salt must be a non-empty string, got {request_salt!r}", param="cache_salt")
    parts = [p for p in (key_salt, request_salt) if p is not None]
    return "\x1f".join(parts) if parts else None
