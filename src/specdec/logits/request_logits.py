"""One request's logits options as one transform: ``(history, logits) -> logits`` per row.

:class:`RequestLogits` applies, to each row of logits, every option of
:class:`~specdec.config.SamplingParams` that depends on the history, in this order:

1. masks: ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``structured_output``;
2. penalties: repetition, frequency, presence (:mod:`.penalties`);
3. ``logit_bias``;
4. the user's ``logits_processors`` (:mod:`.processors`).

Temperature, top-k, top-p and min-p follow in :func:`~specdec.sampling.processed_probs`.

Row ``r``'s history is the request's committed output plus ``extensions[r]``: the drafts on
that verify row's path (a chain's ``drafts[:r]``, a tree node's path). The engine calls
:meth:`RequestLogits.apply` on the target's verify rows, and chain proposers on their draft
rows, so every position sees exactly what plain decoding would have seen there.

A row where every token ends up masked has no distribution: :meth:`~RequestLogits.apply`
reports it as *dead* and hands back the row's input logits there (finite, so the verifier's
arithmetic stays defined). Plain decoding would stop at such a row, and the engine ends the
request there with ``finish_reason = "no_allowed_token"``.

Example:
    >>> rl = RequestLogits.build(SamplingParams(repetition_penalty=1.3), prompt_ids=[1, 2],
    ...                          vocab_size=32, eos_token_ids=(0,))
    >>> logits, dead = rl.apply(output_ids=[5], extensions=[[], [7]], logits=torch.randn(2, 32))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from specdec.config import SamplingParams
from specdec.logits.masks import allowed_mask, bad_word_bans, stop_ids_to_hold
from specdec.logits.penalties import additive_penalties, repetition_penalty, row_counts
from specdec.logits.processors import call_processor, processor_arity

__all__ = ["GrammarMask", "LogitsOptionError", "RequestLogits"]


class LogitsOptionError(RuntimeError):
    """A request's logits option produced invalid numbers (a user processor's NaN, say)."""


class GrammarMask(Protocol):
    """What :class:`RequestLogits` needs of a request's grammar state
    (:class:`specdec.logits.grammar.GrammarState`)."""

    def mask_rows(
        self, output_ids: Sequence[int], extensions: Sequence[Sequence[int]], logits: torch.Tensor
    ) -> None: ...


@attrs.define(eq=False)
class RequestLogits:
    """The history-dependent options of one request (module docstring); holds its grammar
    state, so one instance serves one request."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    vocab_size: int  # the target's logits width: bias ids and allowed ids are checked against it
    eos_token_ids: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences (masks.bad_word_sequences)
    grammar: GrammarMask | None = None
    processors: tuple[tuple[Callable, int, str], ...] = ()  # (fn, arity, name)
    _device_masks: dict = attrs.field(factory=dict)  # (what, device, width) -> tensor

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        *,
        prompt_ids: Sequence[int],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        bad_words: Sequence[tuple[int, ...]] = (),
        grammar: GrammarMask | None = None,
    ) -> RequestLogits:
        """Check the options against the vocabulary (ValueError naming the argument) and
        build the transform."""
        _check_ids("params.logit_bias", [t for t, _ in params.logit_bias], vocab_size)
        _check_ids("params.allowed_token_ids", params.allowed_token_ids or (), vocab_size)
        processors = tuple(
            (fn, processor_arity(fn, f"params.logits_processors[{i}]"), f"params.logits_processors[{i}]")
            for i, fn in enumerate(params.logits_processors)
        )
        return cls(
            params=params,
            prompt_ids=tuple(prompt_ids),
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos_token_ids),
            bad_words=tuple(tuple(w) for w in bad_words),
            grammar=grammar,
            processors=processors,
        )

    def apply(
        self,
        output_ids: Sequence[int],
        extensions: Sequence[Sequence[int]],
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, list[bool]]:
        """Transform each row of ``logits`` with its history.

        Args:
            output_ids: the request's committed output tokens.
            extensions: one per row, the tokens between the output and the row.
            logits: ``[rows, width]`` float raw logits (``width`` may differ from the target's
                vocabulary for a draft model's rows; ids past it are left out).

        Returns:
            ``[rows, width]`` transformed logits (a new tensor, float32 or wider) and, per row,
            whether it is dead (every token masked; its input logits are handed back).

        Raises:
            LogitsOptionError: a processor made NaN or ``+inf``.
        """
        if logits.shape[0] != len(extensions):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(extensions)} extensions")
        p = self.params
        raw = logits
        out = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()  # [rows, width]
        self._mask(out, output_ids, extensions)
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            out = self._penalise(out, output_ids, extensions)
        if p.logit_bias:
            ids, bias = self._bias(out.shape[1], out.device, out.dtype)
            out[:, ids] += bias
        if self.processors:
            out = self._user(out, output_ids, extensions)
        alive = (out > -torch.inf).any(dim=-1)  # [rows] bool
        dead = (~alive).tolist()
        if any(dead):
            out = torch.where(alive[:, None], out, raw.to(out.dtype))
        return out, dead

    # ----------------------------------------------------------------- the steps
    def _mask(self, out: torch.Tensor, output_ids, extensions) -> None:
        """Masks in place: allowed ids, bad words, min_tokens, the grammar."""
        p = self.params
        width = out.shape[1]
        if p.allowed_token_ids is not None:
            keep = self._cached("allowed", out.device, width, lambda: allowed_mask(p.allowed_token_ids, width, out.device))
            out.masked_fill_(~keep, -torch.inf)
        if self.bad_words or p.min_tokens:
            longest = max((len(w) for w in self.bad_words), default=1)
            tail = list(self.prompt_ids[-longest:]) + list(output_ids)
            for r, ext in enumerate(extensions):
                bans = bad_word_bans(tail + list(ext), self.bad_words) if self.bad_words else []
                bans += stop_ids_to_hold(
                    len(output_ids) + len(ext), p.min_tokens, self.eos_token_ids, p.stop_token_ids, p.ignore_eos
                )
                bans = [t for t in bans if t < width]
                if bans:
                    out[r, bans] = -torch.inf
        if self.grammar is not None:
            self.grammar.mask_rows(output_ids, extensions, out)

    def _penalise(self, out: torch.Tensor, output_ids, extensions) -> torch.Tensor:
        p = self.params
        width = out.shape[1]
        counts = row_counts(output_ids, extensions, width, out.device)  # [rows, width]
        if p.repetition_penalty != 1.0:
            in_prompt = self._cached(
                "prompt", out.device, width, lambda: allowed_mask(self.prompt_ids, width, out.device)
            )  # [width] bool
            out = repetition_penalty(out, (counts > 0) | in_prompt, p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = additive_penalties(
                out, counts, frequency=p.frequency_penalty, presence=p.presence_penalty
            )
        return out

    def _bias(self, width: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [(t, b) for t, b in self.params.logit_bias if t < width]

        def build():
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device)
            return ids, torch.tensor([b for _, b in pairs], dtype=dtype, device=device)

        return self._cached(("bias", dtype), device, width, build)

    def _user(self, out: torch.Tensor, output_ids, extensions) -> torch.Tensor:
        rows = []
        for r, ext in enumerate(extensions):
            history = tuple(output_ids) + tuple(ext)
            row = out[r]
            for fn, arity, name in self.processors:
                row = call_processor(fn, arity, self.prompt_ids, history, row.clone(), name)
                if bool(torch.isnan(row).any()) or bool((row == torch.inf).any()):
                    raise LogitsOptionError(f"{name} returned NaN or +inf logits")
            rows.append(row)
        return torch.stack(rows)

    def _cached(self, what, device, width, build):
        key = (what, str(device), width)
        value = self._device_masks.get(key)
        if value is None:
            value = self._device_masks[key] = build()
        return value


def _check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = sorted({t for t in ids if t >= vocab_size})
    if bad:
        raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:8]}")
