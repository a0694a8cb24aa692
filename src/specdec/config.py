"""Frozen configuration records with shared named validators.

Every config is ``@attrs.frozen(kw_only=True)``; change one with ``attrs.evolve``. Validators
run at construction, so bad input fails before any work starts, with the argument named.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping

import attrs

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "SamplingParams",
    "StructuredOutput",
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


def _float_in(low: float, high: float):
    """Validator: a finite number in ``[low, high]``."""

    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not low <= _finite_float(attribute, value) <= high:
            raise ValueError(f"{attribute.name} must be in [{low}, {high}], got {value}")

    return check


# OpenAI's (and vLLM's) ranges: a bias of +-100 already bans or forces a token.
MAX_LOGIT_BIAS = 100.0
MAX_ADDITIVE_PENALTY = 2.0


def _to_bias_pairs(value: object) -> object:
    """Converter: a ``{token_id: bias}`` mapping (JSON keys may be strings of digits) becomes
    sorted ``(token_id, bias)`` pairs, hashable like the rest of a frozen config."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = []
        for key, bias in value.items():
            if isinstance(key, str) and key.strip().isdigit():
                key = int(key)
            pairs.append((key, bias))
        return tuple(sorted(pairs, key=lambda kv: (not isinstance(kv[0], int), str(kv[0]))))
    return value


def _bias_pairs(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, tuple):
        raise TypeError(
            f"{attribute.name} must be a mapping of token id -> bias, got {type(value).__name__}"
        )
    for pair in value:
        token, bias = pair
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"{attribute.name} keys must be token ids >= 0, got {token!r}")
        check = _float_in(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        check(instance, _Argument(f"{attribute.name}[{token}]"), bias)


def _to_optional_int_tuple(value: object) -> object:
    return None if value is None else _to_int_tuple(value)


def _allowed_ids(instance: object, attribute: attrs.Attribute, value: tuple | None) -> None:
    if value is None:
        return
    if not value:
        raise ValueError(
            f"{attribute.name} must hold at least one token id (None allows every token)"
        )
    _token_ids(instance, attribute, value)


def _processors(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, tuple):
        raise TypeError(f"{attribute.name} must be a sequence of callables")
    for i, fn in enumerate(value):
        if not callable(fn):
            raise TypeError(f"{attribute.name}[{i}] must be callable, got {type(fn).__name__}")


def _structured(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, StructuredOutput):
        raise TypeError(
            f"{attribute.name} must be a StructuredOutput or None, got {type(value).__name__}"
        )


def _json_schema(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, (str, dict)):
        raise TypeError(
            f"structured_output.json_schema must be a JSON schema (a dict or its JSON text), "
            f"got {type(value).__name__}"
        )


def _optional_str(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"structured_output.{attribute.name} must be a non-empty string, got {value!r}")


def _salt(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"cache_salt must be None or a non-empty string, got {value!r}")


def _choices(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, tuple) or not value:
        raise ValueError(f"structured_output.choice must be a non-empty list of strings, got {value!r}")
    for c in value:
        if not isinstance(c, str) or not c:
            raise ValueError(f"structured_output.choice must hold non-empty strings, got {c!r}")


def _freeze_schema(value: object) -> object:
    """A dict schema is kept as compact JSON text: hashable, one cache key per schema, and its
    property order kept (the grammar emits properties in schema order)."""
    if isinstance(value, dict):
        import json

        return json.dumps(value, separators=(",", ":"))  # key order kept: it orders the output
    return value


@attrs.frozen(kw_only=True)
class StructuredOutput:
    """Constrain a request's output to a JSON schema, a regex, one of some strings, or an EBNF
    grammar (exactly one of them).

    The constraint is a mask on the target's distribution at every position, so speculation
    keeps it exactly: drafts that leave the grammar are rejected (and drafts are masked too,
    so they rarely do). ``json_schema={}`` or ``json_object=True`` asks for any JSON object.
    The grammar is compiled when the request is submitted; a malformed one is a ``ValueError``
    naming the field.

    Example:
        >>> StructuredOutput(json_schema={"type": "object", "properties": {"n": {"type": "integer"}}})
        >>> StructuredOutput(choice=["yes", "no"])
    """

    json_schema: str | None = attrs.field(default=None, converter=_freeze_schema, validator=_json_schema)
    regex: str | None = attrs.field(default=None, validator=_optional_str)
    choice: tuple[str, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else sequence_to_tuple(v), validator=_choices
    )
    grammar: str | None = attrs.field(default=None, validator=_optional_str)
    json_object: bool = attrs.field(default=False, validator=boolean)

    def __attrs_post_init__(self) -> None:
        given = [
            name
            for name, v in (
                ("json_schema", self.json_schema),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if v is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured_output needs exactly one of json_schema, regex, choice, grammar, "
                f"json_object; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json_schema``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        for name in ("json_schema", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


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
    # --- options that transform the target's logits from the history (specdec.logits) ---
    # transformers' rule over prompt + output tokens: a seen token's logit is divided by the
    # penalty when positive, multiplied when negative; 1 is off.
    repetition_penalty: float = attrs.field(default=1.0, validator=positive_float)
    # OpenAI's rules over output tokens: logit -= frequency * count, -= presence * (count > 0).
    frequency_penalty: float = attrs.field(
        default=0.0, validator=_float_in(-MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY)
    )
    presence_penalty: float = attrs.field(
        default=0.0, validator=_float_in(-MAX_ADDITIVE_PENALTY, MAX_ADDITIVE_PENALTY)
    )
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=_to_bias_pairs, validator=_bias_pairs
    )
    allowed_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=_to_optional_int_tuple, validator=_allowed_ids
    )
    # Words (or phrases) never generated: every tokenisation with and without a leading space.
    bad_words: tuple[str, ...] = attrs.field(
        default=(), converter=_to_str_tuple, validator=_stop_strings
    )
    min_tokens: int = attrs.field(default=0, validator=non_negative_int)
    logits_processors: tuple[Callable, ...] = attrs.field(
        default=(), converter=sequence_to_tuple, validator=_processors
    )
    structured_output: StructuredOutput | None = attrs.field(default=None, validator=_structured)
    n: int = attrs.field(default=1, validator=positive_int)
    prompt_logprobs: int | None = attrs.field(default=None, validator=optional(non_negative_int))
    # Requests share cached KV pages only with requests of the same salt (vLLM's field): shared
    # pages make a prefix's prefill time visible to others, a side channel between users.
    cache_salt: str | None = attrs.field(default=None, validator=_salt)

    def __attrs_post_init__(self) -> None:
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError(
                "structured_output and ignore_eos contradict each other: a finished structure "
                "allows only the end-of-sequence token"
            )
        if self.n > 1 and self.is_greedy:
            raise ValueError(
                f"n = {self.n} needs temperature > 0: greedy samples of one prompt are all the same"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def transforms_logits(self) -> bool:
        """Whether any option changes the target's logits with the history (the engine then
        transforms every verify row with that row's own history)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.min_tokens
            or self.logits_processors
            or self.structured_output is not None
        )


@attrs.frozen(kw_only=True)
class CacheConfig:
    """Paged KV cache sizing, shared by every model of a generator.

    ``max_model_len``: the most tokens one request may reach, prompt + output (vLLM's name, and
    the CLI's ``--max-model-len``). ``None`` (the default) is the target's context,
    ``max_position_embeddings``; sliding-window models too, since every page of a sequence is
    kept (the window is a mask) and their positions run to the same end. A value above the
    context is a ``ValueError`` when the generator is built. A request past the limit (prompt +
    ``max_new_tokens``) is a ``ValueError`` at submission, never a silent cut.

    ``num_pages`` pages of ``page_size`` token slots each form one pool that every sequence
    draws from as it grows (the scheduler admits what fits and preempts when pages run out);
    every model (target, draft, heads) has its own page-pool tensors indexed by the same page
    ids. ``None`` sizes the pool for ``max_batch_size`` sequences of up to
    ``min(max_model_len, 4096)`` tokens each, and never below one sequence of
    ``max_model_len``: a 32k-context model at the default batch of 8 gets 8 x 4,096 token slots,
    not 8 x 32k, and a lone request may still fill its whole context. A pool larger than the
    device's free memory is a ``ValueError`` naming ``max_model_len`` and ``num_pages`` before it
    is allocated. ``prefix_caching`` keeps the full pages of finished prefixes for later
    requests with the same prefix (and salt).

    ``max_num_tokens`` is ``max_model_len``'s deprecated name (it read as a pool size, which it
    never was); it still works, with a ``DeprecationWarning``.

    Example:
        >>> CacheConfig(max_model_len=8192, max_batch_size=4)
    """

    page_size: int = attrs.field(default=16, validator=positive_int)
    num_pages: int | None = attrs.field(default=None, validator=optional(positive_int))
    max_batch_size: int = attrs.field(default=8, validator=positive_int)
    max_model_len: int | None = attrs.field(default=None, validator=optional(positive_int))
    max_num_tokens: int | None = attrs.field(default=None, validator=optional(positive_int))
    # Automatic prefix caching (specdec.kv.prefix_cache): requests sharing a prompt prefix
    # share its full KV pages instead of recomputing them.
    prefix_caching: bool = attrs.field(default=True, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.max_num_tokens is None:
            return
        if self.max_model_len is not None and self.max_model_len != self.max_num_tokens:
            raise ValueError(
                f"max_num_tokens ({self.max_num_tokens}) is the deprecated name of max_model_len "
                f"({self.max_model_len}); pass max_model_len only"
            )
        warnings.warn(
            "CacheConfig(max_num_tokens=...) is deprecated; use max_model_len (the same limit)",
            DeprecationWarning,
            stacklevel=3,
        )

    @property
    def sequence_limit(self) -> int | None:
        """``max_model_len`` as given under either name (``None``: the model's context)."""
        return self.max_model_len if self.max_model_len is not None else self.max_num_tokens
