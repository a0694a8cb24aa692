"""The Protocols every pluggable part implements.

A researcher adds a proposer by implementing :class:`Proposer` (see docs/custom_proposer.md);
the engine never asks which concrete class it holds. Records passed through these interfaces
live in :mod:`specdec.types`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import torch

from specdec.config import SamplingParams
from specdec.types import (
    BatchLayout,
    DraftProposal,
    ProposalKind,
    RequestEnd,
    VerifyResult,
    VerifyRows,
)

if TYPE_CHECKING:
    from specdec.kv.paged import KVCacheManager, KVSpec, ModelKV
    from specdec.request import FinishReason, Request
    from specdec.sampling import SamplingTensors
    from specdec.scheduler import ScheduledBatch

__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "CapturesGraphs",
    "DraftForecast",
    "ForecastsDrafts",
    "KindRules",
    "Proposer",
    "ProposeContext",
    "RequestEnd",
    "TargetStep",
    "TracksRequests",
    "ReportsLag",
    "UsesTargetTokenizer",
    "Verifier",
    "Sampler",
    "Scheduler",
    "SpeculationContext",
    "SpeculationPolicy",
]


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """One model's attention shape, fixed for its lifetime.

    ``layer_windows`` gives each layer its own window where layers differ (Gemma's sliding and
    global layers); a backend then plans once per distinct window and returns a
    :class:`~specdec.attention.layered.LayeredPlan`, from which a model takes each layer's plan
    (:func:`~specdec.attention.layered.layer_plan`). ``logits_soft_cap`` (Gemma 2) caps every
    score ``s = sm_scale * q.k`` as ``cap * tanh(s / cap)`` before the mask and the softmax.

    Example:
        >>> spec = AttentionSpec(num_qo_heads=4, num_kv_heads=1, head_dim=256, sm_scale=256**-0.5,
        ...                      layer_windows=(512, 512, None), logits_soft_cap=50.0)
        >>> [s.sliding_window for s in spec.layer_specs()[0]], spec.layer_specs()[1]
        ([512, None], (0, 0, 1))
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    sliding_window: int | None = None  # attend to at most this many most recent slots
    # [num_layers] each layer's window (None: global); empty: sliding_window on every layer
    layer_windows: tuple[int | None, ...] = ()
    logits_soft_cap: float | None = None

    def layer_specs(self) -> tuple[tuple[AttentionSpec, ...], tuple[int, ...]]:
        """The distinct per-layer attentions, each a spec of one window (first-seen order), and
        the index of each layer's among them (empty without ``layer_windows``)."""
        if not self.layer_windows:
            return (self,), ()
        windows = tuple(dict.fromkeys(self.layer_windows))
        specs = tuple(attrs.evolve(self, sliding_window=w, layer_windows=()) for w in windows)
        return specs, tuple(windows.index(w) for w in self.layer_windows)


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention over a ragged batch.

    ``plan`` does the host-side work once per step and model; ``run`` is called once per layer,
    writes the new rows' K/V into the pages at ``layout.slot_mapping`` and attends. For a spec
    with ``layer_windows``, ``plan`` returns a :class:`~specdec.attention.layered.LayeredPlan`
    (one plan per window) and the model passes each layer its own
    (:func:`~specdec.attention.layered.layer_plan`). ``run`` must
    not allocate per-step metadata or synchronise with the host. ``plan`` reads the layout's
    host copies (``layout.host``), never its device tensors.

    Plan lifetime: one backend serves the target, the draft model and the heads of a
    generator in the same step, one pass at a time: a model's pass is planned right before its
    layers run and is finished before the next pass is planned. A plan is valid until the next
    ``plan`` call on the same backend (FlashInfer's wrappers hold one plan each; its ``run``
    refuses a stale one); the torch and CPU backends' plans are self-contained records.
    """

    def plan(self, layout: BatchLayout, spec: AttentionSpec) -> object: ...

    def run(
        self,
        plan: object,
        q: torch.Tensor,  # [num_tokens, num_qo_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_qo_heads, head_dim]
        ...


@attrs.frozen(eq=False)
class ProposeContext:
    """Everything a proposer may read to draft for one decode batch.

    ``token_ids[i]`` is sequence ``i``'s whole history (prompt and emitted tokens); its last
    token has not been run through the target yet, so the verify pass starts at slot
    ``len(token_ids[i]) - 1``. Page capacity for ``num_speculative_tokens`` more slots has been
    reserved by the engine, so proposers never allocate. ``kv`` is the proposer's own KV
    (``None`` when it declared no ``kv_specs``). ``prompt_lens[i]`` is how many of
    ``token_ids[i]`` are sequence ``i``'s prompt (the rest it emitted); empty when whoever built
    the context did not say (the engine always does).
    """

    seq_ids: tuple[int, ...]
    token_ids: tuple[Sequence[int], ...]
    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]
    num_speculative_tokens: int  # this step's width, <= proposer.num_speculative_tokens
    kv: ModelKV | None = None
    backend: AttentionBackend | None = None
    device: torch.device = torch.device("cpu")  # where the target runs: put proposal tensors here
    sampling: SamplingTensors | None = None  # params as tensors on ``device``, one row per sequence
    # CUDA graphs of the proposer's model over ``kv`` (specdec.graphs.PassGraphs), when the
    # generator was built with cuda_graphs=True and the proposer is a draft model.
    graphs: object | None = None
    prompt_lens: tuple[int, ...] = ()  # per sequence: the prompt's length within token_ids[i]
    # Per sequence: its request options as a transform of draft logits, ``fn(extensions,
    # logits [rows, width]) -> logits`` (extension = the drafts before each row), or None.
    # Applying it keeps drafts inside the request's constraints; skipping it stays lossless.
    logits_transforms: tuple[object | None, ...] = ()

    def sampling_tensors(self, device: torch.device | str | None = None) -> SamplingTensors:
        """``params`` as sampling tensors on ``device`` (default: ``self.device``): the step's
        own set when the engine built it there, else a new one."""
        from specdec.sampling import SamplingTensors

        device = torch.device(self.device if device is None else device)
        if self.sampling is not None and self.sampling.device == device:
            return self.sampling
        return SamplingTensors.from_params(self.params, device)


@attrs.frozen(eq=False)
class TargetStep:
    """What one target forward committed, told to the proposer so it can follow the target.

    Sent after every target pass: prefill, plain decode and verification. ``input_token_ids``
    are the rows the target ran (flattened, ``qo_indptr`` CSR), starting at slot
    ``start_slots[i]``; ``kept_rows[i]`` of them (a prefix, after tree compaction) are now the
    target's committed KV. ``token_ids[i]`` is the history after the step (its last token is
    the newly emitted one, not yet in any KV). ``hidden_states`` are the target's last hidden
    states for the input rows, present when the proposer asked for them; for tree steps they
    have been gathered so the kept path comes first.
    """

    seq_ids: tuple[int, ...]
    token_ids: tuple[Sequence[int], ...]
    input_token_ids: torch.Tensor  # [num_rows] int64
    qo_indptr: tuple[int, ...]  # host CSR over input rows, len batch + 1
    start_slots: tuple[int, ...]
    kept_rows: tuple[int, ...]
    num_accepted: tuple[int, ...]  # drafts accepted (0 on plain steps)
    hidden_states: torch.Tensor | None = None  # [num_rows, hidden]
    kv: ModelKV | None = None
    backend: AttentionBackend | None = None

    def kept_pairs(self) -> tuple[torch.Tensor, list[list[int]]]:
        """What a head re-runs over after the step: the hidden states of the kept rows
        ``[sum(kept_rows), width]`` and, per sequence, the committed token that followed each
        (row ``r`` at slot ``start + r`` pairs with token ``start + r + 1``)."""
        if self.hidden_states is None:
            raise ValueError("this TargetStep carries no hidden states (needs_target_hidden is False)")
        index, next_tokens = [], []
        for i, (tokens, start, kept) in enumerate(zip(self.token_ids, self.start_slots, self.kept_rows)):
            index.extend(range(self.qo_indptr[i], self.qo_indptr[i] + kept))
            next_tokens.append(list(tokens[start + 1 : start + 1 + kept]))
        hidden = self.hidden_states  # [num_rows, width]
        if len(index) != hidden.shape[0]:  # verify steps: the kept rows only (a tree's first)
            hidden = hidden[torch.tensor(index, device=hidden.device)]
        return hidden, next_tokens


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for the target to verify.

    Lifecycle per sequence: ``propose`` (decode steps only) -> ``on_target_step`` (after every
    target pass, speculative or not) -> ... -> ``release`` when the sequence ends (finished,
    cancelled, failed or preempted). Proposers keep per-sequence state keyed by sequence id and
    must roll it back to the target's committed length in ``on_target_step``. A preempted
    sequence comes back later under the same id, prefilled again from its first token.

    Optional: :class:`TracksRequests` (``on_request_start`` / ``on_request_end`` with a
    :class:`~specdec.types.RequestEnd` reason), for proposers that learn across requests or
    index each prompt (a suffix tree, an online learner); ``release`` is called either way.

    Optional: ``attach(target)``; a Generator calls it (before ``kv_specs``) with its target
    model, for proposers that borrow the target's weights (MTP and EAGLE heads). Optional:
    ``target_hidden_layers`` (a tuple of layer indices, read after ``attach``): with
    ``needs_target_hidden``, ``TargetStep.hidden_states`` holds the inputs of those target
    layers side by side (index ``num_layers``: the last layer's output), not the last output.
    """

    kind: ProposalKind
    num_speculative_tokens: int  # widest proposal (chain length or tree node count)
    needs_target_hidden: bool  # the engine asks the target for hidden states when True

    def kv_specs(self) -> tuple[KVSpec, ...]:
        """KV pools this proposer needs (empty for model-free proposers)."""
        ...

    def propose(self, ctx: ProposeContext) -> DraftProposal: ...

    def on_target_step(self, step: TargetStep) -> None: ...

    def release(self, seq_id: int) -> None: ...


@runtime_checkable
class CapturesGraphs(Protocol):
    """A proposer capability: its drafting passes run one specdec model over its own KV pool
    (a draft model), so a generator built with ``cuda_graphs=True`` captures them as it
    captures the target's (``ProposeContext.graphs``). Proposers without it draft eagerly.
    """

    def graph_model(self) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """(the model whose passes are captured, an LM head replacing its own or ``None``)."""
        ...


@runtime_checkable
class TracksRequests(Protocol):
    """A proposer capability: told when each request starts and stops being decoded.

    A request *starts* when the scheduler admits it: its first prefill, and again its re-prefill
    after a preemption. It *ends* once per start: finished, cancelled, failed, or preempted
    (:class:`~specdec.types.RequestEnd`). ``on_request_end`` comes before ``release``, so the
    proposer's per-request state is still there to learn from. A request cancelled before it was
    ever admitted neither starts nor ends. Proposers without these methods are not called.

    Example:
        >>> class Counting(TokenListProposer):
        ...     def on_request_start(self, seq_id, prompt_ids): self.live.add(seq_id)
        ...     def on_request_end(self, seq_id, reason): self.live.discard(seq_id)
    """

    def on_request_start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        """``seq_id`` is admitted with prompt ``prompt_ids`` (after a preemption: again; what it
        emitted before comes in the next ``ProposeContext.token_ids``)."""
        ...

    def on_request_end(self, seq_id: int, reason: RequestEnd) -> None:
        """``seq_id`` stopped being decoded for ``reason``."""
        ...


@runtime_checkable
class ReportsLag(Protocol):
    """A proposer capability: how far a stateful proposer is behind a request's history.

    A draft model runs, before it drafts, every token of the history it has not run yet (a new
    request's prompt; what was emitted while it did not draft): its catch-up. The engine asks
    before and after each ``propose`` and tells the policy the difference, the tokens this call
    really caught up on. It cannot know that itself when the proposer chooses per request
    whether its model runs (:class:`~specdec.proposers.SuffixHybrid`: a request its suffix tree
    drafts catches up on nothing); counted as caught up, those tokens once priced a draft
    model's catch-up at a quarter of its cost. Proposers without the method are counted by the
    engine (``SpeculationContext.unseen``).
    """

    def lag(self, seq_id: int, num_tokens: int) -> int:
        """Tokens of the request's ``num_tokens``-token history not run yet, beyond those a
        drafting step runs anyway (the newest, and after a step that accepted every draft the
        last draft, which was never run): 0 for a request that drafted on its last step."""
        ...


@attrs.frozen
class DraftForecast:
    """What a proposer expects to draft for one request when a step allows ``n`` tree nodes.

    ``nodes``: the nodes it would draft (the request's verify rows, less its own token);
    ``accepted``: the drafts it expects the target to accept, calibrated on the request's own
    steps; ``model``: whether a model's forward drafts them (drafting time, and a catch-up on
    ``catchup`` tokens the model has not run first), else they cost next to nothing (a suffix
    tree's lookup).
    """

    nodes: int
    accepted: float
    model: bool
    catchup: int = 0


@runtime_checkable
class ForecastsDrafts(Protocol):
    """A proposer capability: per request, what it would draft at each tree size.

    :class:`~specdec.proposers.SuffixHybrid` draws from a suffix tree or a model per request:
    what a size buys differs by request and step (a retried request's suffix tree accepts 16
    tokens where a fresh prompt's accepts none, and the model drafts at most its own k
    however many nodes are allowed). A policy that knows only the generator's accepted length
    per size cannot tell them apart and prices nodes nobody drafts as verify rows.
    """

    def forecaster(
        self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]], remaining: Sequence[int]
    ) -> Callable[[int], tuple[DraftForecast, ...]] | None:
        """For this step's requests, a function from a node count ``n >= 1`` to one forecast
        per request (``None``: no forecast this step). Valid until the next ``propose``, which
        drafts what it forecast for the ``n`` chosen."""
        ...


@runtime_checkable
class SharesCachedPrefix(Protocol):
    """A proposer capability, needed for prefix caching by proposers with a KV pool (draft
    models, MTP and EAGLE heads): every pool's KV of a cached page must be final, and a request
    that starts on cached pages starts there in every pool.

    A generator whose proposer has a KV pool but not this capability runs without a prefix
    cache. Model-free proposers (prompt lookup) need nothing.

    Example:
        >>> class MyDraft:
        ...     kv_lookahead = 0                   # KV at slot p depends on tokens <= p only
        ...     def kv_valid_slots(self, seq_id, num_computed): return self.done.get(seq_id, 0)
        ...     def adopt_prefix(self, seq_id, num_slots): self.done[seq_id] = num_slots
    """

    kv_lookahead: int  # tokens after slot p that this proposer's KV at p depends on (heads: 1)

    def kv_valid_slots(self, seq_id: int, num_computed: int) -> int:
        """Slots ``0 .. n - 1`` of ``seq_id`` whose KV in this proposer's pool is final (the
        target's KV holds ``num_computed``), after the step's ``on_target_step``."""
        ...

    def adopt_prefix(self, seq_id: int, num_slots: int) -> None:
        """``seq_id`` starts with ``num_slots`` slots of cached KV in every pool (called at its
        admission, before its prefill; not called when nothing was cached)."""
        ...


@runtime_checkable
class UsesTargetTokenizer(Protocol):
    """A proposer capability: it drafts with a model of its own vocabulary (a draft model),
    which may pad its embedding table differently from the target's (Qwen2.5 0.5B: 151,936
    rows, 7B: 152,064, one tokenizer of 151,665 tokens). A Generator passes its tokenizer, the
    target's, to ``set_target_tokenizer`` before ``attach``, so that ``attach`` can accept rows
    that differ only past ``len(tokenizer)`` and refuse a draft of another tokenizer.

    Example:
        >>> class MyDraft:
        ...     def set_target_tokenizer(self, tokenizer): self.target_tokenizer = tokenizer
    """

    def set_target_tokenizer(self, tokenizer: object | None) -> None:
        """The target's tokenizer (``None``: the generator has none)."""
        ...


@runtime_checkable
class Verifier(Protocol):
    """Decides, per sequence, the longest draft prefix the target's distribution allows."""

    def verify(
        self,
        target_logits: torch.Tensor,  # [batch, width + 1, vocab] float, row j predicts after draft j-1
        proposal: DraftProposal,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        sampling: SamplingTensors | None = None,
    ) -> VerifyResult:
        """``sampling``: ``params`` as tensors (one row per sequence), built once per engine
        step; ``None`` builds them from ``params``."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """Turns logits into the processed distribution and draws tokens from it."""

    def probs(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        *,
        sampling: SamplingTensors | None = None,
    ) -> torch.Tensor:  # [rows, vocab] float, rows sum to 1
        ...

    def sample(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        sampling: SamplingTensors | None = None,  # params as tensors, built once per step
    ) -> torch.Tensor:  # [rows] int64
        ...


@runtime_checkable
class KindRules(Protocol):
    """What one :class:`~specdec.types.ProposalKind` needs from the engine around the verify
    pass: the engine looks the rules up by kind (:func:`specdec.verify.kinds.default_kind_rules`)
    and never asks which kind it holds. Stateless; one instance serves every step.
    """

    # Whether every sequence's verify rows may be padded to the step's full width, so the pass
    # is uniform and can replay a captured CUDA graph (a chain's causal rows can; a tree's not).
    pads_to_width: bool

    def caps(self, caps: Sequence[int], lookahead: int) -> tuple[int, ...]:
        """Each request's most k, from ``caps`` (the most drafts each can keep)."""
        ...

    def propose_steps(self, proposal: DraftProposal, lookahead: int) -> int:
        """How many drafting steps ``proposal`` cost (the policy's cost model)."""
        ...

    def read_drafts(
        self, proposal: DraftProposal
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Check the kind's own fields; the drafts and (trees) parents as host lists, read in
        one device-to-host copy."""
        ...

    def verify_rows(
        self,
        parents: list[list[int]] | None,  # per sequence, host copy of proposal.parents
        num_draft: Sequence[int],
        starts: Sequence[int],  # per sequence: slot of its verify row 0
    ) -> VerifyRows:
        """Positions, masks and depths of each sequence's verify rows."""
        ...

    def row_histories(
        self, drafts: Sequence[int], parents: Sequence[int] | None, n: int
    ) -> list[list[int]]:
        """One sequence's verify rows ``0 .. n``: the drafted tokens between its last emitted
        token and each row (a chain's ``drafts[:j]``, a tree node's path from the root), the
        history request options transform each row with."""
        ...

    def commit(
        self,
        manager: KVCacheManager,
        layout: BatchLayout,  # the verify pass's rows
        starts: Sequence[int],
        paths: Sequence[Sequence[int]],  # per sequence: the kept rows, row 0 first
        hidden: torch.Tensor | None,  # [num rows, hidden] in layout order
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bring the target's KV in line with the kept paths; the pass's input ids
        ``[num rows]`` and hidden states with each sequence's kept rows first."""
        ...


@runtime_checkable
class Scheduler(Protocol):
    """Owns the request queue and decides which requests run in each step
    (:class:`specdec.scheduler.BatchScheduler`). The engine calls ``schedule`` and ``finish``;
    the generator ``add`` and ``find``."""

    def add(self, request: Request) -> None:
        """Queue ``request`` (it waits until admitted)."""
        ...

    def find(self, seq_id: int) -> Request | None:
        """The waiting or running request with ``seq_id``, or ``None``."""
        ...

    def has_unfinished(self) -> bool: ...

    def schedule(self, lookahead: int) -> ScheduledBatch:
        """Pick this step's requests and reserve their KV slots, ``lookahead`` drafts each
        when the step may speculate; preempt the newest when pages run short."""
        ...

    def finish(self, request: Request, reason: FinishReason | None = None) -> None:
        """Take ``request`` out of the queue or the batch and free all its pages."""
        ...


@attrs.frozen(eq=False)
class SpeculationContext:
    """What a :class:`SpeculationPolicy` may read to choose this step's k per request.

    ``caps[i]`` is the most drafts request ``i`` can keep (its remaining token budget minus the
    target's own token); ``unseen[i]`` counts the tokens of its history that the proposer has not
    been shown in a ``propose`` call (all of them before its first draft, then those emitted in
    steps where it drafted nothing): a stateful proposer (a draft model) must catch up on them.
    ``remaining[i]`` is the most tokens request ``i`` may still emit (for a chain ``caps[i] + 1``;
    a tree's caps count nodes, so only this field tells how long the request has left); empty
    where the caller does not know (a policy then assumes ``caps[i] + 1``). ``forecast``: for a
    :class:`ForecastsDrafts` tree proposer, what each request would draft at ``n`` nodes
    (``None`` otherwise).
    """

    seq_ids: tuple[int, ...]
    params: tuple[SamplingParams, ...]
    caps: tuple[int, ...]
    unseen: tuple[int, ...]
    max_k: int  # this step's widest allowed draft (the proposer's k, or 0 when pages are short)
    kind: ProposalKind = ProposalKind.CHAIN  # TREE: k counts tree nodes, not chain positions
    remaining: tuple[int, ...] = ()
    forecast: Callable[[int], tuple[DraftForecast, ...]] | None = None


@runtime_checkable
class SpeculationPolicy(Protocol):
    """Chooses, per decode step, how many tokens each request drafts (0: speculation off).

    The engine asks :meth:`choose` before every decode-only step and reports what the step
    cost and how the drafts fared. All zeros make the step a plain decode step; otherwise only
    the requests with ``k > 0`` are sent to the proposer, drafting ``max(k)`` tokens, each
    request keeping at most its own ``k``. Greedy output does not depend on the choices.
    Implementations: :class:`specdec.policy.AdaptivePolicy` (the default) and
    :class:`specdec.policy.FixedPolicy`.
    """

    def choose(self, ctx: SpeculationContext) -> tuple[int, ...]:
        """One k per request, each in ``0 .. min(ctx.max_k, ctx.caps[i])``."""
        ...

    def observe_target(self, rows: int, seconds: float) -> None:
        """A step's target pass ran ``rows`` query rows; the step took ``seconds`` apart from
        drafting (prefill, plain decode and verification steps alike)."""
        ...

    def observe_propose(self, batch: int, width: int, seconds: float, unseen: int) -> None:
        """``propose`` drafted ``width`` tokens for ``batch`` requests in ``seconds``; they had
        ``unseen`` history tokens in total to catch up on."""
        ...

    def observe_verify(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """The verifier kept ``num_accepted`` of the request's ``num_drafted`` drafts."""
        ...

    def release(self, seq_id: int) -> None:
        """The request ended (finished, cancelled, failed or preempted)."""
        ...
