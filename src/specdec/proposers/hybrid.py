"""Suffix decoding where the text repeats, a model where it does not: per request and step.

:class:`SuffixHybrid` holds a :class:`~specdec.proposers.suffix.SuffixDecoding` and one model
proposer (a draft model, an MTP head or an EAGLE tree). Each step, for each request, it asks
the suffix indexes for their best tree, then a :class:`HybridRule` decides who drafts for that
request: the suffix tree (free: no forward pass) or the model (a chain or tree that costs its
forward passes). The default rule, :class:`CostRule`, compares expected tokens per unit of
time from what it measures live:

- the suffix tree's expected accepted tokens (its score: path probabilities from the index's
  counts), times a per-request calibration (accepted / predicted on the request's suffix steps,
  starting from the generator's);
- the model's expected accepted tokens from the request's per-position acceptance on its
  model steps (accepted / (accepted + rejections), moving averages of both; a chain of k at
  acceptance a: a + a^2 + ... + a^k; the generator-wide rate before the request has any);
- the model's drafting time relative to the target pass (both timed here: ``propose`` of the
  model, and from the end of drafting to ``on_target_step``), measured on calls that caught up
  on nothing;
- the model's catch-up: a request its suffix trees drafted has tokens the model never ran (a
  whole prompt when the model has not drafted for it yet), which its next model step runs
  first. Priced per token (measured on the calls that caught up), spread over the steps the
  request has left, as the model drafts on from there.

A request drafts from the suffix tree when ``1 + suffix_expected >= (1 + model_expected) /
(1 + draft_cost + catch_up)``. (Unpriced, one catch-up of a 600-token chat on a 2-core AMD
machine cost more than the suffix trees saved on the whole request.) How many tokens stay the
policy's choice (k per request), and the suffix
tree shrinks with its match as always.

Lossless with any rule: each request's drafts are verified by the tree rules, a chain as a
one-path tree (with one child per node the tree rule is the chain rule). When an unseeded
sampled request takes the model's drafts the proposal carries their distributions; a suffix
tree's rows are then all zero, which the tree rule judges as fixed (deterministic) choices,
as it judges a proposal without distributions. Greedy and seeded requests never read them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch

from specdec.interfaces import DraftForecast, ProposeContext, TargetStep
from specdec.kv.paged import KVSpec
from specdec.proposers.suffix import SuffixDecoding
from specdec.proposers.suffix_tree import DraftTree
from specdec.types import DraftProposal, ProposalKind, RequestEnd, pad_rows

__all__ = ["CostRule", "HybridRule", "SuffixHybrid"]


class HybridRule(Protocol):
    """Decides, per request, whether its suffix tree drafts (``True``) or the model does.

    ``lag``: tokens of the request the model has not run (its next drafting step runs them
    first); ``remaining``: tokens the request may still emit (``None``: unknown)."""

    def prefer_suffix(
        self, seq_id: int, tree: DraftTree, k: int, lag: int = 0, remaining: int | None = None
    ) -> bool: ...

    def value(
        self, seq_id: int, tree: DraftTree, k: int, lag: int = 0, remaining: int | None = None
    ) -> tuple[float, float]:
        """(expected tokens per step-time from the suffix tree, from the model)."""
        ...

    def observe(self, seq_id: int, used_suffix: bool, predicted: float, drafted: int, accepted: int) -> None: ...

    def observe_times(self, draft_s: float | None, target_s: float, unseen: int = 0) -> None:
        """The model's ``propose`` took ``draft_s`` (``None``: it did not draft), catching up
        on ``unseen`` tokens in all; the target pass after it ``target_s``."""
        ...

    def release(self, seq_id: int) -> None: ...


def chain_expectation(acceptance: float, k: int) -> float:
    """Expected accepted drafts of a k-chain whose tokens are each accepted with
    ``acceptance`` until the first rejection: a + a^2 + ... + a^k.

    >>> round(chain_expectation(0.5, 3), 3)
    0.875
    """
    a = min(max(acceptance, 0.0), 0.999)
    return a * (1 - a**k) / (1 - a)


@attrs.define
class _Acceptance:
    """Moving averages of a model's accepted drafts and rejections per step: the per-position
    acceptance under the truncated-geometric model is their ratio ``accepted / (accepted +
    rejections)`` (:func:`~specdec.policy.acceptance.acceptance_estimate`). Accepted / drafted
    is not it: a 4-chain at 0.8 per position accepts 2.36 of 4 on average, and 0.59 fed back
    into :func:`chain_expectation` priced the model's steps at 1.26 accepted instead of 2.36."""

    accepted: float
    rejections: float

    def update(self, weight: float, drafted: int, accepted: int) -> None:
        rejected = 1.0 if accepted < drafted else 0.0
        self.accepted += weight * (accepted - self.accepted)
        self.rejections += weight * (rejected - self.rejections)

    def rate(self) -> float:
        total = self.accepted + self.rejections
        return self.accepted / total if total > 0 else 1.0

    @classmethod
    def at(cls, acceptance: float) -> _Acceptance:
        """One step's worth of averages at ``acceptance`` (a prior)."""
        a = min(max(acceptance, 0.0), 0.99)
        return cls(a / (1.0 - a), 1.0)


@attrs.define
class _RequestStats:
    suffix_ratio: float = 1.0  # accepted / predicted on suffix steps (EMA)
    model: _Acceptance | None = None  # on the request's model steps


@attrs.define
class CostRule:
    """The default :class:`HybridRule`: expected tokens per unit of time, from live acceptance
    and measured costs (see the module docstring). ``decay``: weight of the newest
    observation in every moving average."""

    decay: float = 0.3
    prior_acceptance: float = 0.6  # the model's acceptance before anything is measured
    draft_cost: float = 0.0  # model drafting time / target pass time (EMA, measured)
    catchup_cost: float | None = None  # per caught-up token / target pass time (EMA, measured)
    model_acceptance: _Acceptance | None = None  # generator-wide
    # Generator-wide accepted and predicted per suffix step (moving averages): a new request's
    # calibration starts at their ratio. (At 1.0, a fresh prompt's trees, matched once in an
    # earlier output, each node at probability 1, were taken at their word: forecast 1 of 1,
    # accepted none, and a batch-4 run drafted for them at 0.87x plain.)
    suffix_accepted: float = 1.0
    suffix_predicted: float = 1.0
    _requests: dict[int, _RequestStats] = attrs.field(factory=dict)

    def _stats(self, seq_id: int) -> _RequestStats:
        stats = self._requests.get(seq_id)
        if stats is None:
            stats = self._requests[seq_id] = _RequestStats(self.suffix_accepted / self.suffix_predicted)
        return stats

    def expected(self, seq_id: int, tree: DraftTree, k: int) -> tuple[float, float]:
        """Expected accepted drafts: the suffix tree's (its score, calibrated on the request's
        suffix steps) and the model's k-chain's (at the request's per-position acceptance)."""
        stats = self._stats(seq_id)
        measured = stats.model if stats.model is not None else self.model_acceptance
        rate = self.prior_acceptance if measured is None else measured.rate()
        return stats.suffix_ratio * tree.score, chain_expectation(rate, k)

    def value(
        self, seq_id: int, tree: DraftTree, k: int, lag: int = 0, remaining: int | None = None
    ) -> tuple[float, float]:
        suffix, model = self.expected(seq_id, tree, k)
        emitted = 1.0 + model
        return 1.0 + suffix, emitted / (1.0 + self.draft_cost + self.catchup_share(lag, remaining, emitted))

    def catchup_share(self, lag: int, remaining: int | None, per_step: float) -> float:
        """A catch-up on ``lag`` tokens in target passes, spread over the model steps (``per_step``
        tokens each) of a request with ``remaining`` tokens left (all of it at once when
        unknown); 0 before one is measured (tried once, then priced)."""
        if lag <= 0 or not self.catchup_cost:
            return 0.0
        steps = 1.0 if remaining is None else max(1.0, remaining / per_step)
        return self.catchup_cost * lag / steps

    def prefer_suffix(
        self, seq_id: int, tree: DraftTree, k: int, lag: int = 0, remaining: int | None = None
    ) -> bool:
        if not tree.tokens:
            return False
        suffix, model = self.value(seq_id, tree, k, lag, remaining)
        return suffix >= model

    def observe(self, seq_id: int, used_suffix: bool, predicted: float, drafted: int, accepted: int) -> None:
        stats = self._stats(seq_id)
        d = self.decay
        if used_suffix:
            if predicted > 0:
                stats.suffix_ratio += d * (min(accepted / predicted, 4.0) - stats.suffix_ratio)
                self.suffix_accepted += 0.1 * (min(accepted, 4.0 * predicted) - self.suffix_accepted)
                self.suffix_predicted += 0.1 * (predicted - self.suffix_predicted)
        elif drafted:
            if self.model_acceptance is None:
                self.model_acceptance = _Acceptance.at(self.prior_acceptance)
            if stats.model is None:
                # From the generator's: started from its own first step, one step that
                # accepted nothing priced the model at 0 for the request, which then never
                # drafted from it again (weak suffix trees and plain steps for the rest).
                stats.model = attrs.evolve(self.model_acceptance)
            stats.model.update(d, drafted, accepted)
            self.model_acceptance.update(0.1, drafted, accepted)

    def observe_times(self, draft_s: float | None, target_s: float, unseen: int = 0) -> None:
        if draft_s is None or target_s <= 0:
            return
        if unseen <= 0:
            self.draft_cost += self.decay * (draft_s / target_s - self.draft_cost)
            return
        # The call caught up too: what it took beyond a drafting step, per caught-up token.
        per_token = max(0.0, draft_s / target_s - self.draft_cost) / unseen
        if self.catchup_cost is None:
            self.catchup_cost = per_token
        else:
            self.catchup_cost += self.decay * (per_token - self.catchup_cost)

    def release(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)


class SuffixHybrid:
    """Suffix decoding and a model proposer, chosen per request and step (module docstring).

    Example:
        >>> hybrid = SuffixHybrid(DraftModel.from_pretrained("qwen2.5-coder-0.5b-instruct",
        ...                                                  num_speculative_tokens=6))
        >>> gen = Generator.from_pretrained("qwen2.5-coder-1.5b-instruct", proposer=hybrid)
    """

    kind = ProposalKind.TREE

    def __init__(self, model, suffix: SuffixDecoding | None = None, *, rule: HybridRule | None = None) -> None:
        if getattr(model, "kind", None) not in (ProposalKind.CHAIN, ProposalKind.TREE):
            raise TypeError(f"model must be a chain or tree proposer, got {type(model).__name__}")
        if isinstance(model, (SuffixDecoding, SuffixHybrid)):
            raise TypeError("model must be a model proposer (a draft model, an MTP head, an EAGLE tree)")
        self.model = model
        self.suffix = suffix if suffix is not None else SuffixDecoding()
        if not isinstance(self.suffix, SuffixDecoding):
            raise TypeError(f"suffix must be a SuffixDecoding, got {type(self.suffix).__name__}")
        self.rule = rule if rule is not None else CostRule()
        self.num_speculative_tokens = max(model.num_speculative_tokens, self.suffix.num_speculative_tokens)
        self.needs_target_hidden = model.needs_target_hidden
        self._steps: dict[int, tuple[bool, float, int]] = {}  # seq_id -> (suffix?, predicted, drafted)
        self._draft_s: float | None = None
        self._draft_unseen = 0  # tokens the model caught up on in its last propose call
        self._drafted_at: float | None = None
        # (seq_id, history length) -> the suffix tree forecast for it this step (forecaster)
        self._forecast_trees: dict[tuple[int, int], DraftTree] = {}
        # (seq_id, history length, n) -> whether the forecast at n drafts from the suffix tree
        self._forecast_sides: dict[tuple[int, int, int], bool] = {}
        self.num_suffix_steps = 0  # request steps drafted by each side, for metrics and tests
        self.num_model_steps = 0

    # ---- what the generator reads: the model's pools, hidden states, prefix caching ---------

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return self.model.kv_specs()

    def attach(self, target) -> None:
        if hasattr(self.model, "attach"):
            self.model.attach(target)

    @property
    def target_hidden_layers(self):
        return getattr(self.model, "target_hidden_layers", None)

    def __getattr__(self, name: str):
        # SharesCachedPrefix (kv_lookahead, kv_valid_slots, adopt_prefix), UsesTargetTokenizer
        # (set_target_tokenizer) and ReportsLag (lag: the model's, as only the model catches
        # up) are the model's: present exactly when the model has them. (No CapturesGraphs:
        # the model drafts eagerly.)
        if name in ("kv_lookahead", "kv_valid_slots", "adopt_prefix", "catches_up_from_tokens",
                    "set_target_tokenizer", "lag"):  # fmt: skip
            return getattr(self.__dict__["model"], name)
        raise AttributeError(name)

    # ---- lifecycle -------------------------------------------------------------------------

    def on_request_start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        self.suffix.on_request_start(seq_id, prompt_ids)
        if hasattr(self.model, "on_request_start"):
            self.model.on_request_start(seq_id, prompt_ids)

    def on_request_end(self, seq_id: int, reason: RequestEnd) -> None:
        self.suffix.on_request_end(seq_id, reason)
        if hasattr(self.model, "on_request_end"):
            self.model.on_request_end(seq_id, reason)

    def release(self, seq_id: int) -> None:
        self.suffix.release(seq_id)
        self.model.release(seq_id)
        self.rule.release(seq_id)
        self._steps.pop(seq_id, None)

    def on_target_step(self, step: TargetStep) -> None:
        if self._drafted_at is not None:  # the target pass of the step this proposer drafted
            self.rule.observe_times(self._draft_s, time.perf_counter() - self._drafted_at, self._draft_unseen)
            self._drafted_at = None
        for seq_id, accepted in zip(step.seq_ids, step.num_accepted):
            taken = self._steps.pop(seq_id, None)
            if taken is not None:
                used_suffix, predicted, drafted = taken
                self.rule.observe(seq_id, used_suffix, predicted, drafted, accepted)
        self.suffix.on_target_step(step)
        self.model.on_target_step(step)

    # ---- drafting --------------------------------------------------------------------------

    def forecaster(
        self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]], remaining: Sequence[int]
    ) -> Callable[[int], tuple[DraftForecast, ...]] | None:
        """What each request would draft at ``n`` nodes: its suffix tree's best ``n`` nodes
        or the model's ``min(n, k)``, as the rule would choose, with the rule's expected
        accepted drafts (``None`` for a rule without ``expected``). Trees are grown once, at
        the suffix's full size, on the first call. ``propose`` at a size forecast drafts what
        the forecast said: the same tree prefixes, each request from the side forecast (the
        rule is not asked again: a rule that flips coins would answer differently)."""
        expected = getattr(self.rule, "expected", None)
        if expected is None:
            return None
        self._forecast_trees, self._forecast_sides = {}, {}
        k_suffix = self.suffix.num_speculative_tokens
        grown: list[DraftTree] = []
        lags: list[int] = []
        said: dict[int, tuple[DraftForecast, ...]] = {}  # n -> forecasts: asked twice, same answer

        def at(n: int) -> tuple[DraftForecast, ...]:
            if n in said:
                return said[n]
            if not grown:
                for s, h in zip(seq_ids, token_ids):
                    grown.append(self.suffix.tree_for(s, h, k_suffix))
                    self._forecast_trees[s, len(h)] = grown[-1]
                lags.extend(self._lag(s, len(h)) for s, h in zip(seq_ids, token_ids))
            k_model = min(n, self.model.num_speculative_tokens)
            out = []
            for s, h, full, lag, left in zip(seq_ids, token_ids, grown, lags, remaining):
                tree = full.prefix(min(n, k_suffix))
                use_suffix = self.rule.prefer_suffix(s, tree, k_model, lag, left)
                self._forecast_sides[s, len(h), n] = use_suffix  # what propose at n will do
                if use_suffix:
                    out.append(DraftForecast(len(tree.tokens), expected(s, tree, k_model)[0], model=False))
                else:
                    out.append(DraftForecast(k_model, expected(s, tree, k_model)[1], model=True, catchup=lag))
            said[n] = tuple(out)
            return said[n]

        return at

    def _tree(self, seq_id: int, token_ids: Sequence[int], k: int) -> DraftTree:
        """The request's suffix tree of at most ``k`` nodes: the forecast's, cut to ``k`` (so the
        step drafts what the policy was told), else grown now."""
        grown = self._forecast_trees.get((seq_id, len(token_ids)))
        return grown.prefix(k) if grown is not None else self.suffix.tree_for(seq_id, token_ids, k)

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        k = ctx.num_speculative_tokens
        k_suffix = min(k, self.suffix.num_speculative_tokens)
        k_model = min(k, self.model.num_speculative_tokens)  # each side within its own width
        n = len(ctx.seq_ids)
        trees = [self._tree(s, h, k_suffix) for s, h in zip(ctx.seq_ids, ctx.token_ids)]
        lags, remaining = self._lags(ctx), _remaining(ctx)
        forecast = [self._forecast_sides.get((s, len(h), k)) for s, h in zip(ctx.seq_ids, ctx.token_ids)]
        use_suffix = [
            self.rule.prefer_suffix(s, t, k_model, lag, left) if side is None else side
            for s, t, lag, left, side in zip(ctx.seq_ids, trees, lags, remaining, forecast)
        ]
        self._forecast_trees, self._forecast_sides = {}, {}
        model_rows = [i for i in range(n) if not use_suffix[i]]
        model_out, self._draft_s = None, None
        self._draft_unseen = sum(lags[i] for i in model_rows)
        if model_rows:
            start = time.perf_counter()
            model_out = self.model.propose(_select(ctx, model_rows, k_model))
            self._draft_s = time.perf_counter() - start
        tokens: list[list[int]] = [[] for _ in range(n)]
        parents: list[list[int]] = [[] for _ in range(n)]
        transforms = ctx.logits_transforms or (None,) * n
        for i in range(n):
            if use_suffix[i]:
                tokens[i], parents[i] = trees[i].tokens, trees[i].parents
                if transforms[i] is not None:  # drafts the request's masks forbid: pruned
                    tokens[i], parents[i] = transforms[i].allowed(tokens[i], parents[i])
        probs = self._merge_model(model_out, model_rows, tokens, parents, ctx, k)
        for i, seq_id in enumerate(ctx.seq_ids):
            predicted = trees[i].score if use_suffix[i] else 0.0
            self._steps[seq_id] = (use_suffix[i], predicted, len(tokens[i]))
        self.num_suffix_steps += sum(use_suffix)
        self.num_model_steps += n - sum(use_suffix)
        self._drafted_at = time.perf_counter()
        return DraftProposal(
            kind=ProposalKind.TREE,
            draft_token_ids=pad_rows(tokens, k, ctx.device),  # [batch, k]
            num_draft_tokens=tuple(len(t) for t in tokens),
            draft_probs=probs,  # [batch, k, vocab] or None (one-hot drafts)
            parents=pad_rows(parents, k, ctx.device),  # [batch, k], -1 padded
        )

    def _lags(self, ctx: ProposeContext) -> list[int]:
        """Per request, the tokens the model has not run (0 for a model that keeps no state)."""
        return [self._lag(s, len(h)) for s, h in zip(ctx.seq_ids, ctx.token_ids)]

    def _lag(self, seq_id: int, num_tokens: int) -> int:
        lag = getattr(self.model, "lag", None)
        return 0 if lag is None else lag(seq_id, num_tokens)

    def _merge_model(self, out: DraftProposal | None, rows: list[int], tokens, parents, ctx, k) -> torch.Tensor | None:
        """Put the model's drafts of ``rows`` into ``tokens``/``parents`` (a chain as a
        one-path tree); its draft distributions when some unseeded sampled request reads them."""
        if out is None:
            return None
        ids = out.draft_token_ids.tolist()
        links = out.parents.tolist() if out.parents is not None else None
        for j, i in enumerate(rows):
            m = out.num_draft_tokens[j]
            tokens[i] = ids[j][:m]
            parents[i] = links[j][:m] if links is not None else list(range(-1, m - 1))
        streamed = any(not ctx.params[i].is_greedy and ctx.params[i].seed is None for i in rows)
        if out.draft_probs is None or not streamed:
            return None  # only unseeded sampled requests read them
        vocab = out.draft_probs.shape[-1]
        probs = torch.zeros(len(tokens), k, vocab, dtype=out.draft_probs.dtype, device=out.draft_probs.device)
        width = min(k, out.draft_probs.shape[1])
        index = torch.tensor(rows, dtype=torch.int64, device=probs.device)
        probs[index, :width] = out.draft_probs[:, :width]
        return probs  # [batch, k, vocab]; suffix rows all zero: judged as fixed choices


def _remaining(ctx: ProposeContext) -> list[int | None]:
    """Per request, the tokens it may still emit (``None`` where the prompt length is unknown)."""
    if not ctx.prompt_lens:
        return [None] * len(ctx.seq_ids)
    return [
        max(0, p.max_new_tokens - (len(h) - n))
        for p, h, n in zip(ctx.params, ctx.token_ids, ctx.prompt_lens)
    ]


def _select(ctx: ProposeContext, rows: list[int], k: int) -> ProposeContext:
    """``ctx`` for the requests ``rows`` only, drafting at most ``k``."""

    def pick(values):
        return tuple(values[i] for i in rows) if values else values

    return attrs.evolve(
        ctx,
        num_speculative_tokens=k,
        seq_ids=pick(ctx.seq_ids),
        token_ids=pick(ctx.token_ids),
        params=pick(ctx.params),
        generators=pick(ctx.generators),
        prompt_lens=pick(ctx.prompt_lens),
        logits_transforms=pick(ctx.logits_transforms),
        sampling=None if ctx.sampling is None or len(rows) == len(ctx.seq_ids) else ctx.sampling.select_rows(rows),
    )
