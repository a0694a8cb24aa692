"""Frozen configuration records with shared named validators.

Every config is ``@attrs.frozen(kw_only=True)``; change one with ``attrs.evolve``. Validators
run at construction, so bad input fails before any work starts, with the argument named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "SamplingParams",
    "CacheConfig",
    "boolean",
    "check_arg",
    "positive_int",
    "non_negative_int",
    "speculative_tokens",
]

# The widest draft any proposer may make per step. Verification cost grows with k while the
# chance that the last drafts survive shrinks geometrically: past a few dozen tokens a draft
# only sizes the KV cache for nothing.
MAX_SPECULATIVE_TOKENS = 64


def positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: an ``int`` >= 1 (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an int >= 1, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: an ``int`` >= 0 (bools rejected)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be an int >= 0, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def speculative_tokens(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: an ``int`` in ``1 .. MAX_SPECULATIVE_TOKENS`` (the one bound every proposer
    shares)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"{attribute.name} must be an int in 1..{MAX_SPECULATIVE_TOKENS}, "
            f"got {type(value).__name__}"
        )
    if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"{attribute.name} must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {value}"
        )


def boolean(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a real ``bool`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {type(value).__name__} {value!r}")


def seed_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: an ``int`` in [0, 2**64), the range ``torch.Generator.manual_seed`` takes."""
    non_negative_int(instance, attribute, value)
    if value >= 2**64:
        raise ValueError(f"{attribute.name} must be < 2**64, got {value}")


@attrs.frozen
class _Argument:
    """Stands in for an ``attrs.Attribute`` so a validator can check a plain argument."""

    name: str


def check_arg(validator, name: str, value: object) -> None:
    """Run an attrs ``validator`` of this module on a function argument named ``name``:
    the same rule and the same message as for a config field.

    >>> check_arg(positive_int, "batch_size", 0)
    Traceback (most recent call last):
    ...
    ValueError: batch_size must be >= 1, got 0
    """
    validator(None, _Argument(name), value)


def optional(validator):
    """Validator combinator: ``None`` passes, anything else goes to ``validator``."""

    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return check


def _finite_float(attribute: attrs.Attribute, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, got {value}")
    return float(value)


def non_negative_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a finite number >= 0."""
    if _finite_float(attribute, value) < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def positive_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a finite number > 0."""
    if not _finite_float(attribute, value) > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def unit_interval_open_closed(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a number in (0, 1]."""
    v = _finite_float(attribute, value)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def unit_interval_closed_open(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a number in [0, 1)."""
    v = _finite_float(attribute, value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value}")


def unit_interval_closed(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a number in [0, 1] (a probability)."""
    if not 0.0 <= _finite_float(attribute, value) <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


def layer_indices(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """Validator: a non-empty tuple of layer indices (ints >= 0, bools rejected)."""
    if (
        not isinstance(value, tuple)
        or not value
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value)
    ):
        raise ValueError(f"{attribute.name} must be a non-empty tuple of ints >= 0, got {value!r}")


def sequence_to_tuple(value: object) -> object:
    """Converter: a list or tuple becomes a tuple (JSON has only lists); anything else is left
    as it is for the field's validator to refuse."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _as_tuple(value: object, scalar: type) -> tuple:
    """``None`` -> ``()``, one ``scalar`` -> ``(value,)``, an iterable -> its tuple (so
    ``stop="x"`` is one stop string, not the characters of ``"x"``)."""
    if value is None:
        return ()
    if isinstance(value, scalar):
        return (value,)
    return tuple(value)


def _to_str_tuple(value: str | Iterable[str] | None) -> tuple[str, ...]:
    return _as_tuple(value, str)


def _to_int_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    return _as_tuple(value, int)


def _stop_strings(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    for s in value:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{attribute.name} must hold non-empty strings, got {s!r}")


def _token_ids(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"{attribute.name} must hold token ids >= 0, got {t!r}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request turns logits into tokens, and when it stops.

    ``temperature == 0`` is greedy decoding (no randomness; top-k/top-p/min-p ignored).
    ``top_k == 0`` and ``top_p == 1`` and ``min_p == 0`` switch those filters off.
    ``seed`` makes sampled output reproducible; ``None`` draws a fresh seed per request.

    Example:
        >>> SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    """

    max_new_tokens: int = attrs.field(default=64, validator=positive_int)
    temperature: float = attrs.field(default=0.0, validator=non_negative_float)
    top_k: int = attrs.field(default=0, validator=non_negative_int)
    top_p: float = attrs.field(default=1.0, validator=unit_interval_open_closed)
    min_p: float = attrs.field(default=0.0, validator=unit_interval_closed_open)
    seed: int | None = attrs.field(default=None, validator=optional(seed_int))
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_str_tuple, validator=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_to_int_tuple, validator=_token_ids
    )
    ignore_eos: bool = attrs.field(default=False, validator=boolean)
    logprobs: int | None = attrs.field(default=None, validator=optional(non_negative_int))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen(kw_only=True)
class CacheConfig:
    """Paged KV cache sizing, shared by every model of a generator.

    ``num_pages`` pages of ``page_size`` token slots each; every model (target, draft, heads)
    has its own page-pool tensors indexed by the same page ids. ``None`` sizes the pool to hold
    ``max_batch_size`` sequences of the target's full context.
    """

    page_size: int = attrs.field(default=16, validator=positive_int)
    num_pages: int | None = attrs.field(default=None, validator=optional(positive_int))
    max_batch_size: int = attrs.field(default=8, validator=positive_int)
    max_num_tokens: int | None = attrs.field(default=None, validator=optional(positive_int))
