"""The server's settings (validated when built, before any model is loaded)."""

from __future__ import annotations

import attrs

from specdec.config import non_negative_float, positive_float, positive_int

__all__ = ["ServerConfig"]


def _keys(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    for key in value:
        if not isinstance(key, str) or not key:
            raise ValueError(f"{attribute.name} must hold non-empty strings, got {key!r}")


def _optional_text(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a string or None, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """How :func:`specdec.server.build_app` serves a generator.

    ``model_name``: the id clients send as ``model`` (and ``/v1/models`` lists).
    ``api_keys``: when given, every ``/v1`` request needs ``Authorization: Bearer <key>``
    (compared in constant time), and each key's requests share cached KV pages only with the
    same key's (a salt per key: shared pages are a timing side channel between users).
    ``max_pending``: requests accepted and not yet ended (running or queued); one more is a
    429 with ``Retry-After``. ``chat_template``: a Jinja chat template replacing the
    tokenizer's. ``drain_timeout_s``: on SIGINT/SIGTERM, how long in-flight requests may run
    before they are cancelled.
    """

    model_name: str = attrs.field(validator=attrs.validators.instance_of(str))
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_keys)
    max_pending: int = attrs.field(default=256, validator=positive_int)
    retry_after_s: int = attrs.field(default=1, validator=positive_int)
    chat_template: str | None = attrs.field(default=None, validator=_optional_text)
    disconnect_poll_s: float = attrs.field(default=0.25, validator=positive_float)
    drain_timeout_s: float = attrs.field(default=300.0, validator=non_negative_float)
