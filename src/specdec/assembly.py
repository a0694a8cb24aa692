"""Engine assembly: the argument checks, then the KV cache, scheduler, verifiers, policy and
CUDA graphs a generator's engine runs on.

The checks run before anything is built or loaded (``Generator.from_pretrained`` calls them
ahead of the slow load) and raise a ``TypeError``/``ValueError`` naming the argument.
"""

from __future__ import annotations

import attrs
import torch

from specdec.attention import default_backend
from specdec.config import MAX_SPECULATIVE_TOKENS, CacheConfig, check_arg, speculative_tokens
from specdec.distributed.journal import JournaledKVCacheManager
from specdec.distributed.model import TensorParallelLlama
from specdec.engine import Engine
from specdec.graphs import CudaCapture, PassGraphs
from specdec.interfaces import (
    AttentionBackend,
    CapturesGraphs,
    Proposer,
    SharesCachedPrefix,
    SpeculationPolicy,
    UsesTargetTokenizer,
    Verifier,
)
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager, ModelKV
from specdec.kv.prefix_cache import PrefixCache
from specdec.kv.sizing import check_pool_fits, length_bound, model_len, pool_pages
from specdec.models.llama import LlamaModel
from specdec.models.loading import local_context
from specdec.policy import AdaptivePolicy, FixedPolicy
from specdec.sampling import TorchSampler
from specdec.scheduler import BatchScheduler
from specdec.types import ProposalKind
from specdec.verify.kinds import default_verifiers

__all__ = [
    "Assembly",
    "assemble",
    "check_components",
    "check_cuda_graphs",
    "check_max_model_len",
    "check_tensor_parallel",
    "resolve_policy",
]


@attrs.frozen(eq=False)
class Assembly:
    """A generator's engine and what it runs on."""

    kv: KVCacheManager  # the one page allocator and every model's page pool
    scheduler: BatchScheduler
    engine: Engine
    max_seq_slots: int  # KV slots one sequence may hold: its tokens plus the k + 1 verify slots
    max_model_len: int  # CacheConfig.max_model_len, or the target's context
    max_context: int  # the target's max_position_embeddings
    cache_config: CacheConfig
    context_field: str = "max_position_embeddings"  # the config field that sets max_context

    @property
    def capacity(self) -> int:
        """Tokens one sequence may reach: its slots, within both the per-sequence limit and
        the whole page pool, less the k + 1 slots a verify step needs."""
        slots = min(self.max_seq_slots, self.kv.allocator.num_total_pages * self.kv.page_size)
        return slots - self.engine.num_speculative_tokens - 1

    @property
    def length_bound(self) -> str:
        """What holds a request to :attr:`capacity` tokens, and how to raise it."""
        return length_bound(max_len=self.max_model_len, capacity=self.capacity,
                            max_context=self.max_context, cache_config=self.cache_config,
                            context_field=self.context_field)  # fmt: skip


def assemble(
    target: LlamaModel,
    *,
    proposer: Proposer | None,
    cache_config: CacheConfig,
    backend: AttentionBackend | None,
    verifier: Verifier | None,
    policy: SpeculationPolicy | int | None,
    cuda_graphs: bool,
    tokenizer: object | None = None,
) -> Assembly:
    """Build the engine of ``target`` and ``proposer`` (arguments already checked by
    :func:`check_components` and :func:`check_cuda_graphs`). ``tokenizer``: the target's
    (``None``: none), for a proposer of its own vocabulary to check against (a draft model,
    :class:`~specdec.interfaces.UsesTargetTokenizer`).

    One request may reach ``cache_config.max_model_len`` tokens (default: the target's
    context); the page pool all requests share is sized by :func:`specdec.kv.sizing.pool_pages`.
    """
    max_context = target.config.max_position_embeddings
    field = target.config.context_field  # what sets max_context (Phi-3's longrope: not itself)
    max_len = model_len(cache_config, max_context, field)  # before any proposer is bound
    policy = resolve_policy(policy, proposer)
    if isinstance(proposer, UsesTargetTokenizer):  # before attach, which checks the vocabulary
        proposer.set_target_tokenizer(tokenizer)
    attach = getattr(proposer, "attach", None)
    if attach is not None:  # binds proposers built on the target (MTP/EAGLE heads); checks
        attach(target)  # that a draft model fits it, before any page is allocated
    k = proposer.num_speculative_tokens if proposer is not None else 0
    max_seq_slots = max_len + k + 1
    num_pages = pool_pages(cache_config, max_len=max_len, k=k)
    kv, target_kv, proposer_kv = _kv_cache(target, proposer, cache_config, num_pages, max_len)
    scheduler = BatchScheduler(
        kv,
        max_batch_size=cache_config.max_batch_size,
        max_prefill_tokens=max(8192, cache_config.page_size),
    )
    backend = backend or default_backend(target.device, target.dtype)
    engine = Engine(
        target=target,
        target_kv=target_kv,
        backend=backend,
        scheduler=scheduler,
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
    if isinstance(target, TensorParallelLlama):
        target.bind(kv)  # the other ranks build the same pages
    return Assembly(kv=kv, scheduler=scheduler, engine=engine, max_seq_slots=max_seq_slots,
                    max_model_len=max_len, max_context=max_context, cache_config=cache_config,
                    context_field=field)  # fmt: skip


def _kv_cache(
    target: LlamaModel, proposer: Proposer | None, cache_config: CacheConfig, num_pages: int, max_len: int
) -> tuple[KVCacheManager, ModelKV, ModelKV | None]:
    """The page allocator with the target's pool and the proposer's (if it declares one),
    once both are known to fit in the device's free memory."""
    manager = JournaledKVCacheManager if isinstance(target, TensorParallelLlama) else KVCacheManager
    specs = proposer.kv_specs() if proposer is not None else []
    if len(specs) > 1:
        raise ValueError("a proposer may declare at most one KV pool")
    check_pool_fits([target.kv_spec("target"), *specs], num_pages=num_pages,
                    page_size=cache_config.page_size, max_len=max_len, device=target.device)  # fmt: skip
    cache = _prefix_cache(proposer if specs else None, cache_config)
    kv = manager(PageAllocator(num_pages), cache_config.page_size, prefix_cache=cache)
    target_kv = kv.add_pool(target.kv_spec("target"), target.device)
    proposer_kv = kv.add_pool(specs[0], target.device) if specs else None
    return kv, target_kv, proposer_kv


def _prefix_cache(pool_owner: Proposer | None, cache_config: CacheConfig) -> PrefixCache | None:
    """The prefix cache, unless switched off or a proposer's pool could not share it.

    ``pool_owner``: the proposer when it has a KV pool. Its KV of a cached page must be final
    too, which only a :class:`~specdec.interfaces.SharesCachedPrefix` proposer reports.
    """
    if not cache_config.prefix_caching:
        return None
    if pool_owner is None:
        return PrefixCache(cache_config.page_size)
    if not isinstance(pool_owner, SharesCachedPrefix):
        return None  # a plug-in's pool of unknown validity: no sharing rather than wrong KV
    return PrefixCache(
        cache_config.page_size,
        lookahead=pool_owner.kv_lookahead,
        partial=getattr(pool_owner, "catches_up_from_tokens", False) is True,
    )


def _pass_graphs(
    target: LlamaModel,
    target_kv: ModelKV,
    backend: AttentionBackend,
    num_pages: int,
    head: torch.nn.Module | None = None,
) -> PassGraphs:
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


def _draft_graphs(
    proposer: Proposer | None,
    proposer_kv: ModelKV | None,
    backend: AttentionBackend,
    num_pages: int,
) -> PassGraphs | None:
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


def resolve_policy(policy: object, proposer: Proposer | None) -> SpeculationPolicy | None:
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


def check_components(proposer: object, verifier: object, cache_config: object) -> None:
    """TypeError/ValueError naming the argument, before anything is built or loaded."""
    if proposer is not None:
        if not isinstance(proposer, Proposer):
            raise TypeError(
                f"proposer must implement specdec.interfaces.Proposer, got {type(proposer).__name__}"
            )
        _check_width(proposer.num_speculative_tokens)
    if verifier is not None and not isinstance(verifier, Verifier):
        raise TypeError(
            f"verifier must implement specdec.interfaces.Verifier, got {type(verifier).__name__}"
        )
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")


def check_max_model_len(cache_config: CacheConfig | None, source: object) -> None:
    """``cache_config.max_model_len`` within the context of ``source`` when that is a model
    directory on disk, read from its config.json before the (slow) load; other sources are
    checked once loaded, when the generator is built."""
    if cache_config is None or cache_config.sequence_limit is None:
        return
    context = local_context(source)
    if context is not None:
        model_len(cache_config, context)


def _check_width(k: object) -> None:
    """The shared bound on a plug-in proposer's width (config.speculative_tokens)."""
    name = "proposer.num_speculative_tokens"
    try:
        check_arg(speculative_tokens, name, k)
    except TypeError:
        # A width that is no int is out of the range too: one ValueError, showing the value.
        raise ValueError(f"{name} must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}") from None


def check_cuda_graphs(cuda_graphs: object, device: torch.device, parallel: bool) -> None:
    """``cuda_graphs`` a bool, and True only for a CUDA target without tensor parallelism."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and (device.type != "cuda" or parallel):
        raise ValueError(
            f"cuda_graphs=True needs a CUDA target without tensor parallelism, got device {device}"
            + (" with tensor_parallel_size > 1" if parallel else "")
        )


def check_tensor_parallel(size: object, quantization: str | None) -> None:
    """``tensor_parallel_size`` an int >= 1, and > 1 only without quantization."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
    if size > 1 and quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} is not supported with tensor_parallel_size > 1 "
            "(quantized weights are not sharded); pass one or the other"
        )
