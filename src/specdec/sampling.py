"""Logits -> the processed distribution (temperature, top-k, top-p, min-p) and seeded draws.

:func:`processed_probs` is *the* processed distribution: plain sampling, draft sampling and
verification all go through it, so the distribution the verifier preserves is exactly the one
plain decoding would have sampled from. Its semantics are those of ``transformers``'
``TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper ->
softmax``, with one deliberate choice where those are ambiguous: tokens *tied* with the last
token a top-p cut keeps are kept too (``transformers`` keeps an arbitrary subset of them, by
sort order), which makes the result independent of sort order, as top-k and min-p already are.

Randomness comes only from a row's explicit source (:data:`RowRandom`): a
``torch.Generator`` stream (``None`` means the default RNG, for callers that do not need
reproducibility), or, for seeded requests, :class:`~specdec.noise.SeededNoise`, whose draw at
a token position depends on the seed and that position alone.

Example:
    >>> st = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_p=0.9)], "cpu")
    >>> probs = processed_probs(torch.randn(1, 32), st)  # [1, 32] float32, rows sum to 1
    >>> sample_from_probs(probs, [make_generator(0, "cpu")])  # [1] int64
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import attrs
import torch

from specdec.config import SamplingParams
from specdec.noise import SeededNoise, race_sample

__all__ = [
    "RowRandom",
    "SamplingTensors",
    "TorchSampler",
    "draw_uniforms",
    "generator_runs",
    "inverse_cdf",
    "logprobs_of",
    "make_generator",
    "processed_probs",
    "sample_from_probs",
    "shift_rows",
]

# One row's randomness: a generator stream, the default RNG (None), or position-keyed noise.
RowRandom = torch.Generator | SeededNoise | None

# Top-p first looks for its cut among this many highest logits (torch.topk, several times
# cheaper than a full sort at a 151,936-token vocabulary); rows whose cut lies further out
# retry alone with 8x as many, up to a full sort.
_TOP_P_FIRST_WIDTH = 1024
_TOP_P_WIDEN = 8


@attrs.frozen(eq=False)
class SamplingTensors:
    """Per-row sampling parameters as device tensors, plus host flags for the fast paths.

    Filters are switched off (``top_k = 0``, ``top_p = 1``, ``min_p = 0``) on greedy rows, so the
    flags describe only the rows that sample; the flags let :func:`processed_probs` skip the
    top-k/top-p search when no row filters.

    Example:
        >>> st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=50)], "cpu")
        >>> st.repeat_rows(5).num_rows  # one row per verify position
        5
    """

    params: tuple[SamplingParams, ...]  # host copy, one per row
    temperature: torch.Tensor  # [rows] float64, 1.0 on greedy rows (their one-hot ignores it)
    top_k: torch.Tensor  # [rows] int64, 0 = off
    top_p: torch.Tensor  # [rows] float64, 1.0 = off
    min_p: torch.Tensor  # [rows] float64, 0.0 = off
    greedy: torch.Tensor  # [rows] bool
    is_greedy: tuple[bool, ...]  # host copy of ``greedy``
    max_top_k: int  # largest top_k over sampled rows (0 when none filters by top-k)
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_greedy: bool

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> SamplingTensors:
        """One row per entry of ``params``, tensors on ``device``."""
        params = tuple(params)
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams, got {type(p).__name__}")
        greedy = tuple(p.is_greedy for p in params)
        temperature = [1.0 if p.is_greedy else p.temperature for p in params]
        top_k = [0 if p.is_greedy else p.top_k for p in params]
        top_p = [1.0 if p.is_greedy else p.top_p for p in params]
        min_p = [0.0 if p.is_greedy else p.min_p for p in params]
        return cls(
            params=params,
            temperature=torch.tensor(temperature, dtype=torch.float64, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float64, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            is_greedy=greedy,
            max_top_k=max(top_k, default=0),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(m > 0.0 for m in min_p),
            all_greedy=all(greedy),
        )

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def select_rows(self, rows: Sequence[int]) -> SamplingTensors:
        """The rows ``rows`` (host indices, in that order): a gather of the tensors already
        built, so one set per step serves every part of it."""
        rows = list(rows)
        index = torch.tensor(rows, dtype=torch.int64, device=self.device)  # [len(rows)]
        return self._derived([self.params[r] for r in rows], index)

    def repeat_rows(self, repeats: int) -> SamplingTensors:
        """Each row repeated ``repeats`` times in place (``[a, b] -> [a, a, b, b]`` for 2).

        A chain verify pass has ``width + 1`` logit rows per sequence, all under its params.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        rows = [r for r in range(self.num_rows) for _ in range(repeats)]
        return self.select_rows(rows)

    def _derived(self, params: list[SamplingParams], index: torch.Tensor) -> SamplingTensors:
        top_k = self.top_k[index]  # [rows]
        greedy = tuple(p.is_greedy for p in params)
        host_top_k = [0 if p.is_greedy else p.top_k for p in params]
        return SamplingTensors(
            params=tuple(params),
            temperature=self.temperature[index],
            top_k=top_k,
            top_p=self.top_p[index],
            min_p=self.min_p[index],
            greedy=self.greedy[index],
            is_greedy=greedy,
            max_top_k=max(host_top_k, default=0),
            any_top_k=any(k > 0 for k in host_top_k),
            any_top_p=any(not p.is_greedy and p.top_p < 1.0 for p in params),
            any_min_p=any(not p.is_greedy and p.min_p > 0.0 for p in params),
            all_greedy=all(greedy),
        )


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    # float64 stays float64 (the losslessness tests); bf16/fp16 logits are upcast because
    # top-p cumulative sums and inverse-CDF draws need float32 resolution.
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_logits(logits: torch.Tensor, st: SamplingTensors) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != st.num_rows:
        raise ValueError(
            f"logits has {logits.shape[0]} rows but the sampling params have {st.num_rows}"
        )
    if logits.shape[1] < 1:
        raise ValueError("logits must have a vocabulary of at least one token")


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] one-hot at the first maximal index (torch.argmax's tie rule)."""
    out = torch.zeros_like(logits)  # [rows, vocab]
    return out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _descending(scaled: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] the ``width`` highest values of each row, in descending order."""
    if width >= scaled.shape[1]:
        return torch.sort(scaled, dim=-1, descending=True).values
    return torch.topk(scaled, width, dim=-1, sorted=True).values


def _top_p_cutoff(
    scaled: torch.Tensor,  # [rows, vocab] temperature-scaled logits
    candidates: torch.Tensor,  # [rows, m] the m highest of each row, descending
    top_k_cutoff: torch.Tensor | None,  # [rows] lowest logit top-k keeps; None: top-k off
    top_p: torch.Tensor,  # [rows] float
) -> torch.Tensor:  # [rows]
    """The lowest logit top-p keeps per row.

    A token is kept when the probability of all tokens ranked above it is < top_p, which is
    transformers' rule (drop when the ascending cumulative sum <= 1 - top_p) read from the
    other end. Probabilities are those after top-k, normalised over the *whole* row, so a cut
    found among the candidates is exact; rows whose cut may lie past the candidates retry
    with more.
    """
    vocab = scaled.shape[1]
    if top_k_cutoff is None:
        log_norm = torch.logsumexp(scaled, dim=-1)  # [rows]
        cand = candidates
    else:
        in_top_k = scaled >= top_k_cutoff[:, None]  # [rows, vocab] bool
        log_norm = torch.logsumexp(torch.where(in_top_k, scaled, -torch.inf), dim=-1)
        cand = torch.where(candidates >= top_k_cutoff[:, None], candidates, -torch.inf)
    cand_probs = torch.exp(cand - log_norm[:, None])  # [rows, m]
    # Exclusive prefix sum by shifting (not cumsum - p, which adds round-off): the top token
    # sees exactly 0 < top_p and is always kept.
    mass_above = torch.nn.functional.pad(torch.cumsum(cand_probs, dim=-1)[:, :-1], (1, 0))
    num_kept = (mass_above < top_p[:, None]).sum(dim=-1)  # [rows] int64, >= 1
    cutoff = candidates.gather(1, (num_kept - 1)[:, None]).squeeze(1)  # [rows]

    width = candidates.shape[1]
    # Every candidate kept (and the last one still inside top-k): the cut may lie beyond them.
    incomplete = (num_kept == width) & (top_p < 1.0)  # [rows] bool
    if top_k_cutoff is not None:
        incomplete &= candidates[:, -1] >= top_k_cutoff
    if width < vocab and bool(incomplete.any()):  # host sync, only under top-p
        rows = incomplete.nonzero().squeeze(1)  # [retry]
        wider = scaled[rows]  # [retry, vocab]
        cutoff[rows] = _top_p_cutoff(
            wider,
            _descending(wider, min(vocab, width * _TOP_P_WIDEN)),
            None if top_k_cutoff is None else top_k_cutoff[rows],
            top_p[rows],
        )
    return cutoff


def _filter_cutoff(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[rows] the lowest scaled logit that top-k, top-p and min-p keep; ``-inf`` keeps all.

    Each filter keeps a prefix of the descending order, so together they reduce to one
    per-row threshold (the highest of the three) and never need a scatter back from sorted
    order. Ties with a threshold are kept (transformers' top-k and min-p rule; see the module
    docstring for top-p).
    """
    rows, vocab = scaled.shape
    cutoff = torch.full((rows,), -torch.inf, dtype=scaled.dtype, device=scaled.device)
    if st.any_top_k or st.any_top_p:
        # A top-p cut under top-k lies among the top-k candidates; only top-p alone needs more.
        top_p_alone = any(p.top_p < 1.0 and p.top_k == 0 for p in st.params if not p.is_greedy)
        width = min(vocab, max(st.max_top_k, _TOP_P_FIRST_WIDTH if top_p_alone else 1))
        candidates = _descending(scaled, width)  # [rows, width]
        top_k_cutoff = None
        if st.any_top_k:
            kth = (st.top_k.clamp(1, width) - 1)[:, None]  # [rows, 1]; top_k > vocab keeps all
            top_k_cutoff = torch.where(st.top_k > 0, candidates.gather(1, kth).squeeze(1), cutoff)
            cutoff = top_k_cutoff
        if st.any_top_p:
            top_p = st.top_p.to(scaled.dtype)  # [rows]
            top_p_cutoff = _top_p_cutoff(scaled, candidates, top_k_cutoff, top_p)
            cutoff = torch.where(top_p < 1.0, torch.maximum(cutoff, top_p_cutoff), cutoff)
    if st.any_min_p:
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p): the softmax's shared
        # normaliser cancels, so min-p needs no softmax and no renormalisation of its own.
        floor = scaled.amax(dim=-1) + torch.log(st.min_p.to(scaled.dtype))  # [rows]
        cutoff = torch.maximum(cutoff, floor)
    return cutoff


def _filtered_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[rows, vocab] temperature-scaled logits with filtered tokens at ``-inf`` (sampled rows).

    Greedy rows come back scaled by 1 and unfiltered; callers override them.
    """
    dtype = _compute_dtype(logits)
    raw = logits.to(dtype)
    # Shifting each row's maximum to 0 first changes no probability but keeps a tiny
    # temperature from overflowing logits / T to inf (and the softmax to NaN).
    peak = raw.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).min)  # [rows, 1]
    scaled = (raw - peak) / st.temperature.to(dtype)[:, None]  # [rows, vocab]
    if st.any_top_k or st.any_top_p or st.any_min_p:
        cutoff = _filter_cutoff(scaled, st)  # [rows]
        scaled = torch.where(scaled >= cutoff[:, None], scaled, -torch.inf)
    return scaled


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The processed distribution: temperature, top-k, top-p, min-p, then softmax.

    Args:
        logits: ``[rows, vocab]`` float, raw model logits.
        st: one row of parameters per logit row.

    Returns:
        ``[rows, vocab]`` float32 (float64 for float64 logits), each row summing to 1. Greedy
        rows (temperature 0) are one-hot at the argmax (the first index on ties).

    Example:
        >>> st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=2)], "cpu")
        >>> processed_probs(torch.tensor([[0.0, 1.0, 2.0]]), st)
        tensor([[0.0000, 0.2689, 0.7311]])
    """
    _check_logits(logits, st)
    if st.all_greedy:
        return _one_hot_argmax(logits.to(_compute_dtype(logits)))
    probs = torch.softmax(_filtered_logits(logits, st), dim=-1)  # [rows, vocab]
    if any(st.is_greedy):
        one_hot = _one_hot_argmax(logits.to(probs.dtype))  # [rows, vocab]
        probs = torch.where(st.greedy[:, None], one_hot, probs)
    return probs


def logprobs_of(
    logits: torch.Tensor, st: SamplingTensors, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``token_ids`` and the ``num_top`` likeliest tokens per row.

    Sampled rows report the processed distribution (filtered tokens get ``-inf``). Greedy rows
    report ``log_softmax`` of the raw logits instead: their processed distribution is one-hot,
    whose log-probabilities (0 and ``-inf``) say nothing about the model's confidence.

    Args:
        logits: ``[rows, vocab]`` float, raw model logits.
        st: one row of parameters per logit row.
        token_ids: ``[rows]`` int64, the tokens emitted.
        num_top: how many alternatives to report per row (0 for none).

    Returns:
        ``token_logprob`` ``[rows]``, ``top_ids`` ``[rows, num_top]`` int64 and
        ``top_logprobs`` ``[rows, num_top]`` (descending), float32 or float64 as for
        :func:`processed_probs`.
    """
    _check_logits(logits, st)
    if token_ids.shape != (st.num_rows,):
        raise ValueError(f"token_ids must be [{st.num_rows}], got {tuple(token_ids.shape)}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    raw = logits.to(_compute_dtype(logits))  # [rows, vocab]
    if not st.all_greedy:
        raw = torch.where(st.greedy[:, None], raw, _filtered_logits(logits, st))
    logprobs = torch.log_softmax(raw, dim=-1)  # [rows, vocab]
    token_logprob = logprobs.gather(1, token_ids.to(torch.int64)[:, None]).squeeze(1)  # [rows]
    top = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)
    return token_logprob, top.indices, top.values


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (``None``: a fresh random seed)."""
    if seed is None:
        seed = secrets.randbits(63)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def shift_rows(generators: Sequence[RowRandom], offset: int) -> list[RowRandom]:
    """Each row's randomness ``offset`` tokens further on: seeded rows move their position
    (draft step ``j`` draws at ``position + j``); generator streams just go on."""
    return [g.shifted(offset) if isinstance(g, SeededNoise) else g for g in generators]


def generator_runs(generators: Sequence[object]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive rows sharing one generator object (or
    ``None``): each run draws in one call."""
    runs, start = [], 0
    while start < len(generators):
        end = start + 1
        while end < len(generators) and generators[end] is generators[start]:
            end += 1
        runs.append((start, end))
        start = end
    return runs


def draw_uniforms(
    generators: Sequence[torch.Generator | None],
    counts: Sequence[int],
    device: torch.device | str,
) -> torch.Tensor:
    """``counts[i]`` uniforms in [0, 1) from ``generators[i]`` for each row, concatenated.

    Returns ``[sum(counts)]`` float64 on ``device``, row 0's draws first. Consecutive rows that
    share one generator object (or all use ``None``, the default RNG) are drawn in one call, so
    a batch of rows under one generator costs one kernel, not one per row.
    """
    if len(generators) != len(counts):
        raise ValueError(f"got {len(generators)} generators for {len(counts)} rows")
    if any(isinstance(g, SeededNoise) for g in generators):
        raise TypeError(
            "draw_uniforms takes torch.Generator streams; seeded rows (SeededNoise) draw by "
            "position through race_sample"
        )
    pieces: list[torch.Tensor] = []
    for start, end in generator_runs(generators):
        total = sum(counts[start:end])
        generator = generators[start]
        if generator is None:
            pieces.append(torch.rand(total, dtype=torch.float64, device=device))
        else:
            # Drawn on the generator's own device (a CPU generator cannot fill a CUDA tensor).
            draws = torch.rand(
                total, dtype=torch.float64, device=generator.device, generator=generator
            )
            pieces.append(draws.to(device))
    if not pieces:
        return torch.empty(0, dtype=torch.float64, device=device)
    return torch.cat(pieces)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ``i`` of each row such that ``cdf[i-1] <= u * total < cdf[i]``.

    Args:
        probs: ``[rows, vocab]`` non-negative weights (need not be normalised; each row must
            have some positive weight).
        uniforms: ``[rows]`` in [0, 1).

    Returns:
        ``[rows]`` int64. Never a zero-weight token: round-off that lands past the end of the
        CDF, or on a flat step of a non-sequentially summed CDF, moves to the nearest token
        with positive weight. ``-1`` for a row that is no distribution (weights not finite or
        all zero), never a made-up token.
    """
    rows, vocab = probs.shape
    cdf = torch.cumsum(probs, dim=-1)  # [rows, vocab]
    total = cdf[:, -1]  # [rows]
    valid = torch.isfinite(total) & (total > 0) & (probs >= 0).all(dim=-1)  # [rows] bool
    point = uniforms.to(cdf.dtype) * cdf[:, -1]  # [rows], scaling by the total renormalises
    index = torch.searchsorted(cdf, point[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    bad = probs.gather(1, index[:, None]).squeeze(1) <= 0  # [rows] bool
    if bool(bad.any()):  # host sync; taken only after round-off
        positions = torch.arange(vocab, device=probs.device)  # [vocab]
        positive = probs > 0  # [rows, vocab]
        before = torch.where(positive & (positions <= index[:, None]), positions, -1).amax(dim=-1)
        after = torch.where(positive & (positions > index[:, None]), positions, vocab).amin(dim=-1)
        nearest = torch.where(before >= 0, before, after).clamp(max=vocab - 1)  # [rows]
        index = torch.where(bad, nearest, index)
    return torch.where(valid, index, -1)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[RowRandom]) -> torch.Tensor:
    """One token per row: by inverse CDF with one uniform from the row's generator, or, for a
    row with :class:`~specdec.noise.SeededNoise`, by :func:`~specdec.noise.race_sample`.

    Args:
        probs: ``[rows, vocab]`` float, each row a distribution (or positive weights).
        generators: one per row; ``None`` uses the default RNG.

    Returns:
        ``[rows]`` int64; ``-1`` for a row that is no distribution (see :func:`inverse_cdf`).

    Example:
        >>> sample_from_probs(torch.tensor([[0.0, 1.0]]), [None])
        tensor([1])
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [rows, vocab], got shape {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {probs.shape[0]} rows")
    seeded = [i for i, g in enumerate(generators) if isinstance(g, SeededNoise)]
    if not seeded:
        uniforms = draw_uniforms(generators, [1] * probs.shape[0], probs.device)  # [rows]
        return inverse_cdf(probs, uniforms)
    streams = [i for i, g in enumerate(generators) if not isinstance(g, SeededNoise)]
    tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)  # [rows]
    index = torch.tensor(seeded, dtype=torch.int64, device=probs.device)
    tokens[index] = race_sample(probs[index], [generators[i] for i in seeded])
    if streams:
        index = torch.tensor(streams, dtype=torch.int64, device=probs.device)
        tokens[index] = sample_from_probs(probs[index], [generators[i] for i in streams])
    return tokens


class TorchSampler:
    """The reference :class:`~specdec.interfaces.Sampler`: pure torch, any device.

    Greedy rows take the argmax of the raw logits and consume no randomness, so a greedy
    request's output never depends on the generators; sampled rows draw from
    :func:`processed_probs` with their own generator.
    """

    def probs(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        sampling: SamplingTensors | None = None,
    ) -> torch.Tensor:
        """``[rows, vocab]`` processed distribution of ``logits`` ``[rows, vocab]``."""
        return processed_probs(logits, sampling or SamplingTensors.from_params(params, logits.device))

    def sample(
        self,
        logits: torch.Tensor,  # [rows, vocab] float
        params: Sequence[SamplingParams],
        generators: Sequence[RowRandom],
        *,
        sampling: SamplingTensors | None = None,
    ) -> torch.Tensor:
        """``[rows]`` int64: one token per logit row (``-1`` where a sampled row's processed
        distribution is not finite). ``sampling``: ``params`` as tensors, if the caller has
        them already (one set per engine step)."""
        st = sampling or SamplingTensors.from_params(params, logits.device)
        _check_logits(logits, st)
        if len(generators) != st.num_rows:
            raise ValueError(f"got {len(generators)} generators for {st.num_rows} rows")
        tokens = logits.argmax(dim=-1)  # [rows] int64
        if st.all_greedy:
            return tokens
        sampled = [i for i, greedy in enumerate(st.is_greedy) if not greedy]
        rows = torch.tensor(sampled, dtype=torch.int64, device=logits.device)  # [sampled]
        probs = processed_probs(logits[rows], st.select_rows(sampled))  # [sampled, vocab]
        tokens[rows] = sample_from_probs(probs, [generators[i] for i in sampled])
        return tokens
