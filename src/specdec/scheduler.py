"""Request queue and continuous batching under a KV page budget.

Each step the scheduler keeps every running request in the batch, admits waiting requests
(FIFO) while pages and the batch size allow, and reserves the KV slots the step will write.
An admitted request starts on the cached pages of its prompt's longest cached prefix (when the
KV manager has a prefix cache): its prefill computes only the rest.
A step that admits new requests is *mixed* (ordinary sampling for all); otherwise it is
decode-only and may speculate ``lookahead`` tokens. When pages run out for running requests,
the newest is preempted: its pages are freed and it waits at the head of the queue, keeping its
tokens, so its prefix is recomputed when it is admitted again.
"""

from __future__ import annotations

from collections import deque

import attrs

from specdec.kv.allocator import OutOfPages
from specdec.kv.paged import KVCacheManager
from specdec.request import FinishReason, Request, RequestStatus

__all__ = ["ScheduledBatch", "BatchScheduler"]


@attrs.frozen(eq=False)
class ScheduledBatch:
    """The requests of one step; ``decode_only`` steps may speculate ``lookahead`` tokens.

    ``admitted`` are the requests that joined the batch this step (a first prefill, or a
    re-prefill after a preemption); ``preempted`` those that left it to wait again.
    """

    requests: tuple[Request, ...]
    decode_only: bool
    lookahead: int
    preempted: tuple[Request, ...] = ()
    admitted: tuple[Request, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.requests


def _waits_for_prefill(req: Request, admitted: list[Request]) -> bool:
    """Whether ``req`` waits for another sample's prefill (its cached pages are keyed by then)."""
    leader = req.after_prefill_of
    return leader is not None and (leader.status is RequestStatus.WAITING or leader in admitted)


class BatchScheduler:
    """FIFO continuous batching with page-budget admission and newest-first preemption.

    Implements :class:`specdec.interfaces.Scheduler`, the interface the engine steps through.
    """

    def __init__(self, kv: KVCacheManager, *, max_batch_size: int, max_prefill_tokens: int) -> None:
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for metrics and tests
        self._arrivals = 0

    def add(self, request: Request) -> None:
        """Queue ``request`` at the back (it waits until admitted)."""
        request.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def find(self, seq_id: int) -> Request | None:
        """The waiting or running request with ``seq_id``, or ``None``."""
        return next((r for r in self.requests() if r.seq_id == seq_id), None)

    def schedule(self, lookahead: int) -> ScheduledBatch:
        """Pick this step's requests and reserve their KV slots."""
        preempted: list[Request] = []
        admitted = self._admit()
        step_lookahead = 0 if admitted else lookahead
        while True:
            try:
                for req in self.running:
                    self.kv.reserve(req.seq_id, len(req.token_ids) + step_lookahead)
                break
            except OutOfPages:
                if step_lookahead > 0:
                    step_lookahead = 0  # first give up speculation, then preempt
                    continue
                if len(self.running) <= 1:
                    raise
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted.append(victim)
                admitted = [r for r in admitted if r is not victim]
        decode_only = not admitted and all(
            r.num_computed == len(r.token_ids) - 1 for r in self.running
        )
        return ScheduledBatch(
            requests=tuple(self.running),
            decode_only=decode_only,
            lookahead=step_lookahead if decode_only else 0,
            preempted=tuple(preempted),
            admitted=tuple(admitted),
        )

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        # Keep one page of headroom per running request so admission does not starve decodes.
        headroom = len(self.running)
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            need = len(req.token_ids)
            if admitted and need > budget:
                break
            if _waits_for_prefill(req, admitted):
                break
            # Checked as if nothing were cached: attaching cached pages only lowers the need.
            if self.kv.pages_for(need) + headroom > self.kv.allocator.num_free_pages:
                break
            self.kv.add_sequence(req.seq_id)
            req.num_computed, req.num_cached_for_proposer = self._attach_prefix(req)
            self.kv.reserve(req.seq_id, need)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            budget -= need
            headroom += 1
        return admitted

    def _attach_prefix(self, req: Request) -> tuple[int, int]:
        """Start ``req`` on the cached pages of its longest cached prefix; the slots they hold,
        and how many of those the proposer's pool holds too.

        Prompt logprobs need every prompt row's logits, so those requests compute them all.
        """
        if req.params.prompt_logprobs is not None:
            return 0, 0
        return self.kv.attach_prefix(req.seq_id, req.token_ids, req.params.cache_salt)

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.kv.free(req.seq_id)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: FinishReason | None = None) -> None:
        """Take ``req`` out of the queue or the batch and free all its pages at once."""
        if reason is not None:
            req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv.has_sequence(req.seq_id):
            self.kv.free(req.seq_id)
        req.status = RequestStatus.FINISHED

    def abort(self, seq_id: int) -> None:
        for req in self.requests():
            if req.seq_id == seq_id:
                self.finish(req, FinishReason.CANCELLED)
                return
        raise KeyError(f"seq_id {seq_id} is not waiting or running")
