"""One engine step: schedule -> (propose) -> plan -> target pass -> (verify) -> commit/rollback.

The engine owns no math: sampling and verification are the sampler's and verifier's, attention
is the backend's, page bookkeeping the KV manager's. It wires them for a batch and keeps the
invariant that after a step the target's KV holds exactly ``request.num_computed`` slots of
every running request (pages past that are released).

Failures are contained to the requests they concern (see :meth:`Engine.step`): a step never
raises for them, and a failed request frees its pages and proposer state at once.

How many tokens each request drafts is the speculation policy's choice (:mod:`specdec.policy`),
made before every decode-only step from what the engine reports back: the seconds of each
step's target work and of each ``propose`` call, and every request's accepted drafts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import attrs
import torch

from specdec.graphs import PassGraphs
from specdec.interfaces import (
    AttentionBackend,
    ForecastsDrafts,
    KindRules,
    ProposeContext,
    Proposer,
    ReportsLag,
    Sampler,
    Scheduler,
    SharesCachedPrefix,
    SpeculationContext,
    SpeculationPolicy,
    TargetStep,
    TracksRequests,
    Verifier,
)
from specdec.kv.paged import ModelKV
from specdec.logits.batch import draft_transforms, first_dead, transform_rows
from specdec.logits.prompt_logprobs import logits_rows, record_prompt_logprobs, wants_prompt_rows
from specdec.metrics import SpecMetrics
from specdec.models.llama import LlamaModel
from specdec.policy import AdaptivePolicy
from specdec.request import FinishReason, Request, RequestError, TokenLogprob
from specdec.sampling import SamplingTensors, logprobs_of
from specdec.scheduler import ScheduledBatch
from specdec.types import (
    PAD_TOKEN_ID,
    BatchLayout,
    DraftProposal,
    ModelOutput,
    ProposalKind,
    RequestEnd,
    StepOutput,
)
from specdec.verify.kinds import default_kind_rules

__all__ = ["Engine"]


class Engine:
    """Steps a batch of requests through the target (and the proposer, when there is one)."""

    def __init__(
        self,
        *,
        target: LlamaModel,
        target_kv: ModelKV,
        backend: AttentionBackend,
        scheduler: Scheduler,
        sampler: Sampler,
        verifiers: Mapping[ProposalKind, Verifier] | None = None,
        kind_rules: Mapping[ProposalKind, KindRules] | None = None,
        proposer: Proposer | None = None,
        proposer_kv: ModelKV | None = None,
        num_speculative_tokens: int = 0,
        policy: SpeculationPolicy | None = None,
        graphs: PassGraphs | None = None,
        proposer_graphs: PassGraphs | None = None,
    ) -> None:
        self.target = target
        self.graphs = graphs  # CUDA graphs of the target's uniform passes (specdec.graphs)
        self.proposer_graphs = proposer_graphs  # the same for a draft model's own passes
        self.target_kv = target_kv
        self.backend = backend
        self.scheduler = scheduler
        self.sampler = sampler
        # The verifier of each proposal kind (chain, tree): a proposer's kind picks it.
        self.verifiers = dict(verifiers or {})
        # What each kind needs around the verify pass (rows, masks, compaction): a table too.
        self.kind_rules = dict(kind_rules or default_kind_rules())
        self.proposer = proposer
        # The proposer's optional per-request hooks, and the requests it was told started
        # (each start gets exactly one end).
        self._tracker = proposer if isinstance(proposer, TracksRequests) else None
        # A proposer with a KV pool that follows cached prefixes (the KV manager has a prefix
        # cache only when every pool can: see assembly).
        self._prefix_pool = (
            proposer if proposer_kv is not None and isinstance(proposer, SharesCachedPrefix) else None
        )
        self._started: set[int] = set()
        self.proposer_kv = proposer_kv
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.policy = None if proposer is None else (policy or AdaptivePolicy())
        self.metrics = SpecMetrics()
        # seq_id -> history length when the request last drafted: the proposer has seen that
        # much of it in propose calls (SpeculationContext.unseen is the rest).
        self._seen: dict[int, int] = {}

    # ------------------------------------------------------------------ step
    def step(self) -> StepOutput:
        """Run one step over the scheduled batch; finished requests leave the batch.

        Failures fail only the requests they concern, and ``step`` does not raise for them
        (their ids are in ``StepOutput.failed_seq_ids``, the error in ``request.error``):

        - per request: non-finite (NaN/inf) target logits in its rows, non-finite draft
          probabilities in its rows, or an exception from its stop check (a stop-string
          decode callback): that request alone fails; the rest of the batch is committed.
        - per batch: an exception from a component serving the whole batch (the proposer's
          ``propose``/``on_target_step``/``on_request_start``, a malformed proposal, the
          verifier, the sampler, the model): every request of this step's batch fails with that
          exception, because their KV and proposer state may be half-updated. Waiting requests
          are untouched. A raising ``on_request_end`` never keeps a request's state: its state
          is freed first; on preemption that request fails; on a cancel the caller gets it.

        Either way the failed requests' pages and proposer state are released at once.
        Exceptions that are not ``Exception`` (KeyboardInterrupt) propagate.
        """
        batch = self.scheduler.schedule(self.num_speculative_tokens)
        for req in batch.preempted:
            try:
                self._release_proposer(req, RequestEnd.PREEMPTED)
            except Exception as exc:  # noqa: BLE001 - a plug-in's hook: fails that request only
                self.fail(req, exc)
        if batch.empty:
            return StepOutput.empty()
        timing = _StepTiming()
        start = self._clock()
        try:
            self._start_requests(batch.admitted)
            if batch.decode_only and batch.lookahead > 0:
                out = self._speculative_step(batch, timing)
            else:
                out = self._plain_step(batch, timing)
        except Exception as exc:  # noqa: BLE001 - contained: fails this batch's requests
            out = self._fail_batch(batch.requests, exc)
            timing.rows = 0  # a failed step's time says nothing about step costs
        elapsed = self._clock() - start
        self.metrics.elapsed_s += elapsed
        for req in batch.requests:
            req.metrics.elapsed_s += elapsed
        if self.policy is not None and timing.rows:
            self.policy.observe_target(timing.rows, elapsed - timing.draft_s)
        return out

    def _clock(self) -> float:
        """Seconds, after the device has finished its queued work (CUDA runs asynchronously)."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    def fail(self, req: Request, error: BaseException) -> None:
        """End ``req`` with ``error``; its pages and proposer state are released at once."""
        req.error = error
        try:
            self._finish(req, FinishReason.ERROR)
        except Exception:  # noqa: BLE001, S110 - a tracking proposer's end hook raised (its
            pass  # state is freed regardless); the request already fails with its own error

    def cancel(self, req: Request) -> None:
        """End ``req`` (waiting or running) as cancelled; its pages are freed at once."""
        self._finish(req, FinishReason.CANCELLED)

    def _fail_batch(self, reqs: Sequence[Request], error: Exception) -> StepOutput:
        failed = [r for r in reqs if not r.finished]
        for req in failed:
            self.fail(req, error)
        return StepOutput(
            seq_ids=tuple(r.seq_id for r in reqs),
            new_token_ids=((),) * len(reqs),
            num_drafted=(0,) * len(reqs),
            num_accepted=(0,) * len(reqs),
            speculative=False,
            failed_seq_ids=tuple(r.seq_id for r in failed),
        )

    # ------------------------------------------------------------ plain step
    def _plain_step(self, batch: ScheduledBatch, timing: _StepTiming) -> StepOutput:
        """Prefill and/or one decode row per request: the target samples one token each."""
        reqs = batch.requests
        rows = [req.token_ids[req.num_computed :] for req in reqs]
        starts = [req.num_computed for req in reqs]
        layout = self.target_kv.layout(
            [r.seq_id for r in reqs], rows, starts, device=self.target.device
        )
        if any(wants_prompt_rows(r) for r in reqs):
            kept, last = logits_rows(reqs, layout.q_lens)  # every row of those that ask
            index = torch.tensor(kept, dtype=torch.int64, device=self.target.device)
            out = self._target_pass(layout, timing, logits_indices=index)
            self._record_prompt_logprobs(reqs, out.logits, last, starts, layout.q_lens)
            out = attrs.evolve(out, logits=out.logits[torch.tensor(last, device=out.logits.device)])
        else:
            out = self._target_pass(layout, timing, logits_indices=layout.last_row_indices)
        errors: dict[int, BaseException] = {}
        logits = _isolate_non_finite(reqs, out.logits, errors, "target logits")  # [batch, vocab]
        logits, dead = transform_rows(reqs, logits[:, None], [[[]] for _ in reqs], errors)
        logits = logits[:, 0]  # [batch, vocab], each request's options applied
        sampling = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        tokens = self.sampler.sample(
            logits, [r.params for r in reqs], [r.randomness() for r in reqs], sampling=sampling
        ).tolist()
        return self._commit(
            reqs,
            _Judged(
                layout=layout,
                starts=starts,
                logits=logits[:, None],  # [batch, 1, vocab]: the row each token was drawn at
                sampling=sampling,
                tokens=[[t] for t in tokens],
                paths=[[0] for _ in reqs],
                prefix_rows=[q - 1 for q in layout.q_lens],  # a prefill's prompt rows
                num_drafted=(0,) * len(reqs),
                num_accepted=(0,) * len(reqs),
                depths=[0] * len(reqs),
                hidden=out.hidden_states,
                errors=errors,
                dead=dead,
            ),
        )

    # ------------------------------------------------------ speculative step
    def _speculative_step(self, batch: ScheduledBatch, timing: _StepTiming) -> StepOutput:
        """choose (the policy's k per request) -> draft -> verify -> commit."""
        reqs = batch.requests
        ks = self._choose(reqs, batch.lookahead)
        if max(ks) == 0:
            return self._plain_step(batch, timing)
        # One set of sampling tensors for the step: the proposer's rows, the verifier, logprobs.
        sampling = SamplingTensors.from_params([r.params for r in reqs], self.target.device)
        proposal, drafts, parents = self._draft(reqs, ks, sampling, timing)
        judged = self._verify(reqs, proposal, drafts, parents, sampling, timing)
        return self._commit(reqs, judged, speculated=ks)

    def _choose(self, reqs: Sequence[Request], lookahead: int) -> tuple[int, ...]:
        """The policy's k per request, checked against what each can keep."""
        # Drafting past a request's remaining budget is wasted work: the last emitted token
        # is always the target's own, so at most remaining - 1 drafts can be kept.
        remaining = tuple(r.remaining() for r in reqs)
        caps = self._kind_rules(self.proposer.kind).caps(
            tuple(max(0, n - 1) for n in remaining), lookahead
        )
        seq_ids = tuple(r.seq_id for r in reqs)
        forecast = None
        if lookahead > 0 and isinstance(self.proposer, ForecastsDrafts):
            forecast = self.proposer.forecaster(seq_ids, tuple(r.token_ids for r in reqs), remaining)
        ctx = SpeculationContext(
            seq_ids=seq_ids,
            params=tuple(r.params for r in reqs),
            caps=caps,
            unseen=self._unseen(reqs),
            max_k=lookahead,
            kind=self.proposer.kind,
            remaining=remaining,
            forecast=forecast,
        )
        ks = _check_ks(self.policy.choose(ctx), caps, lookahead)
        for req, k in zip(reqs, ks):
            req.metrics.record_k(k)
            self.metrics.record_k(k)
        return ks

    def _unseen(self, reqs: Sequence[Request]) -> tuple[int, ...]:
        return tuple(len(r.token_ids) - self._seen.get(r.seq_id, 0) for r in reqs)

    def _lags(self, reqs: Sequence[Request], rows: Sequence[int], *, drafted: bool = False) -> list[int]:
        """How far the proposer is behind each of ``reqs[rows]``: its own count where it keeps
        one (:class:`ReportsLag`), else the engine's, for which a ``propose`` call (``drafted``)
        catches every request it drafts for up."""
        if isinstance(self.proposer, ReportsLag):
            return [self.proposer.lag(reqs[i].seq_id, len(reqs[i].token_ids)) for i in rows]
        if drafted:
            return [0] * len(rows)
        unseen = self._unseen(reqs)
        return [unseen[i] for i in rows]

    def _draft(
        self,
        reqs: Sequence[Request],
        ks: Sequence[int],
        sampling: SamplingTensors,
        timing: _StepTiming,
    ) -> tuple[DraftProposal, list[list[int]], list[list[int]] | None]:
        """Ask the proposer for the requests with ``k > 0`` (the others take a plain step inside
        the same verify pass); the proposal comes back checked, spread over the whole batch and
        capped at each request's own k, with host copies of its drafts and (trees) parents,
        read in one device-to-host copy."""
        lookahead = max(ks)
        drafting = [i for i, k in enumerate(ks) if k > 0]
        lag_before = self._lags(reqs, drafting)
        start = self._clock()
        proposal = self.proposer.propose(
            ProposeContext(
                seq_ids=tuple(reqs[i].seq_id for i in drafting),
                token_ids=tuple(reqs[i].token_ids for i in drafting),
                prompt_lens=tuple(len(reqs[i].prompt_ids) for i in drafting),
                params=tuple(reqs[i].params for i in drafting),
                generators=tuple(reqs[i].randomness() for i in drafting),
                num_speculative_tokens=lookahead,
                kv=self.proposer_kv,
                backend=self.backend,
                device=self.target.device,
                sampling=sampling if len(drafting) == len(reqs) else sampling.select_rows(drafting),
                graphs=self.proposer_graphs,
                logits_transforms=draft_transforms([reqs[i] for i in drafting]),
            )
        )
        _check_proposal_shapes(proposal, len(drafting), lookahead, self.proposer.kind)
        rules = self._kind_rules(proposal.kind)
        drafted, tree = rules.read_drafts(proposal)  # the step's one read of the drafts
        timing.draft_s = self._clock() - start
        steps = rules.propose_steps(proposal, lookahead)
        lag_after = self._lags(reqs, drafting, drafted=True)
        self.policy.observe_propose(
            len(drafting), steps, timing.draft_s, sum(b - a for b, a in zip(lag_before, lag_after))
        )
        proposal = _spread(proposal, drafting, len(reqs))
        drafts = [[PAD_TOKEN_ID] * proposal.width for _ in reqs]
        parents = None if tree is None else [[-1] * proposal.width for _ in reqs]
        for j, i in enumerate(drafting):
            drafts[i] = drafted[j]
            if parents is not None:
                parents[i] = tree[j]
        # Each request keeps at most its own k, and a draft ends at a PAD_TOKEN_ID (a sampler
        # finds no distribution to draw from: the draft probabilities are checked below). A
        # tree keeps its first k nodes: parents come first, so they form a tree again.
        capped = tuple(
            min(n, k, _pad_at(row, n)) for n, k, row in zip(proposal.num_draft_tokens, ks, drafts)
        )
        if capped != tuple(proposal.num_draft_tokens):
            proposal = attrs.evolve(proposal, num_draft_tokens=capped)
        _check_draft_ids(drafts, capped, self.target.config.vocab_size)
        return proposal, drafts, parents

    def _verify(
        self,
        reqs: Sequence[Request],
        proposal: DraftProposal,
        drafts: list[list[int]],  # host copy of proposal.draft_token_ids
        parents: list[list[int]] | None,  # host copy of proposal.parents (trees)
        sampling: SamplingTensors,
        timing: _StepTiming,
    ) -> _Judged:
        """One target pass over every request's last token and drafts; the verifier for the
        proposal's kind decides what each request keeps; a tree's kept path is compacted."""
        verifier = self.verifiers.get(proposal.kind)
        if verifier is None:
            raise ValueError(f"no verifier for {proposal.kind} proposals; have {sorted(k.value for k in self.verifiers)}")
        rules = self._kind_rules(proposal.kind)
        num_draft = proposal.num_draft_tokens
        starts = [len(r.token_ids) - 1 for r in reqs]
        rows = [[r.token_ids[-1], *d[:n]] for r, d, n in zip(reqs, drafts, num_draft)]
        if self._graphs_take_padded(rules, len(reqs), proposal):
            # Every sequence gets the step's full width of rows (token 0 past its drafts, in
            # slots the step reserved anyway and nothing reads as committed), so the pass is
            # uniform and replays a captured graph; the extra rows' logits are never judged.
            rows = [row + [0] * (proposal.width + 1 - len(row)) for row in rows]
        placed = rules.verify_rows(parents, num_draft, starts)
        layout = self.target_kv.layout(
            [r.seq_id for r in reqs],
            rows,
            starts,
            positions=placed.positions,
            tree_masks=placed.tree_masks,
            device=self.target.device,
        )
        out = self._target_pass(layout, timing)
        row_index = _padded_row_index(layout.q_lens, proposal.width + 1).to(out.logits.device)
        target_logits = out.logits[row_index]  # [batch, width + 1, vocab]
        errors: dict[int, BaseException] = {}
        target_logits = _isolate_non_finite(reqs, target_logits, errors, "target logits")
        if proposal.draft_probs is not None:
            draft_probs = _isolate_non_finite(reqs, proposal.draft_probs, errors, "draft probabilities")
            if draft_probs is not proposal.draft_probs:
                proposal = attrs.evolve(proposal, draft_probs=draft_probs)
        histories = [  # built only for requests with options (transform_rows skips the rest)
            rules.row_histories(d, None if parents is None else parents[i], n) if r.transform else []
            for i, (r, d, n) in enumerate(zip(reqs, drafts, num_draft))
        ]
        # Each row's distribution under the request's options, with that row's own history.
        target_logits, dead = transform_rows(reqs, target_logits, histories, errors)
        params = [r.params for r in reqs]
        result = verifier.verify(
            target_logits, proposal, params, [r.randomness() for r in reqs], sampling=sampling
        )
        width_1 = result.emitted_token_ids.shape[1]
        both = torch.cat([result.emitted_token_ids, result.accepted_rows.to(torch.int64)], dim=1)
        both = both.tolist()  # one device-to-host copy for tokens and rows
        emitted = [row[:width_1] for row in both]
        paths = [row[width_1:][:n] for row, n in zip(both, result.num_emitted)]
        input_ids, hidden = rules.commit(
            self.target_kv.manager, layout, starts, paths, out.hidden_states
        )  # a tree's kept path is compacted and put first
        return _Judged(
            layout=attrs.evolve(layout, token_ids=input_ids),
            starts=starts,
            logits=target_logits,
            sampling=sampling,
            tokens=[e[:n] for e, n in zip(emitted, result.num_emitted)],
            paths=paths,
            prefix_rows=[0] * len(reqs),
            num_drafted=num_draft,
            depths=placed.depths,
            num_accepted=result.num_accepted,
            hidden=hidden,
            errors=errors,
            dead=dead,
        )

    def _kind_rules(self, kind: ProposalKind) -> KindRules:
        rules = self.kind_rules.get(kind)
        if rules is None:
            raise ValueError(f"no rules for {kind} proposals; have {sorted(k.value for k in self.kind_rules)}")
        return rules

    def _graphs_take_padded(self, rules: KindRules, batch: int, proposal: DraftProposal) -> bool:
        """Whether this verify pass, padded to the step's width, replays a graph."""
        return (
            self.graphs is not None
            and rules.pads_to_width
            and not self.proposer.needs_target_hidden
            and self.graphs.takes(batch, proposal.width + 1)
        )

    def _target_pass(self, layout: BatchLayout, timing: _StepTiming, **kwargs) -> ModelOutput:
        """The target's forward over ``layout``, with hidden states when the proposer wants them."""
        timing.rows = layout.num_tokens
        wants_hidden = self.proposer is not None and self.proposer.needs_target_hidden
        every_row = "logits_indices" not in kwargs or set(layout.q_lens) == {1}
        if not wants_hidden and every_row and self.graphs is not None and self.graphs.applies(layout):
            # A decode pass (its last rows are all its rows) or a padded chain verify pass, which
            # wants every row's logits: by replay. Prefill (last rows only) stays eager.
            return ModelOutput(logits=self.graphs.run(layout))
        plan = self.backend.plan(layout, self.target.attention_spec)
        if wants_hidden:
            # The inputs of the target layers the proposer names (EAGLE-3: three), else the
            # last layer's output.
            layers = getattr(self.proposer, "target_hidden_layers", None)
            kwargs["hidden_layers"] = tuple(layers) if layers else (self.target.config.num_layers,)
        return self.target(layout, self.target_kv, self.backend, plan, **kwargs)

    # ---------------------------------------------------------------- commit
    def _commit(
        self, reqs: Sequence[Request], judged: _Judged, *, speculated: Sequence[int] | None = None
    ) -> StepOutput:
        """Append each request's tokens, keep exactly its committed KV, tell the proposer.

        Shared by plain and speculative steps: a plain step is one whose only judged row is
        each request's last input row, with nothing drafted. ``speculated`` holds the policy's
        k per request on speculative steps (``None`` on plain steps).
        """
        errors = judged.errors
        # A row the request's options left no token at ends it before that row's token.
        cuts = [first_dead(paths, dead) for paths, dead in zip(judged.paths, judged.dead)]
        for i, cut in enumerate(cuts):
            if cut is not None:
                judged.tokens[i] = judged.tokens[i][:cut]
        _isolate_no_distribution(reqs, judged.tokens, errors)
        self._record_logprobs(reqs, judged, errors)
        manager = self.target_kv.manager
        new_tokens, kept_rows = [], []
        for i, req in enumerate(reqs):
            if i in errors:
                new_tokens.append(())
                kept_rows.append(0)
                continue
            kept = _append(req, judged.tokens[i], i, errors)
            if cuts[i] is not None and req.finish_reason is None and i not in errors:
                req.finish_reason = FinishReason.NO_ALLOWED_TOKEN  # plain decoding ends here too
            if req.params.logprobs is not None:
                del req.logprobs[req.num_output :]  # tokens past a stop were judged, not kept
            # Committed KV: the input rows before the judged ones (a prefill's prompt) and the
            # judged rows whose tokens were kept (the last emitted token has no KV yet).
            rows = judged.prefix_rows[i] + min(kept, len(judged.paths[i]))
            kept_rows.append(rows)
            req.num_computed = judged.starts[i] + rows
            accepted = min(judged.num_accepted[i], kept)
            req.metrics.num_target_forwards += 1
            req.metrics.num_generated_tokens += kept
            self.metrics.num_generated_tokens += kept
            if speculated is not None:
                counts = (judged.num_drafted[i], accepted, kept, judged.depths[i])
                req.metrics.record_verify(*counts)
                self.metrics.record_verify(*counts)
                self.policy.observe_verify(req.seq_id, judged.num_drafted[i], judged.num_accepted[i])
                if speculated[i] > 0:
                    self._seen[req.seq_id] = len(req.token_ids)
            new_tokens.append(tuple(judged.tokens[i][:kept]) if i not in errors else ())
            # Release pages that only held rejected drafts (the next step re-reserves).
            manager.truncate(req.seq_id, min(len(req.token_ids), manager.capacity(req.seq_id)))
        self.metrics.num_target_forwards += 1
        self._tell_proposer(reqs, judged, kept_rows, skip=errors)
        self._cache_prefixes(reqs, errors)
        self._finish_step(reqs, errors)
        return StepOutput(
            seq_ids=tuple(r.seq_id for r in reqs),
            new_token_ids=tuple(new_tokens),
            num_drafted=tuple(judged.num_drafted),
            num_accepted=tuple(judged.num_accepted),
            speculative=speculated is not None,
            failed_seq_ids=tuple(reqs[i].seq_id for i in sorted(errors)),
        )

    # --------------------------------------------------------------- helpers
    def _tell_proposer(self, reqs, judged: _Judged, kept_rows, skip=()) -> None:
        """Send the committed step to the proposer, leaving out the requests in ``skip``
        (they fail this step: the proposer releases them instead)."""
        if self.proposer is None:
            return
        q_lens, starts = judged.layout.q_lens, judged.starts
        input_ids, hidden = judged.layout.token_ids, judged.hidden
        num_accepted = list(judged.num_accepted)
        indptr = [0]
        for q in q_lens:
            indptr.append(indptr[-1] + q)
        keep = [i for i in range(len(reqs)) if i not in skip]
        if not keep:
            return
        if len(keep) < len(reqs):
            rows = torch.tensor(
                [r for i in keep for r in range(indptr[i], indptr[i + 1])], dtype=torch.int64
            )  # [kept input rows]
            input_ids = input_ids[rows.to(input_ids.device)]
            hidden = None if hidden is None else hidden[rows.to(hidden.device)]
            reqs, q_lens, starts, kept_rows, num_accepted = (
                [xs[i] for i in keep] for xs in (reqs, q_lens, starts, kept_rows, num_accepted)
            )
            indptr = [0]
            for q in q_lens:
                indptr.append(indptr[-1] + q)
        self.proposer.on_target_step(
            TargetStep(
                seq_ids=tuple(r.seq_id for r in reqs),
                token_ids=tuple(r.token_ids for r in reqs),
                input_token_ids=input_ids,
                qo_indptr=tuple(indptr),
                start_slots=tuple(starts),
                kept_rows=tuple(kept_rows),
                num_accepted=tuple(num_accepted),
                hidden_states=hidden,
                kv=self.proposer_kv,
                backend=self.backend,
            )
        )

    @staticmethod
    def _record_prompt_logprobs(reqs, logits: torch.Tensor, last, starts, q_lens) -> None:
        """Prompt logprobs of the requests that asked, from their rows of ``logits``."""
        for i, req in enumerate(reqs):
            if wants_prompt_rows(req):
                end = last[i] + 1
                record_prompt_logprobs(req, logits[end - q_lens[i] : end], starts[i])

    def _record_logprobs(self, reqs: Sequence[Request], judged: _Judged, errors) -> None:
        """Logprobs of each kept token at the row it was judged at, for requests that ask."""
        for i, req in enumerate(reqs):
            if req.params.logprobs is None or i in errors:
                continue
            tokens = judged.tokens[i]
            rows = torch.tensor(judged.paths[i][: len(tokens)], device=judged.logits.device)
            sampling = judged.sampling.select_rows([i] * len(tokens))
            self._append_logprobs(req, judged.logits[i, rows], tokens, sampling)

    @staticmethod
    def _append_logprobs(
        req: Request, logits: torch.Tensor, tokens: Sequence[int], st: SamplingTensors
    ) -> None:
        """Logprobs of ``tokens`` under the request's processed target distribution."""
        n = len(tokens)
        ids = torch.tensor(list(tokens), device=logits.device)
        lp, top_ids, top_lp = logprobs_of(logits[:n], st, ids, req.params.logprobs)
        for j in range(n):
            top = tuple(zip(top_ids[j].tolist(), top_lp[j].tolist()))
            req.logprobs.append(TokenLogprob(token_id=int(tokens[j]), logprob=float(lp[j]), top=top))

    def _finish_step(self, reqs: Sequence[Request], errors: dict[int, BaseException]) -> None:
        """Fail the requests in ``errors``; finish those that stopped this step."""
        for i, req in enumerate(reqs):
            if i in errors:
                self.fail(req, errors[i])
            elif req.finish_reason is not None:
                self._finish(req, req.finish_reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if reason is not FinishReason.ERROR:
            self._cache_target_prefix(req)
        self.scheduler.finish(req, reason)
        self._release_proposer(req, reason.request_end)

    def _cache_prefixes(self, reqs: Sequence[Request], skip) -> None:
        """Key every page whose KV became final in every pool this step (prefix caching)."""
        manager = self.target_kv.manager
        if manager.prefix_cache is None:
            return
        for i, req in enumerate(reqs):
            if i in skip:
                continue
            valid = req.num_computed
            if self._prefix_pool is not None:
                valid = min(valid, self._prefix_pool.kv_valid_slots(req.seq_id, valid))
            manager.cache_prefix(req.seq_id, req.token_ids, valid, req.params.cache_salt)

    def _cache_target_prefix(self, req: Request) -> None:
        """A request that ends keys its pages whose KV is final in the target's pool but not in
        the proposer's, where the cache reuses such pages (a proposer that catches up from
        tokens: a draft model, which a suffix tree may have left far behind): a retried
        request or the next turn of a chat then skips the target's prefill over them."""
        manager = self.target_kv.manager
        cache = manager.prefix_cache
        if cache is None or not cache.partial or self._prefix_pool is None:
            return
        if req.num_computed <= 0 or not manager.has_sequence(req.seq_id):
            return
        valid = self._prefix_pool.kv_valid_slots(req.seq_id, req.num_computed)
        manager.cache_prefix(req.seq_id, req.token_ids, valid, req.params.cache_salt, req.num_computed)

    def _start_requests(self, reqs: Sequence[Request]) -> None:
        """Tell the proposer about the requests admitted this step: where a cached prefix
        starts them, and (a proposer that tracks requests) that they started."""
        if self._prefix_pool is not None:
            for req in reqs:
                if req.num_computed > 0:
                    self._prefix_pool.adopt_prefix(req.seq_id, req.num_cached_for_proposer)
        if self._tracker is None:
            return
        for req in reqs:
            self._tracker.on_request_start(req.seq_id, tuple(req.prompt_ids))
            self._started.add(req.seq_id)

    def _release_proposer(self, req: Request, end: RequestEnd) -> None:
        """Free the request's proposer and policy state; a tracking proposer hears ``end``
        first (once per start)."""
        if self.proposer is None:
            return
        try:
            if req.seq_id in self._started:
                self._started.discard(req.seq_id)
                self._tracker.on_request_end(req.seq_id, end)
        finally:  # a plug-in's failing hook must not keep the request's state alive
            self.proposer.release(req.seq_id)
            self.policy.release(req.seq_id)
            self._seen.pop(req.seq_id, None)


@attrs.define
class _StepTiming:
    """What one step reports to the policy: the target pass's rows, the seconds drafting took."""

    rows: int = 0
    draft_s: float = 0.0


@attrs.frozen(eq=False)
class _Judged:
    """A target pass judged: per request, the tokens it emits and the rows behind them,
    before anything is committed (the commit path is the same for plain and speculative)."""

    layout: BatchLayout  # the pass's rows (a tree's: kept path first, see kept_first_order)
    starts: list[int]  # per request: slot of its first input row
    logits: torch.Tensor  # [batch, judged rows, vocab] the rows tokens were chosen at
    sampling: SamplingTensors  # one row per request
    tokens: list[list[int]]  # per request: accepted drafts + the target's own token
    paths: list[list[int]]  # per request: judged row of each token (row 0 first)
    prefix_rows: list[int]  # per request: input rows before the judged ones (all committed)
    num_drafted: tuple[int, ...]
    num_accepted: tuple[int, ...]
    depths: list[int]  # per request: its deepest draft (a chain's: its length)
    hidden: torch.Tensor | None  # [num rows, hidden] in ``layout``'s row order
    errors: dict[int, BaseException]
    dead: list[frozenset[int]]  # per request: judged rows its options left no token at


def _check_ks(ks: object, caps: Sequence[int], max_k: int) -> tuple[int, ...]:
    """A policy's choice must fit the step; a misbehaving plug-in fails the batch here."""
    try:
        ks = tuple(ks)
    except TypeError:
        raise TypeError(
            f"policy.choose must return a sequence of ints, got {type(ks).__name__}"
        ) from None
    if len(ks) != len(caps) or any(
        isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= min(c, max_k)
        for k, c in zip(ks, caps)
    ):
        raise ValueError(
            f"policy chose k = {ks}; allowed one int per request in 0..min(cap, {max_k}), "
            f"caps {tuple(caps)}"
        )
    return ks


def _spread(proposal: DraftProposal, rows: Sequence[int], batch: int) -> DraftProposal:
    """The proposal of a sub-batch as one of the whole batch: sub-batch row ``j`` becomes row
    ``rows[j]``; the other rows draft nothing."""
    if len(rows) == batch:
        return proposal
    index = torch.tensor(list(rows), dtype=torch.int64, device=proposal.draft_token_ids.device)

    def spread(values: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.full((batch, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
        out[index.to(values.device)] = values
        return out

    counts = [0] * batch
    for j, i in enumerate(rows):
        counts[i] = proposal.num_draft_tokens[j]
    return attrs.evolve(
        proposal,
        draft_token_ids=spread(proposal.draft_token_ids, PAD_TOKEN_ID),  # [batch, width] int64
        num_draft_tokens=tuple(counts),
        draft_probs=spread(proposal.draft_probs, 0.0),  # [batch, width, vocab]
        parents=spread(proposal.parents, -1),  # [batch, width] int64
    )


def _isolate_non_finite(
    reqs: Sequence[Request],
    values: torch.Tensor,  # [batch, ...] float, one leading row per request
    errors: dict[int, BaseException],
    what: str,
) -> torch.Tensor:
    """Record a RequestError for each request whose rows hold NaN/inf; zero those rows.

    Zeroed rows keep the batch's sampling and verification well defined for the others
    (the failed requests' results are discarded). Returns ``values`` itself when all are
    finite. One host sync per call.
    """
    # A finite sum means no NaN or inf (either would make the sum NaN or inf): one pass of
    # reduction instead of a [batch, ..., vocab] bool tensor on every step.
    if bool(torch.isfinite(values.flatten(1).sum(dim=1)).all()):  # overflow: the exact check
        return values
    finite = torch.isfinite(values).flatten(1).all(dim=1).tolist()  # [batch] bool
    if all(finite):
        return values
    for i, ok in enumerate(finite):
        if not ok and i not in errors:
            errors[i] = RequestError(
                f"request {reqs[i].seq_id}: {what} are not finite (NaN or inf); "
                "the model or proposer produced invalid numbers for this request"
            )
    mask = torch.tensor(finite, device=values.device).view(-1, *[1] * (values.dim() - 1))
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _isolate_no_distribution(
    reqs: Sequence[Request], tokens: Sequence[Sequence[int]], errors: dict[int, BaseException]
) -> None:
    """Record a RequestError for each request that drew a negative token id: its processed
    distribution was not finite (the sampler and verifiers never invent a token for it)."""
    for i, row in enumerate(tokens):
        if i not in errors and any(t < 0 for t in row):
            errors[i] = RequestError(
                f"request {reqs[i].seq_id}: its sampling probabilities are not finite "
                f"(temperature {reqs[i].params.temperature}); nothing was sampled"
            )


def _append(req: Request, tokens: Sequence[int], index: int, errors: dict[int, BaseException]) -> int:
    """``req.append(tokens)``; an exception from its stop check goes to ``errors[index]``."""
    try:
        return req.append(tokens)
    except Exception as exc:  # noqa: BLE001 - a user callback: fails this request only
        errors[index] = exc
        return 0


def _check_proposal_shapes(
    proposal: DraftProposal, batch_size: int, lookahead: int, kind: ProposalKind
) -> None:
    """A proposer's output must fit the step; a misbehaving plug-in fails loudly here."""
    if proposal.kind is not kind:
        raise ValueError(
            f"proposer declares kind {kind.value} but returned a {proposal.kind.value} proposal"
        )
    if proposal.batch_size != batch_size:
        raise ValueError(f"proposer returned {proposal.batch_size} rows for a batch of {batch_size}")
    if len(proposal.num_draft_tokens) != batch_size:
        raise ValueError("proposer's num_draft_tokens must have one entry per sequence")
    if any(n < 0 or n > min(proposal.width, lookahead) for n in proposal.num_draft_tokens):
        raise ValueError(
            f"proposer drafted {proposal.num_draft_tokens} tokens; allowed 0..{lookahead} per sequence"
        )


def _pad_at(row: Sequence[int], n: int) -> int:
    """Index of the first ``PAD_TOKEN_ID`` among the first ``n`` drafts, else ``n``."""
    return next((j for j, t in enumerate(row[:n]) if t == PAD_TOKEN_ID), n)


def _check_draft_ids(drafts: list[list[int]], num_draft: Sequence[int], vocab: int) -> None:
    """Out-of-vocabulary drafts would index past the embedding (a device assert on CUDA)."""
    for row, n in zip(drafts, num_draft):
        if any(t < 0 or t >= vocab for t in row[:n]):
            raise ValueError(f"proposer drafted token ids outside [0, {vocab}): {row[:n]}")


def _padded_row_index(q_lens: Sequence[int], width: int) -> torch.Tensor:
    """[batch, width] flat row of each sequence's verify row j (clamped to its last row)."""
    index, offset = [], 0
    for q in q_lens:
        index.append([offset + min(j, q - 1) for j in range(width)])
        offset += q
    return torch.tensor(index, dtype=torch.int64)
