"""User logits processors: the Protocols a ``SamplingParams.logits_processors`` entry follows.

A processor is a pure function of the history before a position and the target's logits
there. specdec calls it once per verify row with that row's own history (the drafts before
the row included), so it must not keep state across calls: a call on a draft position that is
later rejected must leave no trace. Two forms are accepted, told apart by their number of
positional parameters (vLLM's forms):

- ``fn(output_ids, logits) -> logits``
- ``fn(prompt_ids, output_ids, logits) -> logits``

``output_ids`` is a tuple of the generated token ids before the position; ``logits`` is the
``[vocab]`` float row (already transformed by the built-in options); the result must be a
tensor of the same shape. NaN or ``+inf`` in a result fails that request with a clear error.

Example:
    >>> def no_digit_after_digit(output_ids, logits):
    ...     if output_ids and output_ids[-1] in DIGITS:
    ...         logits[list(DIGITS)] = -float("inf")
    ...     return logits
    >>> SamplingParams(logits_processors=[no_digit_after_digit])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

__all__ = ["LogitsProcessor", "PromptLogitsProcessor", "call_processor", "processor_arity"]


@runtime_checkable
class LogitsProcessor(Protocol):
    """``(output_ids, logits[vocab]) -> logits[vocab]``."""

    def __call__(self, output_ids: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class PromptLogitsProcessor(Protocol):
    """``(prompt_ids, output_ids, logits[vocab]) -> logits[vocab]``."""

    def __call__(
        self, prompt_ids: tuple[int, ...], output_ids: tuple[int, ...], logits: torch.Tensor
    ) -> torch.Tensor: ...


def processor_arity(fn: Callable, name: str) -> int:
    """2 or 3: how many positional arguments ``fn`` takes; ValueError naming ``name`` else."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 2  # a builtin without a signature: the common form
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    for arity in (2, 3):
        if len(required) <= arity <= len(positional):
            return arity
    raise ValueError(
        f"{name} must take (output_ids, logits) or (prompt_ids, output_ids, logits); "
        f"it takes {len(positional)} positional parameters"
    )


def call_processor(
    fn: Callable,
    arity: int,
    prompt_ids: tuple[int, ...],
    output_ids: tuple[int, ...],
    logits: torch.Tensor,  # [vocab]
    name: str,
) -> torch.Tensor:  # [vocab]
    """One processor on one row; TypeError/ValueError naming ``name`` for a malformed result."""
    out = fn(output_ids, logits) if arity == 2 else fn(prompt_ids, output_ids, logits)
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name} must return a tensor of shape {tuple(logits.shape)}, got {got}")
    return out.to(logits.dtype)

