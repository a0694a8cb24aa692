"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}``.

Every invalid request is a 400 naming the field it got wrong, whether JSON types
(pydantic) or values (the ``SamplingParams`` validators, one set of rules for the library and
the server) caught it; a full server is a 429 or 503 with ``Retry-After``.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

__all__ = ["APIError", "error_response", "field_of_message"]


class APIError(Exception):
    """An error answered to the client (never a 500): HTTP ``status``, OpenAI ``type``,
    the request field ``param`` it is about, and optional headers (``Retry-After``)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_response(err: APIError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


_LEADING_NAME = re.compile(r"^(?:params\.)?([A-Za-z_][A-Za-z0-9_]*)")


def field_of_message(message: str) -> str | None:
    """The field a specdec validation message names first (its messages begin with the
    field: ``"top_p must be in (0, 1], got 2"``), or ``None``.

    >>> field_of_message("params.stop_token_ids must be token ids in [0, 512), got [600]")
    'stop_token_ids'
    """
    match = _LEADING_NAME.match(message)
    return match.group(1) if match else None
