"""The two response shapes, completions and chat completions, as JSON and as stream chunks.

A shape is fixed for one HTTP request (its id and creation time), so every chunk of a stream
and the final response agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import attrs

from specdec.output import GenerationOutput
from specdec.request import TokenLogprob
from specdec.server.responses import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs

__all__ = ["ChatShape", "CompletionShape", "Shape"]


class Shape(Protocol):
    def opening(self, index: int) -> list[dict]:
        """Chunks a stream sends for choice ``index`` before any token."""
        ...

    def chunk(self, index: int, text: str, entries: Sequence[TokenLogprob] | None,
              finish_reason: str | None = None) -> dict: ...  # fmt: skip

    def usage_chunk(self, usage: dict, speculation: dict) -> dict: ...

    def response(self, outputs: Sequence[GenerationOutput], n: int, usage: dict, speculation: dict) -> dict: ...


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@attrs.define(kw_only=True)
class CompletionShape:
    """``text_completion`` objects. ``echo``: the prompt's text comes first (``prompt_texts``,
    one per prompt; choice ``i`` is prompt ``i // n``'s)."""

    model: str
    token_text: TokenText
    echo: bool = False
    prompt_texts: list[str] | None = None
    n: int = 1
    id: str = attrs.field(factory=lambda: _new_id("cmpl"))
    created: int = attrs.field(factory=lambda: int(time.time()))
    _offsets: dict[int, int] = attrs.field(factory=dict)

    def _head(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def opening(self, index: int) -> list[dict]:
        if not self.echo:
            return []
        return [self.chunk(index, self.prompt_texts[index // self.n], None)]

    def chunk(self, index, text, entries, finish_reason=None) -> dict:
        offset = self._offsets.get(index, 0)
        logprobs = None
        if entries:
            logprobs = completion_logprobs(entries, self.token_text, offset)
        self._offsets[index] = offset + len(text)
        return self._head([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    def usage_chunk(self, usage, speculation) -> dict:
        return self._head([]) | {"usage": usage, "speculation": speculation}

    def response(self, outputs, n, usage, speculation) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            prefix = self.prompt_texts[i // n] if self.echo else ""
            choice = {
                "index": i,
                "text": prefix + out.text,
                "logprobs": None if out.logprobs is None
                else completion_logprobs(out.logprobs, self.token_text, len(prefix)),
                "finish_reason": out.finish_reason,
            }  # fmt: skip
            if out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, self.token_text)
            choices.append(choice)
        return self._head(choices) | {"usage": usage, "speculation": speculation}


@attrs.define(kw_only=True)
class ChatShape:
    """``chat.completion`` objects and ``chat.completion.chunk`` deltas."""

    model: str
    token_text: TokenText
    id: str = attrs.field(factory=lambda: _new_id("chatcmpl"))
    created: int = attrs.field(factory=lambda: int(time.time()))

    def _head(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def opening(self, index: int) -> list[dict]:
        return [self._head("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}])]  # fmt: skip

    def chunk(self, index, text, entries, finish_reason=None) -> dict:
        delta = {"content": text} if text else {}
        logprobs = chat_logprobs(entries, self.token_text) if entries else None
        return self._head("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                     "finish_reason": finish_reason}])  # fmt: skip

    def usage_chunk(self, usage, speculation) -> dict:
        return self._head("chat.completion.chunk", []) | {"usage": usage, "speculation": speculation}

    def response(self, outputs, n, usage, speculation) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None if out.logprobs is None else chat_logprobs(out.logprobs, self.token_text),
                "finish_reason": out.finish_reason,
            }
            if out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, self.token_text)
            choices.append(choice)
        return self._head("chat.completion", choices) | {"usage": usage, "speculation": speculation}
