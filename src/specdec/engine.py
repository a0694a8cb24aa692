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
from collections.abc import Sequence

import attrs
import torch

from specdec.interfaces import (
    AttentionBackend,
    ProposeContext,
    Proposer,
    Sampler,
    SpeculationContext,
    SpeculationPolicy,
    TargetStep,
    Verifier,
)
from specdec.kv.paged import ModelKV
from specdec.metrics import SpecMetrics
from specdec.models.llama import LlamaModel
from specdec.policy import AdaptivePolicy
from specdec.request import FinishReason, Request, RequestError, TokenLogprob
from specdec.sampling import SamplingTensors, logprobs_of
from specdec.scheduler import BatchScheduler, ScheduledBatch
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind, StepOutput

__all__ = ["Engine"]


class Engine:
    """Steps a batch of requests through the target (and the proposer, when there is one)."""

    def __init__(
        self,
        *,
        target: LlamaModel,
        target_kv: ModelKV,
        backend: AttentionBackend,
        scheduler: BatchScheduler,
        sampler: Sampler,
        verifier: Verifier | None = None,
        proposer: Proposer | None = None,
        proposer_kv: ModelKV | None = None,
        num_speculative_tokens: int = 0,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        self.target = target
        self.target_kv = target_kv
        self.backend = backend
        self.scheduler = scheduler
        self.sampler = sampler
        self.verifier = verifier
        self.proposer = proposer
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
          ``propose``/``on_target_step``, a malformed proposal, the verifier, the sampler, the
          model): every request of this step's batch fails with that exception, because their
          KV and proposer state may be half-updated. Waiting requests are untouched.

        Either way the failed requests' pages and proposer state are released at once.
        Exceptions that are not ``Exception`` (KeyboardInterrupt) propagate.
        """
        batch = self.scheduler.schedule(self.num_speculative_tokens)
        for req in batch.preempted:
            self._release_proposer(req)
        if batch.empty:
            return StepOutput.empty()
        timing = _StepTiming()
        start = self._clock()
        try:
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
        self._finish(req, FinishReason.ERROR)

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
        reqs = batch.requests
        rows = [req.token_ids[req.num_computed :] for req in reqs]
        starts = [req.num_computed for req in reqs]
        want_hidden = self.proposer is not None and self.proposer.needs_target_hidden
        layout = self.target_kv.layout(
            [r.seq_id for r in reqs], rows, starts, device=self.target.device
        )
        timing.rows = layout.num_tokens
        plan = self.backend.plan(layout, self.target.config.attention_spec)
        out = self.target(
            layout,
            self.target_kv,
            self.backend,
            plan,
            logits_indices=layout.last_row_indices,
            return_hidden=want_hidden,
        )
        params = [r.params for r in reqs]
        errors: dict[int, BaseException] = {}
        logits = _isolate_non_finite(reqs, out.logits, errors, "target logits")
        tokens = self.sampler.sample(logits, params, [r.randomness() for r in reqs]).tolist()
        _isolate_no_distribution(reqs, [[t] for t in tokens], errors)
        self._record_logprobs(reqs, logits, [[t] for t in tokens], errors)

        new_tokens = []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if i in errors:
                new_tokens.append(())
                continue
            req.num_computed = len(req.token_ids)
            _append(req, [tok], i, errors)
            req.metrics.num_target_forwards += 1
            req.metrics.num_generated_tokens += 1
            self.metrics.num_generated_tokens += 1
            new_tokens.append(() if i in errors else (tok,))
        self.metrics.num_target_forwards += 1
        self._tell_proposer(reqs, layout.token_ids, layout.q_lens, starts, layout.q_lens, [0] * len(reqs), out.hidden_states, skip=errors)
        self._finish_step(reqs, errors)
        return StepOutput(
            seq_ids=tuple(r.seq_id for r in reqs),
            new_token_ids=tuple(new_tokens),
            num_drafted=(0,) * len(reqs),
            num_accepted=(0,) * len(reqs),
            speculative=False,
            failed_seq_ids=tuple(reqs[i].seq_id for i in sorted(errors)),
        )

    # ------------------------------------------------------ speculative step
    def _speculative_step(self, batch: ScheduledBatch, timing: _StepTiming) -> StepOutput:
        reqs = batch.requests
        # Drafting past a request's remaining budget is wasted work: the last emitted token
        # is always the target's own, so at most remaining - 1 drafts can be kept.
        caps = tuple(max(0, r.remaining() - 1) for r in reqs)
        unseen = tuple(len(r.token_ids) - self._seen.get(r.seq_id, 0) for r in reqs)
        ctx = SpeculationContext(
            seq_ids=tuple(r.seq_id for r in reqs),
            params=tuple(r.params for r in reqs),
            caps=caps,
            unseen=unseen,
            max_k=batch.lookahead,
        )
        ks = _check_ks(self.policy.choose(ctx), caps, batch.lookahead)
        for req, k in zip(reqs, ks):
            req.metrics.record_k(k)
            self.metrics.record_k(k)
        lookahead = max(ks)
        if lookahead == 0:
            return self._plain_step(batch, timing)
        # Only the requests that draft go to the proposer; the others take a plain step inside
        # the same verify pass (zero drafts).
        drafting = [i for i, k in enumerate(ks) if k > 0]
        start = self._clock()
        proposal = self.proposer.propose(
            ProposeContext(
                seq_ids=tuple(reqs[i].seq_id for i in drafting),
                token_ids=tuple(reqs[i].token_ids for i in drafting),
                params=tuple(reqs[i].params for i in drafting),
                generators=tuple(reqs[i].randomness() for i in drafting),
                num_speculative_tokens=lookahead,
                kv=self.proposer_kv,
                backend=self.backend,
                device=self.target.device,
            )
        )
        _check_proposal(proposal, len(drafting), lookahead)
        drafted = proposal.draft_token_ids.tolist()  # host sync: the drafting is done
        timing.draft_s = self._clock() - start
        self.policy.observe_propose(
            len(drafting), lookahead, timing.draft_s, sum(unseen[i] for i in drafting)
        )
        proposal = _spread(proposal, drafting, len(reqs))
        drafts = [[PAD_TOKEN_ID] * proposal.width for _ in reqs]
        for row, i in zip(drafted, drafting):
            drafts[i] = row
        # Each request keeps at most its own k, and a draft ends at a PAD_TOKEN_ID (a sampler
        # finds no distribution to draw from: the draft probabilities are checked below).
        capped = tuple(
            min(n, k, _pad_at(row, n)) for n, k, row in zip(proposal.num_draft_tokens, ks, drafts)
        )
        if capped != tuple(proposal.num_draft_tokens):
            proposal = attrs.evolve(proposal, num_draft_tokens=capped)
        num_draft = proposal.num_draft_tokens
        _check_draft_ids(drafts, num_draft, self.target.config.vocab_size)
        starts = [len(r.token_ids) - 1 for r in reqs]
        rows = [[r.token_ids[-1], *d[:n]] for r, d, n in zip(reqs, drafts, num_draft)]
        positions, tree_masks = None, None
        if proposal.kind is ProposalKind.TREE:
            positions, tree_masks = _tree_rows(proposal, starts)
        want_hidden = self.proposer.needs_target_hidden
        layout = self.target_kv.layout(
            [r.seq_id for r in reqs],
            rows,
            starts,
            positions=positions,
            tree_masks=tree_masks,
            device=self.target.device,
        )
        timing.rows = layout.num_tokens
        plan = self.backend.plan(layout, self.target.config.attention_spec)
        out = self.target(layout, self.target_kv, self.backend, plan, return_hidden=want_hidden)
        width = proposal.width
        row_index = _padded_row_index(layout.q_lens, width + 1).to(out.logits.device)
        target_logits = out.logits[row_index]  # [batch, width + 1, vocab]
        params = [r.params for r in reqs]
        errors: dict[int, BaseException] = {}
        target_logits = _isolate_non_finite(reqs, target_logits, errors, "target logits")
        if proposal.draft_probs is not None:
            draft_probs = _isolate_non_finite(reqs, proposal.draft_probs, errors, "draft probabilities")
            if draft_probs is not proposal.draft_probs:
                proposal = attrs.evolve(proposal, draft_probs=draft_probs)
        result = self.verifier.verify(
            target_logits, proposal, params, [r.randomness() for r in reqs]
        )

        emitted = result.emitted_token_ids.tolist()
        accepted_rows = result.accepted_rows.tolist()
        hidden = out.hidden_states
        if proposal.kind is ProposalKind.TREE:
            hidden = self._compact_tree(reqs, starts, accepted_rows, result.num_emitted, layout.q_lens, hidden)
        kept_tokens = [e[:n] for e, n in zip(emitted, result.num_emitted)]
        _isolate_no_distribution(reqs, kept_tokens, errors)
        self._record_logprobs_verify(reqs, target_logits, kept_tokens, accepted_rows, errors)

        new_tokens = []
        for i, req in enumerate(reqs):
            if i in errors:
                new_tokens.append(())
                continue
            kept = _append(req, kept_tokens[i], i, errors)
            req.num_computed = len(req.token_ids) - 1
            req.metrics.record_verify(num_draft[i], min(result.num_accepted[i], kept), kept)
            self.policy.observe_verify(req.seq_id, num_draft[i], result.num_accepted[i])
            if ks[i] > 0:
                self._seen[req.seq_id] = len(req.token_ids)
            req.metrics.num_target_forwards += 1
            req.metrics.num_generated_tokens += kept
            self.metrics.record_verify(num_draft[i], min(result.num_accepted[i], kept), kept)
            self.metrics.num_generated_tokens += kept
            new_tokens.append(tuple(kept_tokens[i][:kept]))
            # Release pages that only held rejected drafts (the next step re-reserves).
            manager = self.target_kv.manager
            manager.truncate(req.seq_id, min(len(req.token_ids), manager.capacity(req.seq_id)))
        self.metrics.num_target_forwards += 1
        kept_rows = [min(a + 1, len(t)) for a, t in zip(result.num_accepted, new_tokens)]
        self._tell_proposer(reqs, layout.token_ids, layout.q_lens, starts, kept_rows, list(result.num_accepted), hidden, skip=errors)
        self._finish_step(reqs, errors)
        return StepOutput(
            seq_ids=tuple(r.seq_id for r in reqs),
            new_token_ids=tuple(new_tokens),
            num_drafted=tuple(num_draft),
            num_accepted=tuple(result.num_accepted),
            speculative=True,
            failed_seq_ids=tuple(reqs[i].seq_id for i in sorted(errors)),
        )

    def _compact_tree(self, reqs, starts, accepted_rows, num_emitted, q_lens, hidden):
        """Move the accepted path's KV (and hidden rows) to contiguous slots after the prefix."""
        offsets = [0]
        for q in q_lens:
            offsets.append(offsets[-1] + q)
        order = []
        for i, req in enumerate(reqs):
            path = accepted_rows[i][: num_emitted[i]]
            self.target_kv.manager.compact(req.seq_id, [starts[i] + r for r in path], starts[i])
            kept = set(path)
            rest = [r for r in range(q_lens[i]) if r not in kept]
            order.extend(offsets[i] + r for r in [*path, *rest])
        if hidden is None:
            return None
        return hidden[torch.tensor(order, device=hidden.device)]

    # --------------------------------------------------------------- helpers
    def _tell_proposer(self, reqs, input_ids, q_lens, starts, kept_rows, num_accepted, hidden, skip=()) -> None:
        """Send the committed step to the proposer, leaving out the requests in ``skip``
        (they fail this step: the proposer releases them instead)."""
        if self.proposer is None:
            return
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

    def _record_logprobs(self, reqs: Sequence[Request], logits: torch.Tensor, tokens, errors) -> None:
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None and i not in errors]
        if not want:
            return
        for i in want:
            self._append_logprobs(reqs[i], logits[i : i + 1], tokens[i][:1])

    def _record_logprobs_verify(self, reqs, target_logits, kept_tokens, accepted_rows, errors) -> None:
        for i, req in enumerate(reqs):
            if req.params.logprobs is None or i in errors:
                continue
            n = len(kept_tokens[i])
            rows = torch.tensor(accepted_rows[i][:n], device=target_logits.device)
            self._append_logprobs(req, target_logits[i, rows], kept_tokens[i])

    @staticmethod
    def _append_logprobs(req: Request, logits: torch.Tensor, tokens: Sequence[int]) -> None:
        """Logprobs of ``tokens`` under the request's processed target distribution."""
        n = len(tokens)
        st = SamplingTensors.from_params([req.params] * n, logits.device)
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
        self.scheduler.finish(req, reason)
        self._release_proposer(req)

    def _release_proposer(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(req.seq_id)
            self.policy.release(req.seq_id)
            self._seen.pop(req.seq_id, None)


@attrs.define
class _StepTiming:
    """What one step reports to the policy: the target pass's rows, the seconds drafting took."""

    rows: int = 0
    draft_s: float = 0.0


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


def _check_proposal(proposal: DraftProposal, batch_size: int, lookahead: int) -> None:
    """A proposer's output must fit the step; a misbehaving plug-in fails loudly here."""
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


def _tree_rows(proposal: DraftProposal, starts: Sequence[int]):
    """RoPE positions and ``[q, q]`` ancestor masks for tree rows (row 0 is the root)."""
    parents = proposal.parents.tolist()
    positions, masks = [], []
    for i, start in enumerate(starts):
        n = proposal.num_draft_tokens[i]
        q = n + 1
        mask = torch.zeros(q, q, dtype=torch.bool)
        depth = [0] * q
        mask[0, 0] = True
        for j in range(n):
            parent = parents[i][j] + 1  # -1 (the root) -> row 0
            depth[j + 1] = depth[parent] + 1
            mask[j + 1] = mask[parent]
            mask[j + 1, j + 1] = True
        positions.append([start + d for d in depth])
        masks.append(mask)
    return positions, masks
