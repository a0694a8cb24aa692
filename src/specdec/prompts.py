"""User input to requests: prompts normalised, params checked, limits enforced before any work.

Every check raises a ``ValueError``/``TypeError`` naming the argument before a request is
queued, so bad input leaves nothing in the cache or the queue.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from specdec.codec import TextCodec
from specdec.config import SamplingParams
from specdec.logits.masks import bad_word_sequences
from specdec.logits.request_logits import RequestLogits
from specdec.noise import row_key
from specdec.request import Request

__all__ = [
    "Prompt",
    "RequestMaker",
    "check_params",
    "normalize_prompts",
    "params_per_prompt",
    "sample_params",
    "single_prompt",
]

Prompt = str | Sequence[int]


def is_token(t: object) -> bool:
    """An integer token id: ``int`` or a numpy integer (``numbers.Integral``), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def as_lists(prompts: object) -> object:
    """Integer tensors and arrays (1-d: one prompt, 2-d: several) as nested lists of ints;
    floating or boolean ones are refused by name rather than silently truncated."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        dtype = prompts.dtype
        integral = (
            not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
            if isinstance(prompts, torch.Tensor)
            else np.issubdtype(dtype, np.integer)
        )
        if not integral or prompts.ndim not in (1, 2):
            raise TypeError(
                "prompts as a tensor or array must be 1-d or 2-d integer token ids, got "
                f"{prompts.ndim}-d {dtype}"
            )
        return prompts.tolist()
    if isinstance(prompts, (list, tuple)) and any(
        isinstance(p, (torch.Tensor, np.ndarray)) for p in prompts
    ):
        return [as_lists(p) if isinstance(p, (torch.Tensor, np.ndarray)) else p for p in prompts]
    return prompts


def normalize_prompts(prompts: object) -> tuple[bool, list[Prompt]]:
    """(is_single, list of prompts); raises TypeError naming ``prompts`` otherwise.

    Token ids may be ints, numpy integers, or integer tensors/arrays.

    >>> normalize_prompts([1, 2, 3])
    (True, [[1, 2, 3]])
    >>> normalize_prompts(["a", "b"])
    (False, ['a', 'b'])
    """
    if isinstance(prompts, str):
        return True, [prompts]
    prompts = as_lists(prompts)
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts must not be empty")
        if all(is_token(t) for t in prompts):
            return True, [[int(t) for t in prompts]]
        if all(isinstance(p, str) for p in prompts):
            return False, list(prompts)
        if all(isinstance(p, (list, tuple)) and all(is_token(t) for t in p) for p in prompts):
            return False, [[int(t) for t in p] for p in prompts]
    raise TypeError(
        "prompts must be a string, a list of token ids (ints, numpy integers, or a 1-d integer "
        "tensor/array), or a list of either, "
        f"got {type(prompts).__name__}"
    )


def single_prompt(prompt: object, method: str) -> Prompt:
    """The one prompt ``method`` takes (normalised); TypeError for a list of prompts."""
    single, prompt_list = normalize_prompts(prompt)
    if not single:
        raise TypeError(f"{method} takes one prompt (a string or a list of token ids)")
    return prompt_list[0]


def check_params(params: SamplingParams | None) -> SamplingParams:
    """``params``, or the default ``SamplingParams()`` for ``None``; TypeError otherwise."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def params_per_prompt(params: object, num_prompts: int) -> list[SamplingParams]:
    """One checked SamplingParams per prompt from one for all or a list of one each."""
    if not isinstance(params, (list, tuple)):
        return [check_params(params)] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(
            f"params has {len(params)} entries for {num_prompts} prompts; pass one "
            "SamplingParams or one per prompt"
        )
    return [check_params(p) for p in params]


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The ``params.n`` samples of one prompt as ``n = 1`` params: sample 0 keeps the seed (so
    its tokens are those of the same request with ``n = 1``), sample ``i`` gets a seed derived
    from it (:func:`specdec.noise.row_key`); unseeded samples each draw from a stream of their
    own."""
    if params.n == 1:
        return [params]
    seeds = [params.seed] + [
        None if params.seed is None else row_key(params.seed, -1 - i) for i in range(1, params.n)
    ]
    return [attrs.evolve(params, n=1, seed=seed) for seed in seeds]


@attrs.frozen(kw_only=True, eq=False)
class RequestMaker:
    """Turns one prompt and its params into a checked :class:`Request` of one generator.

    Example:
        >>> maker.make([1, 2, 3], SamplingParams(max_new_tokens=8), codec).max_total_tokens
        11
    """

    vocab_size: int
    # Prompt + output tokens one request may reach: the least of the target's context,
    # CacheConfig.max_model_len and what the page pool holds for one sequence.
    max_len: int
    length_bound: str  # which of those it is, and how to raise it (for the errors)
    eos_token_ids: frozenset[int]
    new_seq_id: Callable[[], int]
    new_stream: Callable[[], torch.Generator]  # an unseeded sampled request's random stream

    def make(self, prompt: Prompt, params: SamplingParams, codec: TextCodec) -> Request:
        """The request of ``prompt`` (text or token ids, already normalised); ValueError
        naming what does not fit the model, the KV cache or the tokenizer: a prompt or
        ``max_new_tokens`` past :attr:`max_len` is refused, never cut short."""
        if params.n != 1:
            # One request is one sample: generate() splits n > 1 into n requests
            # (sample_params); a handle streams one sample only.
            raise ValueError(
                f"params.n = {params.n}: submit() and stream() take n = 1 (one handle, one "
                "sample); generate() returns the n samples of a prompt"
            )
        ids = self._token_ids(prompt, codec)
        max_total = self._max_total(ids, params)
        self._check_stops(params, codec)
        transform = self._transform(ids, params, codec) if params.transforms_logits else None
        return Request(
            seq_id=self.new_seq_id(),
            prompt_ids=ids,
            params=params,
            # Seeded requests draw position-keyed noise (Request.randomness); only unseeded
            # sampled requests keep a stream.
            generator=None if params.is_greedy or params.seed is not None else self.new_stream(),
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=max_total,
            decode=(lambda out, ctx=ids: codec.decode_output(ctx, out)) if params.stop else None,
            transform=transform,
        )

    def _transform(self, ids: list[int], params: SamplingParams, codec: TextCodec) -> RequestLogits:
        """The request's logits options, checked against the vocabulary and the tokenizer; a
        grammar is compiled here (cached per tokenizer), so a bad one fails before any work."""
        if params.bad_words and codec.tokenizer is None:
            raise ValueError("params.bad_words needs a tokenizer (this generator has none)")
        bad_words = bad_word_sequences(params.bad_words, codec.encode_plain)
        grammar = None
        if params.structured_output is not None:
            compiler = codec.grammar_compiler(self.vocab_size, sorted(self.eos_token_ids))
            grammar = compiler.new_state(params.structured_output)
        return RequestLogits.build(
            params,
            prompt_ids=ids,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            bad_words=bad_words,
            grammar=grammar,
        )

    def _token_ids(self, prompt: Prompt, codec: TextCodec) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt must not be empty (got the empty string)")
        ids = codec.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty (it encodes to zero tokens)")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, but the maximum sequence length is {self.max_len} "
                f"({self.length_bound}), so a prompt may have at most {self.max_len - 1}"
            )
        return ids

    def _max_total(self, ids: list[int], params: SamplingParams) -> int:
        """Prompt + output tokens the request may reach: all it asks for, or a ValueError
        naming ``max_new_tokens`` (vLLM's message, with the numbers)."""
        total = len(ids) + params.max_new_tokens
        if total > self.max_len:
            raise ValueError(
                f"max_new_tokens must be at most {self.max_len - len(ids)} for this "
                f"{len(ids)}-token prompt: the maximum sequence length is {self.max_len} tokens "
                f"({self.length_bound}), and {total} were requested ({len(ids)} in the prompt, "
                f"{params.max_new_tokens} in the completion)"
            )
        return total

    def _check_stops(self, params: SamplingParams, codec: TextCodec) -> None:
        if params.stop and codec.tokenizer is None:
            raise ValueError("params.stop needs a tokenizer; use stop_token_ids instead")
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise ValueError(
                f"params.stop_token_ids must be token ids in [0, {self.vocab_size}), got {bad_stops}"
            )
