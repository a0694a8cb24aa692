"""What each named system builds: the SYSTEMS table, one row a system.

A :class:`System` is a name, a builder and how the grid treats it (once per k or once; batch
limits; which plain decoder its greedy output must equal). Every builder has one signature,
``build(pool, k) -> Runner`` (:class:`SystemBuilder`), and is built once per grid point.

specdec systems are all one builder, :class:`SpecdecBuild`: a proposer factory
``proposer(pool, k) -> Proposer`` (``None``: plain decoding), the target's weight format and
the policy (a fixed k, or the default adaptive policy with k as its ceiling). A new proposer
is a new factory and a new row, nothing else: a proposer registry entry
(``specdec.proposers.registry``) fits as the factory
``lambda pool, k: registry.build(name, {**options, "num_speculative_tokens": k}, context)``,
and that is how :func:`all_systems` adds a row ``specdec-<name>`` for every proposer an
installed package registers (options from ``--proposer-option KEY=VALUE``). The built-in rows'
factories take the pool's already loaded models instead, so that systems sharing a draft model
load it once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs

from benchmarks.harness.runners import HFRunner, LlamaCppRunner, Runner, SpecdecRunner

if TYPE_CHECKING:
    from benchmarks.harness.config import HarnessConfig
    from benchmarks.harness.pool import ModelPool
    from specdec.interfaces import Proposer

REFERENCE = "specdec-plain"
HF_REFERENCE = "hf-plain"


class SystemBuilder(Protocol):
    """Builds a system's runner for the grid's ``k`` (``None`` for plain systems)."""

    def __call__(self, pool: ModelPool, k: int | None) -> Runner: ...


ProposerFactory = Callable[["ModelPool", int], "Proposer"]


@attrs.frozen(kw_only=True)
class System:
    """One benchmarked system. ``speculative`` systems run once per k; ``twin`` names the
    transformers system doing the same thing (for the specdec / transformers ratio); ``plain``
    is the plain decoder of the same stack (same kernels, so greedy output must match it even
    where bf16 rounding makes the two stacks differ)."""

    name: str
    build: SystemBuilder
    speculative: bool
    plain: str
    twin: str | None = None
    max_batch_size: int | None = None  # transformers assisted generation is batch-1 only
    largest_k_only: bool = False  # an adaptive policy: the grid's largest k is its upper bound


def grid_ks(system: System, ks: tuple[int, ...]) -> tuple[int | None, ...]:
    """The k values the grid runs ``system`` at, out of the grid's ``ks``."""
    if not system.speculative:
        return (None,)
    return (max(ks),) if system.largest_k_only else ks


@attrs.frozen(kw_only=True)
class SpecdecBuild:
    """A specdec Generator on the pool's shared target (stored with ``quantization``) with the
    proposer ``proposer(pool, k)`` makes (``None``: plain decoding) and its own KV cache.

    The grid's k is a fixed k (FixedPolicy): the harness compares speculation at a known k with
    transformers' at the same k. ``adaptive`` lets the default AdaptivePolicy choose up to k
    instead, with a fresh generator and proposer every repeat: it learns its costs from that
    repeat's first prompt on (the warm-up does not teach it).
    """

    proposer: ProposerFactory | None = None
    quantization: str | None = None
    adaptive: bool = False

    def __call__(self, pool: ModelPool, k: int | None) -> SpecdecRunner:
        from specdec import FixedPolicy

        def build():
            if self.proposer is None:
                return pool.specdec_generator(None, quantization=self.quantization)
            return pool.specdec_generator(
                self.proposer(pool, k),
                policy=None if self.adaptive else FixedPolicy(k),
                quantization=self.quantization,
            )

        return SpecdecRunner(build(), fresh=build if self.adaptive else None)


# ----------------------------------------------------------------------------- proposers


def _draft(
    pool: ModelPool,
    k: int,
    *,
    quantization: str | None = None,
    unquantized: bool = False,
    confident: bool = False,
    vocab: bool = False,
) -> Proposer:
    """The draft model, stored as ``quantization`` (a quantized target's own format: what a
    user of that format would run), else as --draft-quantization unless ``unquantized``;
    ``confident``: chains end below --draft-confidence (k is a ceiling); ``vocab``: it drafts
    from --draft-vocab tokens only."""
    from specdec.proposers import DraftModel

    if quantization is None and not unquantized:
        quantization = pool.config.draft_quantization
    return DraftModel.from_model(
        pool.draft_model(quantization),
        num_speculative_tokens=k,
        confidence_threshold=pool.config.draft_confidence if confident else 0.0,
        draft_vocab=pool.draft_vocab if vocab else None,
    )


def _lookup(pool: ModelPool, k: int) -> Proposer:
    from specdec.proposers import PromptLookup

    return PromptLookup(num_speculative_tokens=k)


def _mtp(pool: ModelPool, k: int, *, confident: bool = False) -> Proposer:
    from specdec.proposers import MTPHead

    cfg = pool.config
    if cfg.mtp_head is None:
        raise ValueError("specdec-mtp needs --mtp-head DIR (a head trained for --target)")
    return MTPHead.from_pretrained(
        cfg.mtp_head,
        num_speculative_tokens=k,
        draft_vocab_size=cfg.mtp_draft_vocab,
        quantization=cfg.head_quantization,
        confidence_threshold=cfg.draft_confidence if confident else 0.0,
    )


def _eagle(pool: ModelPool, k: int, *, tree: bool = False, confident: bool = False) -> Proposer:
    """EAGLE's dynamic tree (``tree``) or a chain of k drafts, each the best child of the
    previous one (a static tree); ``confident``: only nodes of path probability at least
    --tree-min-prob are verified (the best node always)."""
    from specdec.proposers import EAGLETree
    from specdec.proposers.tree_shape import TreeShape
    from specdec.training.eagle import chain_tree

    cfg = pool.config
    if cfg.eagle_head is None:
        raise ValueError("specdec-eagle systems need --eagle-head DIR (a head trained for --target)")
    # The dynamic tree grows --tree-top-k children per node to --tree-depth and the k best
    # nodes are verified (EAGLE-2: a tree smaller than its expansions keeps the best of them).
    return EAGLETree.from_pretrained(
        cfg.eagle_head,
        None if tree else chain_tree(k),
        top_k=cfg.tree_top_k,
        depth=cfg.tree_depth,
        num_verify_tokens=max(k, TreeShape.min_verify_tokens(cfg.tree_top_k, cfg.tree_depth)),
        quantization=cfg.head_quantization,
        min_path_prob=cfg.tree_min_prob if confident else 0.0,
    )


def _registered(entry: str, pool: ModelPool, k: int) -> Proposer:
    """A proposer of the registry by its entry's name, with the --proposer-option values that
    entry takes."""
    from specdec.proposers.registry import BuildContext, load_registry

    registry = load_registry()
    takes = {o.name for o in registry.entry(entry).options}
    options = {key: v for key, v in pool.config.proposer_options.items() if key in takes}
    context = BuildContext(target=pool.config.target, dtype=pool.config.dtype)
    return registry.build(entry, {**options, "num_speculative_tokens": k}, context)


# ----------------------------------------------------------------------------- other stacks


def _llamacpp_plain(pool: ModelPool, k: int | None) -> LlamaCppRunner:
    return LlamaCppRunner(pool.llamacpp_model())


def _llamacpp_lookup(pool: ModelPool, k: int | None) -> LlamaCppRunner:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaCppRunner(pool.llamacpp_model(LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=3)))


def _hf(pool: ModelPool, extra: dict, prepare: Callable[[], None] | None = None) -> HFRunner:
    return HFRunner(pool.hf_target, pool.hf_counter, pool.pad_token_id, extra, prepare)


def _hf_plain(pool: ModelPool, k: int | None) -> HFRunner:
    return _hf(pool, {})


def _hf_assisted(pool: ModelPool, k: int | None) -> HFRunner:
    draft = pool.hf_draft

    def prepare() -> None:
        # transformers 5.x reads these from the *assistant's* generation_config (passing them
        # to generate() sets the target's config and has no effect). A constant schedule and a
        # zero confidence threshold (no early stop, no ROC threshold tuning) make every step
        # draft exactly k tokens, the same k specdec-draft uses.
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0

    return _hf(pool, {"assistant_model": draft}, prepare)


def _hf_lookup(pool: ModelPool, k: int | None) -> HFRunner:
    return _hf(pool, {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3})


# ----------------------------------------------------------------------------- the table


def _specdec(
    name: str,
    proposer: ProposerFactory | None = None,
    *,
    quantization: str | None = None,
    adaptive: bool = False,
    twin: str | None = None,
) -> System:
    """A specdec row; a quantized target is another model, judged against its own plain."""
    return System(
        name=name,
        build=SpecdecBuild(proposer=proposer, quantization=quantization, adaptive=adaptive),
        speculative=proposer is not None,
        plain=f"specdec-{quantization}-plain" if quantization else REFERENCE,
        twin=twin,
        largest_k_only=adaptive,
    )


def _quantized_systems(quantization: str) -> tuple[System, ...]:
    """A target stored with ``quantization``: plain, and with a draft stored the same way."""
    prefix = f"specdec-{quantization}"
    draft = functools.partial(_draft, quantization=quantization)
    confident = functools.partial(draft, confident=True)
    return (
        _specdec(f"{prefix}-plain", quantization=quantization),
        _specdec(f"{prefix}-draft", draft, quantization=quantization),
        _specdec(f"{prefix}-draft-adaptive", draft, quantization=quantization, adaptive=True),
        _specdec(f"{prefix}-draft-confident", confident, quantization=quantization),
        _specdec(f"{prefix}-draft-confident-vocab", functools.partial(confident, vocab=True),
                 quantization=quantization),  # fmt: skip
        _specdec(f"{prefix}-draft-adaptive-confident", confident, quantization=quantization,
                 adaptive=True),  # fmt: skip
    )


SYSTEMS = {
    s.name: s
    for s in (
        _specdec(REFERENCE, twin=HF_REFERENCE),
        _specdec("specdec-draft", _draft, twin="hf-assisted"),
        _specdec("specdec-draft-vocab", functools.partial(_draft, vocab=True)),
        # The draft's weights in --dtype even when --draft-quantization is set.
        _specdec("specdec-draft-unquantized", functools.partial(_draft, unquantized=True)),
        _specdec("specdec-draft-adaptive", _draft, adaptive=True),
        _specdec("specdec-lookup", _lookup, twin="hf-lookup"),
        _specdec("specdec-mtp", _mtp),
        _specdec("specdec-mtp-confident", functools.partial(_mtp, confident=True)),
        _specdec("specdec-eagle", _eagle),
        _specdec("specdec-eagle-tree", functools.partial(_eagle, tree=True)),
        _specdec("specdec-eagle-tree-confident", functools.partial(_eagle, tree=True, confident=True)),
        _specdec("specdec-eagle-adaptive", functools.partial(_eagle, tree=True), adaptive=True),
        *_quantized_systems("int8"),
        *_quantized_systems("q4"),
        # llama.cpp and transformers: their speculation (and llama.cpp at all) runs batch 1 only.
        System(name="llamacpp-plain", build=_llamacpp_plain, speculative=False,
               plain="llamacpp-plain", max_batch_size=1),  # fmt: skip
        System(name="llamacpp-lookup", build=_llamacpp_lookup, speculative=True,
               plain="llamacpp-plain", max_batch_size=1),  # fmt: skip
        System(name=HF_REFERENCE, build=_hf_plain, speculative=False, plain=HF_REFERENCE),
        System(name="hf-assisted", build=_hf_assisted, speculative=True, plain=HF_REFERENCE,
               max_batch_size=1),  # fmt: skip
        System(name="hf-lookup", build=_hf_lookup, speculative=True, plain=HF_REFERENCE,
               max_batch_size=1),  # fmt: skip
    )
}


def all_systems() -> dict[str, System]:
    """:data:`SYSTEMS` and a row ``specdec-<name>`` (fixed k) for every proposer that an
    installed package registers through the ``specdec.proposers`` entry point: a plug-in is
    benchmarked without a file of the harness edited. Read anew at each call."""
    from specdec.proposers.registry import builtin_entries, load_registry

    builtin = {e.name for e in builtin_entries()}
    plugins = {}
    for entry in load_registry().entries:
        name = f"specdec-{entry.name}"
        if entry.name in builtin:
            continue
        if name in SYSTEMS:
            raise ValueError(f"proposer plug-in {entry.origin} would be harness system {name!r}, "
                             "which the harness already has; rename the entry")  # fmt: skip
        plugins[name] = _specdec(name, functools.partial(_registered, entry.name))
    return {**SYSTEMS, **plugins}


def check_systems(cfg: HarnessConfig) -> None:
    """``cfg``'s systems, per-system k lists and plug-in options name what exists (the
    plug-ins installed now included); ``ValueError`` naming the flag otherwise."""
    systems = all_systems()
    unknown = set(cfg.systems) - set(systems)
    if unknown:
        raise ValueError(f"--systems: unknown {sorted(unknown)}; choose from {list(systems)}")
    for name, ks in cfg.system_ks.items():
        if name not in systems or not systems[name].speculative:
            speculative = [n for n, s in systems.items() if s.speculative]
            raise ValueError(f"--system-ks: {name!r} is not one of {speculative}")
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"--system-ks: {name} needs integers >= 1, got {ks}")
    _check_proposer_options(cfg.proposer_options)


def _check_proposer_options(options: dict[str, str]) -> None:
    from specdec.proposers.registry import load_registry

    known = {o.name for e in load_registry().entries for o in e.options}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"--proposer-option: no registered proposer takes {unknown[0]!r}; "
                         f"options: {', '.join(sorted(known))}")  # fmt: skip
