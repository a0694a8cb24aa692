"""The facade: build a generator from checkpoints or objects, then generate and stream.

Wiring only: validation of user input, construction of the KV cache, scheduler and engine,
and turning requests into outputs. The math lives in sampling/verify, the stepping in engine.
"""

from __future__ import annotations

import json
import math
import numbers
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch

from specdec.attention import default_backend
from specdec.config import MAX_SPECULATIVE_TOKENS, CacheConfig, SamplingParams
from specdec.distributed.follower import Follower
from specdec.distributed.journal import JournaledKVCacheManager
from specdec.distributed.model import TensorParallelLlama, load_tensor_parallel
from specdec.engine import Engine
from specdec.graphs import CudaCapture, PassGraphs
from specdec.handle import RequestHandle
from specdec.interfaces import CapturesGraphs, Proposer, SpeculationPolicy, Verifier
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager
from specdec.metrics import SpecMetrics
from specdec.models.llama import LlamaModel
from specdec.models.loading import load_model, resolve_device
from specdec.models.quantized import check_quantization
from specdec.policy import AdaptivePolicy, FixedPolicy
from specdec.request import FinishReason, Request, RequestView, TokenLogprob
from specdec.sampling import TorchSampler, make_generator
from specdec.scheduler import BatchScheduler
from specdec.types import ProposalKind, StepOutput
from specdec.verify.kinds import default_verifiers

__all__ = ["Generator", "GenerationOutput"]

Prompt = str | Sequence[int]


@attrs.frozen
class GenerationOutput:
    """One request's result. ``text`` excludes a matched stop string."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    metrics: SpecMetrics
    logprobs: list[TokenLogprob] | None = None


class Generator:
    """Plain or speculative generation over one target model.

    With a proposer, ``policy`` chooses how many tokens each request drafts per step:
    ``AdaptivePolicy()`` by default (k from measured step costs and acceptance, 0 where
    speculation does not pay), ``FixedPolicy(k)`` or just an int ``k`` to fix it.

    Every public method may be called from any number of threads and asyncio tasks at once:
    their requests share the engine's batches, one step at a time, and each gets exactly the
    output it would get alone (see "Threads and asyncio" in docs/concepts.md).

    Under tensor parallelism (``tensor_parallel_size=N``, docs/distributed.md) every rank
    builds the generator and makes the same ``generate`` calls; rank 0 runs everything and
    returns the outputs, the other ranks follow its steps over their shards and get ``None``.

    Example:
        >>> gen = Generator.from_pretrained("path/to/target", dtype="bfloat16")
        >>> gen.generate("def fib(n):", SamplingParams(max_new_tokens=32)).text
    """

    def __init__(
        self,
        *,
        target: LlamaModel,
        tokenizer: object | None = None,
        proposer: Proposer | None = None,
        cache_config: CacheConfig | None = None,
        eos_token_ids: Sequence[int] | None = None,
        backend: object | None = None,
        verifier: Verifier | None = None,
        policy: SpeculationPolicy | int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if not isinstance(target, LlamaModel):
            raise TypeError(f"target must be a specdec LlamaModel, got {type(target).__name__}")
        _check_components(proposer, verifier, cache_config)
        _check_cuda_graphs(cuda_graphs, target.device, isinstance(target, TensorParallelLlama))
        self._follower: Follower | None = None
        if isinstance(target, TensorParallelLlama) and not target.group.is_leader:
            # Another rank: no scheduler, proposer or sampler; it follows rank 0's steps.
            self.target, self.tokenizer, self.proposer = target, tokenizer, None
            self._follower = Follower(target, backend or default_backend(target.device, target.dtype))
            self.kv = self._follower.kv
            self._lock = threading.RLock()
            return
        policy = _resolve_policy(policy, proposer)
        attach = getattr(proposer, "attach", None)
        if attach is not None:  # binds proposers built on the target (MTP/EAGLE heads); checks
            attach(target)  # that a draft model fits it, before any page is allocated
        cache_config = cache_config or CacheConfig()
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.cache_config = cache_config
        cfg = target.config
        self.max_context = cfg.max_position_embeddings
        self.eos_token_ids = frozenset(
            cfg.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        )
        k = proposer.num_speculative_tokens if proposer is not None else 0
        self.max_seq_slots = (cache_config.max_num_tokens or min(self.max_context, 4096)) + k + 1
        num_pages = cache_config.num_pages or cache_config.max_batch_size * math.ceil(
            self.max_seq_slots / cache_config.page_size
        )
        parallel = isinstance(target, TensorParallelLlama)
        manager = JournaledKVCacheManager if parallel else KVCacheManager
        self.kv = manager(PageAllocator(num_pages), cache_config.page_size)
        target_kv = self.kv.add_pool(target.kv_spec("target"), target.device)
        proposer_kv = None
        if proposer is not None:
            specs = proposer.kv_specs()
            if len(specs) > 1:
                raise ValueError("a proposer may declare at most one KV pool")
            if specs:
                proposer_kv = self.kv.add_pool(specs[0], target.device)
        self.scheduler = BatchScheduler(
            self.kv,
            max_batch_size=cache_config.max_batch_size,
            max_prefill_tokens=max(8192, cache_config.page_size),
        )
        backend = backend or default_backend(target.device, target.dtype)
        self.engine = Engine(
            target=target,
            target_kv=target_kv,
            backend=backend,
            scheduler=self.scheduler,
            sampler=TorchSampler(),
            verifiers=_verifiers(proposer, verifier),
            proposer=proposer,
            proposer_kv=proposer_kv,
            num_speculative_tokens=k,
            policy=policy,
            graphs=_pass_graphs(target, target_kv, backend, num_pages) if cuda_graphs else None,
            proposer_graphs=_draft_graphs(proposer, proposer_kv, backend, num_pages)
            if cuda_graphs
            else None,
        )
        # Threading: one lock serialises everything that touches the engine (scheduler, KV
        # pages, proposer, policy, metrics) and is held for exactly one step, so callers on
        # many threads interleave step by step and share batches. Submissions go through an
        # inbox that needs no lock, so submit() never waits for a step in progress; the next
        # step (or cancel) moves them into the scheduler. Tokenizers are not thread-safe.
        self._lock = threading.RLock()
        self._inbox: deque[Request] = deque()
        self._ids_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._next_seq_id = 0
        self._num_steps = 0
        if parallel:
            target.bind(self.kv)  # the other ranks build the same pages

    # ----------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        *,
        proposer: Proposer | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "bfloat16",
        cache_config: CacheConfig | None = None,
        policy: SpeculationPolicy | int | None = None,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        backend: object | None = None,
        cuda_graphs: bool = False,
    ) -> Generator:
        """Load ``target`` (HF directory, ``.gguf`` file, known name or hub id) and its tokenizer.

        ``quantization`` (CPU): ``"int8"`` or ``"q4"`` stores the target's linear layers as
        weight-only int8 or 4-bit (see :mod:`specdec.models.quantized`); speculation then
        reproduces the quantized model's own greedy output exactly.

        ``tensor_parallel_size=N`` (N > 1) shards the target over the N ranks of a group
        started by ``torchrun --nproc-per-node N`` or :func:`specdec.distributed.launch`; call
        this on every rank (rank 0 keeps the proposer; other ranks ignore it). Each rank reads
        only its slices of a safetensors checkpoint (see docs/distributed.md).

        ``backend``: the attention backend (default: :func:`specdec.attention.default_backend`,
        FlashInfer on CUDA when installed). ``cuda_graphs=True`` (CUDA, FlashInfer) replays the
        target's decode and chain-verify passes of up to 32 sequences from captured CUDA graphs
        (:mod:`specdec.graphs`);
        off by default until the GPU check has run it (docs/gpu.md)."""
        _check_components(proposer, None, cache_config)  # before the (slow) load
        if cuda_graphs is not False:  # the device is checked first, as load_model does
            _check_cuda_graphs(cuda_graphs, resolve_device(device), tensor_parallel_size > 1)
        _check_tensor_parallel(tensor_parallel_size, quantization)
        if tensor_parallel_size == 1 or proposer is not None:  # other ranks ignore the policy
            _resolve_policy(policy, proposer)
        check_quantization(quantization, device)
        if tensor_parallel_size > 1:
            model, _, path = load_tensor_parallel(
                target, tensor_parallel_size, dtype=dtype, device=device
            )
        else:
            model, _, path = load_model(target, dtype=dtype, device=device, quantization=quantization)
        tokenizer = load_tokenizer(path)
        return cls(
            target=model,
            tokenizer=tokenizer,
            proposer=proposer,
            cache_config=cache_config,
            eos_token_ids=_eos_ids(path, model, tokenizer),
            policy=policy,
            backend=backend,
            cuda_graphs=cuda_graphs,
        )

    @classmethod
    def from_components(
        cls,
        target: LlamaModel,
        tokenizer: object | None = None,
        *,
        proposer: Proposer | None = None,
        cache_config: CacheConfig | None = None,
        eos_token_ids: Sequence[int] | None = None,
        verifier: Verifier | None = None,
        policy: SpeculationPolicy | int | None = None,
        backend: object | None = None,
        cuda_graphs: bool = False,
    ) -> Generator:
        """Build from objects already in memory (tests, notebooks, custom models)."""
        return cls(
            cuda_graphs=cuda_graphs,
            backend=backend,
            target=target,
            tokenizer=tokenizer,
            proposer=proposer,
            cache_config=cache_config,
            eos_token_ids=eos_token_ids,
            verifier=verifier,
            policy=policy,
        )

    def with_proposer(
        self,
        proposer: Proposer | None,
        *,
        cache_config: CacheConfig | None = None,
        policy: SpeculationPolicy | int | None = None,
        backend: object | None = None,
    ) -> Generator:
        """A generator sharing this one's target weights, tokenizer and EOS ids, with another
        proposer (``None``: plain decoding), its own KV cache and its own speculation policy
        (a fresh ``AdaptivePolicy()`` unless ``policy`` is given); ``backend``: this one's
        attention backend unless given."""
        if isinstance(self.target, TensorParallelLlama):
            raise ValueError(
                "with_proposer is not supported under tensor parallelism (a sharded target serves "
                "one Generator): build another with from_pretrained(..., tensor_parallel_size=N)"
            )
        other = Generator(
            target=self.target,
            tokenizer=self.tokenizer,
            proposer=proposer,
            cache_config=cache_config or self.cache_config,
            eos_token_ids=sorted(self.eos_token_ids),
            policy=policy,
            backend=backend or self.engine.backend,
            cuda_graphs=self.engine.graphs is not None,  # graphs of its own KV pool
        )
        other._tokenizer_lock = self._tokenizer_lock  # one tokenizer, one lock
        return other

    # ------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate for one prompt (text or token ids) or a list of them (list in, list out).

        ``params`` is one SamplingParams for all prompts or a list with one per prompt, so
        greedy and sampled requests can share a batch.

        Runs through the same engine as :meth:`submit` (requests submitted elsewhere advance
        too). If a request fails (see ``Engine.step``), the others still run to completion,
        uncorrupted, and then the failed request's exception is raised.

        Under tensor parallelism, on ranks other than 0 this follows rank 0's matching call
        (its arguments are not used) and returns ``None``.
        """
        if self._follower is not None:
            self._follower.follow()
            return None
        try:
            return self._generate(prompts, params)
        finally:
            if isinstance(self.target, TensorParallelLlama):
                self.target.end_call()

    def _generate(self, prompts, params) -> GenerationOutput | list[GenerationOutput]:
        single, prompt_list = _normalize_prompts(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"params has {len(params)} entries for {len(prompt_list)} prompts; pass one "
                    "SamplingParams or one per prompt"
                )
            per_prompt = [_check_params(p) for p in params]
        else:
            per_prompt = [_check_params(params)] * len(prompt_list)
        reqs = [self._make_request(p, sp) for p, sp in zip(prompt_list, per_prompt)]
        self._run(reqs)
        outs = [self._output(r) for r in reqs]
        return outs[0] if single else outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt's completion as tokens are emitted.

        Bad input raises here, at the call, not at the first ``next()``.
        """
        self._require_leader("stream()")
        single, prompt_list = _normalize_prompts(prompt)
        if not single:
            raise TypeError("stream() takes one prompt (a string or a list of token ids)")
        params = _check_params(params)
        return self._stream(self._make_request(prompt_list[0], params))

    def _stream(self, req: Request) -> Iterator[str]:
        try:
            self._submit([req])
            yield from RequestHandle(self, req)
        finally:
            self._cancel_request(req)

    # ------------------------------------------------------------ embedding API
    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue one prompt and return its handle at once, without stepping the engine.

        Validated like :meth:`generate` before anything is queued. The request advances
        whenever anyone steps this generator: ``handle.result()``, its iterators,
        :meth:`step`, or a concurrent :meth:`generate`.

        Example:
            >>> h = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=8))
            >>> async for delta in h.stream_async(): ...
        """
        self._require_leader("submit()")
        single, prompt_list = _normalize_prompts(prompt)
        if not single:
            raise TypeError("submit() takes one prompt (a string or a list of token ids)")
        req = self._make_request(prompt_list[0], _check_params(params))
        self._submit([req])
        return RequestHandle(self, req)

    def step(self) -> StepOutput:
        """Run one engine step over every submitted request.

        Returns the step's :class:`~specdec.types.StepOutput`: ``seq_ids`` (request ids) of
        the batch with the ``new_token_ids`` each got, and ``failed_seq_ids``. An empty
        output means there was nothing to run. From several threads, steps run one after
        another.
        """
        self._require_leader("step()")
        with self._lock:
            self._drain_inbox()
            out = self.engine.step()
            self._num_steps += 1
            return out

    # ---------------------------------------------------- tensor parallelism
    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the tensor-parallel group (0: the leader; 0 without one)."""
        return self.target.group.rank if isinstance(self.target, TensorParallelLlama) else 0

    def serve(self) -> None:
        """Other ranks: follow rank 0's steps, whatever it calls (``stream``, ``submit``...),
        until rank 0 calls :meth:`close`. On rank 0 (or without tensor parallelism) a no-op."""
        if self._follower is not None:
            while self._follower.follow():
                pass

    def close(self) -> None:
        """Rank 0: end the other ranks' :meth:`serve`. Without tensor parallelism a no-op."""
        if self._follower is None and isinstance(self.target, TensorParallelLlama):
            from specdec.distributed.messages import MessageKind

            self.target.end_call(MessageKind.SHUTDOWN)

    def _require_leader(self, method: str) -> None:
        if self._follower is not None:
            raise RuntimeError(
                f"{method} is rank 0's under tensor parallelism; rank "
                f"{self.tensor_parallel_rank} calls generate() (same calls as rank 0) or serve()"
            )

    @property
    def num_steps(self) -> int:
        """Engine steps taken so far (a clock for consumers sharing the engine)."""
        return self._num_steps

    def cancel(self, request_id: int) -> bool:
        """Cancel a submitted request by id; its pages and proposer state are freed at once.

        Returns ``True`` if it was waiting or running, ``False`` if it had already ended.

        Raises:
            KeyError: no request with this id was made by this generator.
        """
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        with self._lock:
            self._drain_inbox()
            req = self.scheduler.find(request_id)
            if req is not None:
                return self._cancel_request(req)
        if 0 <= request_id < self._next_seq_id:
            return False
        raise KeyError(f"request_id {request_id} is not a request of this generator")

    def _cancel_request(self, req: Request) -> bool:
        """Cancel ``req`` between steps (waits for a step in progress); ``False`` if it had
        already ended."""
        with self._lock:
            self._drain_inbox()
            if req.finished:
                return False
            self.engine.cancel(req)
            return True

    def _drain_inbox(self) -> None:
        """Queue the submitted requests in arrival order (call under the lock)."""
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())

    def _advance(self, reqs: Sequence[Request], seen: int) -> None:
        """One engine step on behalf of the consumer of ``reqs``, unless they have all ended
        or some thread has stepped since the consumer saw step count ``seen``.

        While another thread steps, this blocks on the lock (no busy waiting) and then
        returns at once: that step moved these requests too. A step with nothing to run
        while one of ``reqs`` is unfinished would loop forever, so it is an error.
        """
        with self._lock:
            if self._num_steps != seen or all(r.finished for r in reqs):
                return
            out = self.step()
            if not out.seq_ids and not all(r.finished for r in reqs):
                req = next(r for r in reqs if not r.finished)
                raise RuntimeError(f"request {req.seq_id} is not queued in this generator's engine")

    def _progress(self, req: Request, step_unless_since: int | None) -> RequestView:
        """``req``'s progress after stepping as :meth:`_advance` does (``None``: no step)."""
        with self._lock:
            if step_unless_since is not None:
                self._advance([req], step_unless_since)
            return req.view(self._num_steps)

    def _finished_output(self, req: Request) -> GenerationOutput:
        self._raise_if_failed([req])
        return self._output(req)

    # ------------------------------------------------------------ inspection
    @property
    def metrics(self) -> SpecMetrics:
        """Totals over every request this generator has run (a snapshot: read it again
        for later totals)."""
        self._require_leader("metrics")
        with self._lock:
            return self.engine.metrics.snapshot()

    @property
    def policy(self) -> SpeculationPolicy | None:
        """The speculation policy (``None`` without a proposer)."""
        self._require_leader("policy")
        return self.engine.policy

    def kv_stats(self) -> dict[str, int]:
        """``num_free_pages``, ``num_total_pages`` and more, from the one page allocator."""
        with self._lock:
            return self.kv.stats()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this generator has no tokenizer: pass token ids instead of text")
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # -------------------------------------------------------------- internals
    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt must not be empty (got the empty string)")
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty (it encodes to zero tokens)")
        vocab = self.target.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_context:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_context}, so a "
                f"prompt may have at most {self.max_context - 1}"
            )
        max_total = min(self.max_context, len(ids) + params.max_new_tokens)
        # A sequence needs its tokens plus k + 1 verify slots, within both the per-sequence
        # limit and the whole page pool.
        slots = min(self.max_seq_slots, self.kv.allocator.num_total_pages * self.kv.page_size)
        capacity = slots - self.engine.num_speculative_tokens - 1
        if max_total > capacity:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the KV cache's per-sequence capacity ({capacity} tokens); raise "
                "CacheConfig(max_num_tokens=...) or CacheConfig(num_pages=...)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("params.stop needs a tokenizer; use stop_token_ids instead")
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise ValueError(
                f"params.stop_token_ids must be token ids in [0, {vocab}), got {bad_stops}"
            )
        with self._ids_lock:
            seq_id = self._next_seq_id
            self._next_seq_id += 1
        return Request(
            seq_id=seq_id,
            prompt_ids=ids,
            params=params,
            # Seeded requests draw position-keyed noise (Request.randomness); only unseeded
            # sampled requests keep a stream.
            generator=None
            if params.is_greedy or params.seed is not None
            else make_generator(None, self.target.device),
            eos_token_ids=self.eos_token_ids,
            max_total_tokens=max_total,
            decode=(lambda out, ctx=ids: self._decode_output(ctx, out)) if params.stop else None,
        )

    def _submit(self, reqs: Sequence[Request]) -> None:
        self._inbox.extend(reqs)  # one call: a generate()'s requests arrive together
        if self._lock.acquire(blocking=False):  # queue them now unless a step is running
            try:
                self._drain_inbox()
            finally:
                self._lock.release()

    def _run(self, reqs: Sequence[Request]) -> None:
        try:
            self._submit(reqs)
            while not all(r.finished for r in reqs):
                self._advance(reqs, self._num_steps)
        finally:
            for req in reqs:
                self._cancel_request(req)
        self._raise_if_failed(reqs)

    @staticmethod
    def _raise_if_failed(reqs: Sequence[Request]) -> None:
        """Raise the exception that failed the first failed request (its own type, so a
        plug-in's ValueError stays a ValueError); the other requests are already complete."""
        for req in reqs:
            if req.finish_reason is FinishReason.ERROR:
                raise req.error or RuntimeError(f"request {req.seq_id} failed")

    def _text(self, req: Request) -> str:
        return self._text_of(req.prompt_ids, req.output_ids, req.stop_text_len)

    def _text_of(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], stop_text_len: int | None
    ) -> str:
        """The output's text, cut before a matched stop string."""
        text = self._decode_output(prompt_ids, output_ids)
        return text if stop_text_len is None else text[:stop_text_len]

    def _decode_output(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str:
        """Decode output tokens in the context of the prompt's last tokens.

        SentencePiece-style tokenizers drop a word's leading space when it starts the decoded
        text; decoding a few prompt tokens along and cutting their text off keeps it.
        """
        context = list(prompt_ids[-4:])
        prefix = self.decode(context)
        full = self.decode(context + list(output_ids))
        return full[len(prefix) :] if full.startswith(prefix) else self.decode(output_ids)

    def _output(self, req: Request) -> GenerationOutput:
        return GenerationOutput(
            text=self._text(req),
            token_ids=list(req.output_ids),
            prompt_token_ids=list(req.prompt_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else "unknown",
            metrics=req.metrics.snapshot(),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        )


def _is_token(t: object) -> bool:
    """An integer token id: ``int`` or a numpy integer (``numbers.Integral``), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def _as_lists(prompts: object) -> object:
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
        return [_as_lists(p) if isinstance(p, (torch.Tensor, np.ndarray)) else p for p in prompts]
    return prompts


def _normalize_prompts(prompts: object) -> tuple[bool, list[Prompt]]:
    """(is_single, list of prompts); raises TypeError naming ``prompts`` otherwise.

    Token ids may be ints, numpy integers, or integer tensors/arrays.
    """
    if isinstance(prompts, str):
        return True, [prompts]
    prompts = _as_lists(prompts)
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts must not be empty")
        if all(_is_token(t) for t in prompts):
            return True, [[int(t) for t in prompts]]
        if all(isinstance(p, str) for p in prompts):
            return False, list(prompts)
        if all(isinstance(p, (list, tuple)) and all(_is_token(t) for t in p) for p in prompts):
            return False, [[int(t) for t in p] for p in prompts]
    raise TypeError(
        "prompts must be a string, a list of token ids (ints, numpy integers, or a 1-d integer "
        "tensor/array), or a list of either, "
        f"got {type(prompts).__name__}"
    )


def _check_components(
    proposer: object, verifier: object, cache_config: object
) -> None:
    """TypeError/ValueError naming the argument, before anything is built or loaded."""
    if proposer is not None:
        if not isinstance(proposer, Proposer):
            raise TypeError(
                f"proposer must implement specdec.interfaces.Proposer, got {type(proposer).__name__}"
            )
        k = proposer.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"proposer.num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
    if verifier is not None and not isinstance(verifier, Verifier):
        raise TypeError(
            f"verifier must implement specdec.interfaces.Verifier, got {type(verifier).__name__}"
        )
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")


def _check_cuda_graphs(cuda_graphs: object, device: torch.device, parallel: bool) -> None:
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and (device.type != "cuda" or parallel):
        raise ValueError(
            f"cuda_graphs=True needs a CUDA target without tensor parallelism, got device {device}"
            + (" with tensor_parallel_size > 1" if parallel else "")
        )


def _pass_graphs(target: LlamaModel, target_kv, backend: object, num_pages: int, head=None) -> PassGraphs:
    """The target's pass graphs: a FlashInfer graph backend per (bucket, rows), sharing the
    generator's backend's workspace. ``head``: an LM head replacing the model's (a draft's)."""
    from specdec.attention.flashinfer_backend import FlashInferBackend

    if not isinstance(backend, FlashInferBackend):
        raise ValueError(
            "cuda_graphs=True needs the FlashInfer attention backend (pip install 'specdec[gpu]', "
            f"bfloat16 or float16 weights), got {type(backend).__name__}"
        )

    def backend_for(batch: int, rows: int) -> FlashInferBackend:
        return FlashInferBackend(target.device, target.dtype, graph_batch=batch, graph_rows=rows,
                                 max_pages=num_pages, workspace=backend._workspace)  # fmt: skip

    return PassGraphs(target, target_kv, backend_for, CudaCapture(target.device), head=head)


def _draft_graphs(proposer, proposer_kv, backend: object, num_pages: int) -> PassGraphs | None:
    """Graphs of a proposer's own passes over its pool, when it declares them
    (:class:`~specdec.interfaces.CapturesGraphs`: a draft model); others draft eagerly."""
    if not isinstance(proposer, CapturesGraphs) or proposer_kv is None:
        return None
    model, head = proposer.graph_model()
    return _pass_graphs(model, proposer_kv, backend, num_pages, head=head)


def _verifiers(proposer: Proposer | None, verifier: Verifier | None) -> dict[ProposalKind, Verifier]:
    """The verifier of each proposal kind; ``verifier`` replaces the one of the proposer's kind."""
    if proposer is None:
        return {}
    verifiers = default_verifiers()
    if verifier is not None:
        verifiers[proposer.kind] = verifier
    return verifiers


def _resolve_policy(policy: object, proposer: Proposer | None) -> SpeculationPolicy | None:
    """The policy to use (``AdaptivePolicy()`` by default, an int ``k`` as ``FixedPolicy(k)``);
    TypeError/ValueError naming ``policy`` otherwise. ``proposer`` is already checked."""
    if policy is None:
        return None if proposer is None else AdaptivePolicy()
    if proposer is None:
        raise ValueError(
            f"policy={policy!r} needs a proposer: it chooses how many tokens the proposer drafts"
        )
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 0:
            raise ValueError(f"policy as an int is a fixed k and must be >= 0, got {policy}")
        policy = FixedPolicy(policy)
    if not isinstance(policy, SpeculationPolicy):
        raise TypeError(
            "policy must be a SpeculationPolicy (AdaptivePolicy(), FixedPolicy(k)) or an int k, "
            f"got {type(policy).__name__}"
        )
    k = proposer.num_speculative_tokens
    # For a tree, FixedPolicy(n) verifies at most n nodes: the whole tree when n >= its size.
    if isinstance(policy, FixedPolicy) and policy.k > k and proposer.kind is not ProposalKind.TREE:
        raise ValueError(
            f"policy FixedPolicy({policy.k}) drafts more than proposer.num_speculative_tokens ({k})"
        )
    return policy


def _check_tensor_parallel(size: object, quantization: str | None) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if size > 1 and quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} is not supported with tensor_parallel_size > 1 "
            "(quantized weights are not sharded); pass one or the other"
        )


def _check_params(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path) -> object | None:
    """The transformers tokenizer of a model directory or ``.gguf`` file.

    ``None`` for a directory without tokenizer files: such a generator takes token ids only.
    """
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _eos_ids(path: Path, model: LlamaModel, tokenizer: object) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, united."""
    ids = set(model.config.eos_token_ids)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
