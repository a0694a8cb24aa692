"""The OpenAI-compatible HTTP API over one :class:`~specdec.Generator`: :func:`build_app`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or server-sent events),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every request is checked in full
(types by pydantic, values by ``SamplingParams``, the prompt by the generator) before it is
queued, so a bad one is a 400 naming its field and leaves nothing behind. One
:class:`~specdec.server.driver.EngineDriver` thread steps the engine; a handler only awaits
its requests' snapshots, and cancels them when its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Sequence

import attrs
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.config import SamplingParams
from specdec.handle import RequestHandle
from specdec.output import GenerationOutput
from specdec.server.config import ServerConfig
from specdec.server.driver import EngineDriver, Subscription
from specdec.server.errors import APIError, error_response, field_of_message
from specdec.server.metrics import ServerMetrics
from specdec.server.params import (
    chat_sampling_params,
    completion_sampling_params,
    renamed,
    request_field,
    structured_fields,
    structured_message,
)
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest
from specdec.server.responses import speculation, usage
from specdec.server.shapes import ChatShape, CompletionShape, Shape

__all__ = ["build_app"]


def build_app(generator, config: ServerConfig | str) -> FastAPI:
    """A FastAPI app serving ``generator`` (``config``: a :class:`ServerConfig`, or just the
    model name). Serve it with any ASGI server (``specdec serve`` runs uvicorn); its engine
    thread stops when the app's lifespan ends.

    Example:
        >>> app = build_app(gen, ServerConfig(model_name="qwen-coder", api_keys=("secret",)))
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    if isinstance(config, str):
        config = ServerConfig(model_name=config)
    server = _Server(generator, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(server.driver.close, config.drain_timeout_s)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.specdec = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        server.metrics.request_rejected(exc.status)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.metrics.request_rejected(400)
        return error_response(_validation_error(exc))

    async def authorize(request: Request) -> str | None:  # async: no thread-pool hop per request
        return server.authorize(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> Response:
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(server.metrics.render)  # takes the engine lock
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(salt: str | None = Depends(authorize)) -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model",
                                            "created": server.created, "owned_by": "specdec",
                                            "max_model_len": generator.max_sequence_len}]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, salt: str | None = Depends(authorize)):
        server.check_model(body.model)
        params = completion_sampling_params(body, salt=salt)
        prompts = _completion_prompts(body.prompt)
        shape = CompletionShape(model=config.model_name, token_text=server.token_text, echo=body.echo, n=body.n,
                                prompt_texts=[server.prompt_text(p) for p in prompts] if body.echo else None)  # fmt: skip
        return await server.run(shape, prompts, params, body, request, prompt_field="prompt")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, salt: str | None = Depends(authorize)):
        server.check_model(body.model)
        prompt = server.chat_prompt(body)
        default_max = max(1, generator.max_sequence_len - len(prompt))
        params = chat_sampling_params(body, salt=salt, max_tokens=default_max)
        shape = ChatShape(model=config.model_name, token_text=server.token_text)
        return await server.run(shape, [prompt], params, body, request, prompt_field="messages")

    return app


class _Server:
    """The state behind the routes: the generator, its engine thread, metrics, settings."""

    def __init__(self, generator, config: ServerConfig) -> None:
        self.gen = generator
        self.config = config
        self.driver = EngineDriver(generator)
        self.metrics = ServerMetrics(generator, model=config.model_name)
        self.created = int(time.time())
        self.draining = False
        # Keys as bytes for hmac.compare_digest; each with the salt that keeps its prefixes apart.
        self._keys = [(k.encode(), hashlib.sha256(b"specdec-key-salt\0" + k.encode()).hexdigest()[:32])
                      for k in config.api_keys]  # fmt: skip
        self._token_texts: dict[int, str] = {}

    # ---------------------------------------------------------------- checks
    def authorize(self, header: str | None) -> str | None:
        """The cache salt of the request's API key (``None`` without keys); 401 otherwise.
        Every key is compared, in constant time, whichever matches."""
        if not self._keys:
            return None
        given = (header or "").removeprefix("Bearer ").strip().encode()
        salt = None
        for key, key_salt in self._keys:
            if hmac.compare_digest(given, key):
                salt = key_salt
        if salt is None:
            raise APIError("invalid API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")  # fmt: skip
        return salt

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves "
                           f"{self.config.model_name!r}", status=404, param="model", code="model_not_found")  # fmt: skip

    def admit(self, count: int) -> None:
        """503 while draining, 429 when ``count`` more requests would pass ``max_pending``."""
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            raise APIError("the server is shutting down", status=503, type="server_error", headers=retry)
        if self.driver.num_live + count > self.config.max_pending:
            raise APIError(f"the server is full ({self.driver.num_live} requests in flight, at most "
                           f"{self.config.max_pending}); retry later", status=429,
                           type="rate_limit_error", headers=retry)  # fmt: skip

    # ---------------------------------------------------------------- prompts
    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of the conversation under the chat template, with the assistant's
        turn opened (special tokens come from the template, so none are added)."""
        tokenizer = self.gen.tokenizer
        if tokenizer is None:
            raise APIError("this model has no tokenizer; use /v1/completions with token ids", param="messages")
        if not body.messages:
            raise APIError("messages must not be empty", param="messages")
        template = self.config.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise APIError("this model's tokenizer has no chat template; start the server with "
                           "--chat-template FILE or use /v1/completions", param="messages")  # fmt: skip
        messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
                    for m in body.messages]  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a template's own error (roles must alternate...)
            raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        vocab = self.gen.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return self.gen.decode(prompt)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.gen.tokenizer
            text = str(token_id) if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    # ---------------------------------------------------------------- requests
    async def run(self, shape: Shape, prompts: list, params: SamplingParams, body, http: Request,
                  *, prompt_field: str):  # fmt: skip
        """Queue the samples of every prompt, then answer with JSON or a stream of events."""
        arrival = time.perf_counter()
        self.admit(len(prompts) * params.n)
        handles = self._submit(prompts, params, prompt_field, body)
        sub = self.driver.subscribe(handles, asyncio.get_running_loop())
        self.metrics.prompt_tokens.inc(sum(len(handles[i * params.n].prompt_token_ids) for i in range(len(prompts))))
        timing = _Timing(arrival, len(handles))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(shape, sub, params, timing, include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        try:
            if not await self._wait(sub, timing, http):
                return Response(status_code=499)  # nobody is listening (nginx's "client closed")
        finally:
            sub.cancel()  # only a client gone (or an error) leaves any running
            self._observe(sub.handles, timing)
        outputs = [h.output() for h in sub.handles]
        _raise_if_failed(sub.handles)
        return shape.response(outputs, params.n, _usage(outputs, params.n), speculation([o.metrics for o in outputs]))

    def _submit(self, prompts: list, params: SamplingParams, prompt_field: str, body) -> list[RequestHandle]:
        """Submit every prompt's samples, or none: a prompt that fails cancels those before it."""
        handles: list[RequestHandle] = []
        try:
            for prompt in prompts:
                handles += self.gen.submit_samples(prompt, params)
        except (TypeError, ValueError) as exc:
            for h in handles:
                h.cancel_soon()
            message, name = str(exc), field_of_message(str(exc)) or ""
            field = _submit_field(message, prompt_field, body)
            message = structured_message(message, field) if name == "structured_output" else renamed(message, name, field)
            raise APIError(message, param=field) from None
        return handles

    async def _wait(self, sub: Subscription, timing: _Timing, http: Request) -> bool:
        """Until every request of ``sub`` ended (``True``) or the client is gone (``False``)."""
        done = [h.done for h in sub.handles]
        poll = self.config.disconnect_poll_s
        next_check = time.monotonic() + poll
        while not all(done):
            item = await sub.next(poll)
            if time.monotonic() >= next_check:  # snapshots arrive every step: check by the clock
                if await http.is_disconnected():
                    return False
                next_check = time.monotonic() + poll
            if item is not None:
                i, view = item
                timing.saw(i, view)
                done[i] = view.finished
        return True

    async def _events(self, shape: Shape, sub: Subscription, params: SamplingParams, timing: _Timing,
                      include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
        """The server-sent events of a streamed response; a client that disconnects cancels
        the task iterating this (Starlette does), and the finally cancels the requests."""
        try:
            deltas = [h.text_deltas() for h in sub.handles]
            sent = [0] * len(sub.handles)
            for i in range(len(sub.handles)):
                for chunk in shape.opening(i):
                    yield _sse(chunk)
            done = [False] * len(sub.handles)
            while not all(done):
                i, view = await sub.next()
                timing.saw(i, view)
                text = deltas[i].pull(view)
                entries = None
                if params.logprobs is not None and len(view.output_ids) > sent[i]:
                    entries = sub.handles[i].token_logprobs(sent[i], len(view.output_ids))
                sent[i] = len(view.output_ids)
                if text or entries:
                    yield _sse(shape.chunk(i, text, entries))
                if view.finished:
                    done[i] = True
                    out = sub.handles[i].output()
                    if out.finish_reason == "error":
                        err = sub.handles[i].error
                        yield _sse({"error": {"message": f"request failed: {err}", "type": "server_error",
                                              "param": None, "code": None}})  # fmt: skip
                        continue
                    yield _sse(shape.chunk(i, "", None, finish_reason=out.finish_reason))
            if include_usage:
                outputs = [h.output() for h in sub.handles]
                yield _sse(shape.usage_chunk(_usage(outputs, params.n), speculation([o.metrics for o in outputs])))
            yield "data: [DONE]\n\n"
        finally:
            sub.cancel()
            self._observe(sub.handles, timing)

    def _observe(self, handles: Sequence[RequestHandle], timing: _Timing) -> None:
        now = time.perf_counter()
        for i, h in enumerate(handles):
            reason = h.finish_reason or "cancelled"
            self.metrics.request_ended(reason)
            self.metrics.latency.observe(now - timing.arrival)
            first = timing.first_token[i]
            if first is not None:
                self.metrics.ttft.observe(first - timing.arrival)
                n = len(h.output_ids)
                if n > 1 and timing.last[i] is not None:
                    self.metrics.tpot.observe((timing.last[i] - first) / (n - 1))


class _Timing:
    """When each request of a response showed its first token and its last."""

    def __init__(self, arrival: float, n: int) -> None:
        self.arrival = arrival
        self.first_token: list[float | None] = [None] * n
        self.last: list[float | None] = [None] * n

    def saw(self, i: int, view) -> None:
        if view.output_ids:
            now = time.perf_counter()
            if self.first_token[i] is None:
                self.first_token[i] = now
            self.last[i] = now


def _completion_prompts(prompt) -> list:
    """The prompts of a completions body: one string, strings, token ids, lists of ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _usage(outputs: Sequence[GenerationOutput], n: int) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs[::n])  # each prompt once
    return usage(prompt_tokens, sum(len(o.token_ids) for o in outputs))


def _raise_if_failed(handles: Sequence[RequestHandle]) -> None:
    for h in handles:
        if h.finish_reason == "error":
            raise APIError(f"request failed: {h.error}", status=500, type="server_error")


def _submit_field(message: str, prompt_field: str, body) -> str:
    """The request field a generator error is about: a params field it names, else the prompt."""
    name = field_of_message(message)
    if name not in _PARAM_FIELDS:
        return prompt_field
    if name == "structured_output":
        return (structured_fields(body) or ["response_format"])[0]
    chat = isinstance(body, ChatCompletionRequest)
    max_field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    return request_field(name, max_tokens_field=max_field, logprobs_field="top_logprobs" if chat else "logprobs")


_PARAM_FIELDS = frozenset(a.name for a in attrs.fields(SamplingParams))


def _validation_error(exc: RequestValidationError) -> APIError:
    """pydantic's first complaint as an OpenAI error naming the field (``messages.0.role``)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union types add the member's type name to the location: keep the field path only.
    loc = [p for p in loc if not (p[:1].isalpha() and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "extra_forbidden":
        return APIError(f"unknown field {param!r}", param=param)
    return APIError(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "literal_error"}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
