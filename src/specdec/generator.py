"""The facade: build a generator from checkpoints or objects, then generate and stream.

Construction and the public API only, each a thin delegation: :mod:`specdec.assembly` checks
the arguments and builds the engine, :mod:`specdec.prompts` turns user input into checked
requests, :mod:`specdec.stepping` steps them for every thread, :mod:`specdec.codec` holds the
tokenizer and :mod:`specdec.output` builds the results.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from specdec.assembly import (
    assemble,
    check_components,
    check_cuda_graphs,
    check_max_model_len,
    check_tensor_parallel,
    resolve_policy,
)
from specdec.attention import default_backend
from specdec.codec import TextCodec, eos_ids, load_tokenizer
from specdec.config import CacheConfig, SamplingParams
from specdec.distributed.follower import Follower
from specdec.distributed.model import TensorParallelLlama, load_tensor_parallel
from specdec.handle import RequestHandle
from specdec.interfaces import AttentionBackend, Proposer, SpeculationPolicy, Verifier
from specdec.metrics import SpecMetrics
from specdec.models.from_transformers import generation_eos_ids, is_transformers_model
from specdec.models.hf_adapter import TransformersAdapter
from specdec.models.llama import LlamaModel
from specdec.models.loading import check_model_impl, load_model, resolve_device
from specdec.models.quantized import check_quantization
from specdec.output import GenerationOutput, output_of
from specdec.prompts import (
    Prompt,
    RequestMaker,
    check_params,
    normalize_prompts,
    params_per_prompt,
    sample_params,
    single_prompt,
)
from specdec.request import Request
from specdec.sampling import make_generator
from specdec.stepping import StepLoop
from specdec.types import StepOutput

__all__ = ["Generator", "GenerationOutput", "load_tokenizer"]


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
        target: LlamaModel | TransformersAdapter,
        tokenizer: object | None = None,
        proposer: Proposer | None = None,
        cache_config: CacheConfig | None = None,
        eos_token_ids: Sequence[int] | None = None,
        backend: AttentionBackend | None = None,
        verifier: Verifier | None = None,
        policy: SpeculationPolicy | int | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if not isinstance(target, (LlamaModel, TransformersAdapter)):
            raise TypeError(
                f"target must be a specdec LlamaModel or TransformersAdapter, got {type(target).__name__}"
            )
        check_components(proposer, verifier, cache_config)
        check_cuda_graphs(cuda_graphs, target.device, isinstance(target, TensorParallelLlama))
        if cuda_graphs and isinstance(target, TransformersAdapter):
            raise ValueError("cuda_graphs=True needs a native family; this target runs on the transformers adapter")
        self.target = target
        self._codec = TextCodec(tokenizer)
        self._follower: Follower | None = None
        self._loop: StepLoop | None = None
        if isinstance(target, TensorParallelLlama) and not target.group.is_leader:
            # Another rank: no scheduler, proposer or sampler; it follows rank 0's steps.
            self.proposer = None
            self._follower = Follower(target, backend or default_backend(target.device, target.dtype))
            self.kv = self._follower.kv
            return
        self.proposer = proposer
        self.cache_config = cache_config or CacheConfig()
        self.max_context = target.config.max_position_embeddings
        self.eos_token_ids = frozenset(
            target.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        )
        parts = assemble(target, proposer=proposer, cache_config=self.cache_config, backend=backend,
                         verifier=verifier, policy=policy, cuda_graphs=cuda_graphs,
                         tokenizer=tokenizer)  # fmt: skip
        self.kv, self.scheduler, self.engine = parts.kv, parts.scheduler, parts.engine
        self.max_seq_slots = parts.max_seq_slots
        self._loop = StepLoop(self.engine, self.scheduler)
        self._requests = RequestMaker(
            vocab_size=target.config.vocab_size,
            max_len=min(self.max_context, parts.capacity),
            length_bound=parts.length_bound,
            eos_token_ids=self.eos_token_ids,
            new_seq_id=self._loop.new_seq_id,
            # Resolved per request, not bound here: tests pin the streams by patching it.
            new_stream=lambda: make_generator(None, target.device),
        )

    # ----------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | torch.nn.Module,
        *,
        proposer: Proposer | None = None,
        tokenizer: object | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        cache_config: CacheConfig | None = None,
        policy: SpeculationPolicy | int | None = None,
        quantization: str | None = None,
        tensor_parallel_size: int = 1,
        backend: AttentionBackend | None = None,
        cuda_graphs: bool = False,
        model_impl: str = "auto",
    ) -> Generator:
        """Load ``target`` (HF directory, ``.gguf`` file, known name or hub id) and its tokenizer.

        ``target`` may also be a transformers model already in memory (``AutoModelForCausalLM``
        of a supported architecture): its weights are copied in ``dtype``, the caller's model is
        left as it was (:mod:`specdec.models.from_transformers`). ``dtype=None``: bfloat16 (a
        model object on the adapter: its own).

        ``model_impl``: ``"auto"`` runs the natively supported families natively and any other
        transformers causal LM on the transformers adapter (:mod:`specdec.models.hf_adapter`:
        exact, slower, a model object used without a copy; :attr:`model_impl` says which);
        ``"native"`` refuses other architectures; ``"transformers"`` takes the adapter for any
        model. ``tokenizer``: the tokenizer
        to use instead of the one found beside the checkpoint (a model object built in memory
        has none; without one the generator takes token ids only).

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
        check_components(proposer, None, cache_config)  # before the (slow) load
        check_max_model_len(cache_config, target)
        if cuda_graphs is not False:  # the device is checked first, as load_model does
            check_cuda_graphs(cuda_graphs, resolve_device(device), tensor_parallel_size > 1)
        check_tensor_parallel(tensor_parallel_size, quantization)
        check_model_impl(model_impl)
        if model_impl == "transformers" and tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs a native family; model_impl='transformers' "
                             "runs the transformers adapter on one device")  # fmt: skip
        in_memory = is_transformers_model(target)
        if in_memory and tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size > 1 needs the target as a checkpoint directory (each rank "
                "reads its own slices), not a model object in memory"
            )
        if tensor_parallel_size == 1 or proposer is not None:  # other ranks ignore the policy
            resolve_policy(policy, proposer)
        check_quantization(quantization, device)
        if tensor_parallel_size > 1:
            model, _, path = load_tensor_parallel(
                target, tensor_parallel_size, dtype=dtype, device=device
            )
        else:
            model, _, path = load_model(
                target, dtype=dtype, device=device, quantization=quantization, model_impl=model_impl
            )
        tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
        eos = eos_ids(path, model, tokenizer) + (generation_eos_ids(target) if in_memory else ())
        return cls(
            target=model,
            tokenizer=tokenizer,
            proposer=proposer,
            cache_config=cache_config,
            eos_token_ids=tuple(sorted(set(eos))),
            policy=policy,
            backend=backend,
            cuda_graphs=cuda_graphs,
        )

    @classmethod
    def from_components(
        cls, target: LlamaModel, tokenizer: object | None = None, **components: object
    ) -> Generator:
        """Build from objects already in memory (tests, notebooks, custom models).

        ``components``: the other keyword arguments of :class:`Generator` (``proposer``,
        ``cache_config``, ``eos_token_ids``, ``verifier``, ``policy``, ``backend``,
        ``cuda_graphs``).

        Example:
            >>> gen = Generator.from_components(model, tok, proposer=PromptLookup(4))
        """
        return cls(target=target, tokenizer=tokenizer, **components)

    def with_proposer(
        self,
        proposer: Proposer | None,
        *,
        cache_config: CacheConfig | None = None,
        policy: SpeculationPolicy | int | None = None,
        backend: AttentionBackend | None = None,
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
        other._codec = self._codec  # one tokenizer, one lock
        return other

    @property
    def tokenizer(self) -> object | None:
        """The tokenizer (``None``: this generator takes and returns token ids only)."""
        return self._codec.tokenizer

    @property
    def model_impl(self) -> str:
        """``"native"``: the target runs on specdec's own decoder; ``"transformers"``: on the
        transformers adapter (the model's own code, slower: :mod:`specdec.models.hf_adapter`)."""
        return "transformers" if isinstance(self.target, TransformersAdapter) else "native"

    # ------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate for one prompt (text or token ids) or a list of them (list in, list out).

        ``params`` is one SamplingParams for all prompts or a list with one per prompt, so
        greedy and sampled requests can share a batch. A prompt whose params have ``n > 1``
        gives the list of its ``n`` samples in its place (sample 0 is the ``n = 1`` output;
        each sample is a request of its own; with prefix caching the others are admitted after
        sample 0's prefill and start on its cached prompt pages).

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
        single, prompt_list = normalize_prompts(prompts)
        per_prompt = params_per_prompt(params, len(prompt_list))
        samples = [sample_params(sp) for sp in per_prompt]  # n > 1: n requests of one prompt
        reqs = []
        for prompt, ss in zip(prompt_list, samples):
            group = [self._request(prompt, s) for s in ss]
            for sample in group[1:]:  # after sample 0's prefill: its pages are cached then
                sample.after_prefill_of = group[0]
            reqs.extend(group)
        self._loop.run(reqs)
        outs = iter([output_of(r, self._codec) for r in reqs])
        # A prompt with n > 1 gives the list of its n samples, else its one output.
        grouped = [[next(outs) for _ in ss] if sp.n > 1 else next(outs) for sp, ss in zip(per_prompt, samples)]
        return grouped[0] if single else grouped

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt's completion as tokens are emitted.

        Bad input raises here, at the call, not at the first ``next()``.
        """
        self._require_leader("stream()")
        return self._stream(self._request(single_prompt(prompt, "stream()"), check_params(params)))

    def _stream(self, req: Request) -> Iterator[str]:
        try:
            self._loop.submit([req])
            yield from RequestHandle(self._loop, self._codec, req)
        finally:
            self._loop.cancel(req)

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
        req = self._request(single_prompt(prompt, "submit()"), check_params(params))
        self._loop.submit([req])
        return RequestHandle(self._loop, self._codec, req)

    def submit_samples(self, prompt: Prompt, params: SamplingParams | None = None) -> list[RequestHandle]:
        """Queue the ``params.n`` samples of one prompt; one handle each, at once.

        Sample ``i`` is :meth:`generate`'s sample ``i`` (sample 0 is :meth:`submit`'s
        request); with prefix caching the others are admitted after sample 0's prefill and
        start on its cached prompt pages. All are validated before any is queued.
        """
        self._require_leader("submit_samples()")
        prompt = single_prompt(prompt, "submit_samples()")
        group = [self._request(prompt, s) for s in sample_params(check_params(params))]
        for sample in group[1:]:
            sample.after_prefill_of = group[0]
        self._loop.submit(group)
        return [RequestHandle(self._loop, self._codec, req) for req in group]

    def step(self) -> StepOutput:
        """Run one engine step over every submitted request.

        Returns the step's :class:`~specdec.types.StepOutput`: ``seq_ids`` (request ids) of
        the batch with the ``new_token_ids`` each got, and ``failed_seq_ids``. An empty
        output means there was nothing to run. From several threads, steps run one after
        another.
        """
        self._require_leader("step()")
        return self._loop.step()

    @property
    def num_steps(self) -> int:
        """Engine steps taken so far (a clock for consumers sharing the engine)."""
        return self._loop.num_steps

    def cancel(self, request_id: int) -> bool:
        """Cancel a submitted request by id; its pages and proposer state are freed at once.

        Returns ``True`` if it was waiting or running, ``False`` if it had already ended.

        Raises:
            KeyError: no request with this id was made by this generator.
        """
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        return self._loop.cancel_id(request_id)

    def _request(self, prompt: Prompt, params: SamplingParams) -> Request:
        return self._requests.make(prompt, params, self._codec)

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

    # ------------------------------------------------------------ inspection
    @property
    def metrics(self) -> SpecMetrics:
        """Totals over every request this generator has run (a snapshot: read it again
        for later totals)."""
        self._require_leader("metrics")
        with self._loop.lock:
            return self.engine.metrics.snapshot()

    @property
    def policy(self) -> SpeculationPolicy | None:
        """The speculation policy (``None`` without a proposer)."""
        self._require_leader("policy")
        return self.engine.policy

    @property
    def max_sequence_len(self) -> int:
        """Prompt + output tokens one request may reach: the target's context, or
        ``CacheConfig.max_model_len`` when given, or fewer when the page pool holds fewer for
        one sequence. A longer request is a ValueError at submission (never cut short)."""
        return self._requests.max_len

    def queue_stats(self) -> dict[str, int]:
        """``num_waiting`` and ``num_running`` requests, ``num_preemptions`` so far."""
        self._require_leader("queue_stats()")
        with self._loop.lock:
            return {
                "num_waiting": len(self.scheduler.waiting) + self._loop.num_queued,
                "num_running": len(self.scheduler.running),
                "num_preemptions": self.scheduler.num_preemptions,
            }

    def kv_stats(self) -> dict[str, int]:
        """``num_free_pages``, ``num_total_pages`` and more, from the one page allocator."""
        if self._loop is None:  # another rank's pages change only inside its own follow()
            return self.kv.stats()
        with self._loop.lock:
            return self.kv.stats()

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``; ValueError without a tokenizer."""
        return self._codec.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens skipped); ``""`` without a tokenizer."""
        return self._codec.decode(token_ids)
