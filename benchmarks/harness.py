"""The benchmark harness: specdec and transformers, plain and speculative, side by side.

One entry point runs a grid of systems x prompt sets x k x temperature x batch size, with a
warm-up and repeats. Inside every repeat the systems take turns on each prompt batch (and the
turn order rotates from repeat to repeat), so machine drift hits all of them alike. Every
system generates exactly ``--max-new-tokens`` tokens from the same prompt token ids; greedy
outputs are checked token for token against specdec-plain (``matches_plain``).

    python -m benchmarks.harness                                  # the README table
    python -m benchmarks.harness --preset cpu                     # the CPU speed table (issue 12)
    python -m benchmarks.harness --preset quant                   # bf16 / int8 / 4-bit targets (issue 17)
    python -m benchmarks.harness --systems specdec-plain,specdec-draft --k 2,4,8 --num-prompts 5
    python -m benchmarks.plots benchmarks/results/harness-latest.json   # re-plot a result

Systems:
    specdec-plain   Generator without a proposer (the baseline every ratio refers to)
    specdec-draft   Generator + DraftModel(draft, k)
    specdec-draft-vocab  the same drafting from --draft-vocab tokens only (the most frequent in
                    Python's standard library sources): a cheaper LM head, the same output
    specdec-draft-unquantized  the same with the draft's weights in --dtype even when
                    --draft-quantization is set (int8 against bf16 drafting in one run)
    specdec-draft-adaptive  the same with the default AdaptivePolicy (k at most the grid's k),
                    a fresh Generator at the start of every repeat: it learns its costs
                    from that repeat's first prompt on (the warm-up does not teach it)
    specdec-lookup  Generator + PromptLookup(k)                  (max_ngram 3)
    specdec-mtp     Generator + MTPHead(--mtp-head, k)           (a head trained for --target)
    specdec-mtp-confident  the same, k a ceiling: a chain ends after a draft of head
                    probability below --draft-confidence
    specdec-eagle   Generator + EAGLETree(--eagle-head) as a chain of k drafts
    specdec-eagle-tree  the same with EAGLE-2's dynamic tree (--tree-top-k, --tree-depth), the
                    k best nodes verified every step (k = tree size)
    specdec-eagle-tree-confident  the dynamic tree, k a ceiling: only nodes whose path
                    probability under the head reaches --tree-min-prob (the best node always)
    specdec-eagle-adaptive  the dynamic tree under the default AdaptivePolicy (at most k nodes),
                    a fresh Generator at the start of every repeat
    specdec-int8-plain, specdec-q4-plain  the target's linear layers stored as int8 / 4-bit
                    (another model: its greedy output is checked against its own plain decoder)
    specdec-int8-draft, specdec-q4-draft  the same target with a draft model stored in the
                    same format, fixed k; ``-draft-adaptive``: the default AdaptivePolicy;
                    ``-draft-confident``: fixed k as a ceiling, each chain ending after a draft
                    token of draft probability below --draft-confidence; ``-draft-adaptive-
                    confident``: both; ``-draft-confident-vocab``: confident, from --draft-vocab
                    tokens only
    llamacpp-plain  llama.cpp through llama-cpp-python on --llamacpp-target (a GGUF file, e.g.
                    the Q4_K_M the known models come from), batch 1, greedy; its own stack
    llamacpp-lookup the same with llama-cpp-python's speculation (LlamaPromptLookupDecoding,
                    k tokens, max_ngram 3; its only proposer: it has no draft-model path)
    hf-plain        transformers ``model.generate``
    hf-assisted     ``generate(assistant_model=draft)``, exactly k drafted tokens per step
    hf-lookup       ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)``

Per thread count (``--threads 1,2``) the run also measures the memory read bandwidth (before
and after, the better of the two) and states the plain decoding bound: a batch-1 decode step
reads every target weight once, so ``bandwidth / weight bytes`` steps per second at most.
specdec-plain's decode rate (its time less a separately timed 1-token run of the same prompts,
i.e. without the prefill) is reported as a fraction of that bound, and as a fraction of the
bound at the bandwidth probed right before and after each of its runs (the better probe), which
the machine's drift over a long run does not skew.

Output: ``<out-dir>/<out>-<stamp>.json`` (+ ``<out>-latest.json``), three PNG plots next to
it, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from benchmarks.common import (
    PROSE_PROMPTS,
    RESULTS,
    hf_model_ignoring_eos,
    humaneval_prompts,
    machine_info,
    write_json,
)

# ----------------------------------------------------------------------------- prompt sets


@attrs.frozen
class PromptSet:
    """A named list of prompts; ``chat`` ones go through the target's chat template."""

    name: str
    id_prefix: str
    load: Callable[[int | None], list[str]]
    chat: bool


PROMPT_SETS = {
    s.name: s
    for s in (
        PromptSet("humaneval", "HumanEval/", humaneval_prompts, chat=False),
        PromptSet(
            "prose", "prose/", lambda n: PROSE_PROMPTS[:n] if n else list(PROSE_PROMPTS), chat=True
        ),
    )
}


@attrs.frozen
class Prompt:
    prompt_set: str
    prompt_id: str
    token_ids: tuple[int, ...]


def tokenize_prompts(tokenizer, prompt_set: PromptSet, n: int | None) -> list[Prompt]:
    """Token ids of the set's first ``n`` prompts, by the target tokenizer, computed once.

    Completion prompts (HumanEval) are encoded raw; chat prompts get the chat template with the
    generation prompt (or stay raw when the tokenizer has no template, e.g. stories260K).
    """
    out = []
    for i, text in enumerate(prompt_set.load(n)):
        if prompt_set.chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        out.append(Prompt(prompt_set.name, f"{prompt_set.id_prefix}{i}", tuple(ids)))
    return out


# ----------------------------------------------------------------------------- one run


@attrs.frozen(kw_only=True)
class RunStats:
    """What one ``generate`` call over a prompt batch did.

    ``num_verify_steps``/``num_drafted``/``num_accepted`` are zero for plain decoding; the
    per-position lists are specdec's (``None`` for transformers, which does not expose them).
    """

    outputs: list[list[int]]  # one list of new token ids per prompt
    target_forwards: int
    num_verify_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted_in_verify: int = 0
    accepted_per_position: list[int] | None = None
    drafted_per_position: list[int] | None = None
    k_histogram: dict[int, int] | None = None  # decode steps per k the policy chose (specdec)


class SpecdecRunner:
    """Runs one specdec Generator (its own KV cache, a shared target model). With ``fresh``
    (a function building the generator), every repeat starts from a new one."""

    def __init__(self, gen, fresh: Callable[[], object] | None = None) -> None:
        self.gen = gen
        self.fresh = fresh

    def start_repeat(self) -> None:
        if self.fresh is not None:
            self.gen = self.fresh()

    def run(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int
    ) -> RunStats:
        from specdec import SamplingParams, SpecMetrics

        params = [
            SamplingParams(
                max_new_tokens=n, temperature=temperature, seed=seed + i, ignore_eos=True
            )
            for i in range(len(prompts))
        ]
        forwards_before = self.gen.metrics.num_target_forwards
        outs = self.gen.generate([list(p) for p in prompts], params)
        # Per-request metrics add up exactly for acceptance; the target forward count is shared
        # by the batch, so it comes from the generator's running total.
        total = SpecMetrics()
        for out in outs:
            total.merge(out.metrics)
        return RunStats(
            outputs=[list(o.token_ids) for o in outs],
            target_forwards=self.gen.metrics.num_target_forwards - forwards_before,
            num_verify_steps=total.num_verify_steps,
            num_drafted=total.num_drafted,
            num_accepted=total.num_accepted,
            num_emitted_in_verify=total.num_emitted_in_verify,
            accepted_per_position=list(total.accepted_per_position),
            drafted_per_position=list(total.drafted_per_position),
            k_histogram=dict(sorted(total.k_histogram.items())),
        )


class ForwardCounter:
    """A forward pre-hook on the transformers target: how many calls, how many query tokens."""

    def __init__(self, model) -> None:
        self.calls = 0
        self.query_tokens = 0
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.query_tokens += int(ids.shape[1]) if ids is not None else 0

    def reset(self) -> None:
        self.calls = self.query_tokens = 0


class HFRunner:
    """Runs ``model.generate`` with fixed extra kwargs; ``prepare`` runs before each call."""

    def __init__(
        self, pool: ModelPool, extra: dict, prepare: Callable[[], None] | None = None
    ) -> None:
        self.model = pool.hf_target
        self.counter = pool.hf_counter
        self.pad_id = pool.pad_token_id
        self.extra = extra
        self.prepare = prepare

    def start_repeat(self) -> None:
        """Nothing carries over between calls."""

    def run(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int
    ) -> RunStats:
        width = max(len(p) for p in prompts)
        # Left padding, so every row's new tokens start at column ``width``.
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sampling = (
            dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            if temperature > 0
            else dict(do_sample=False)
        )
        if self.prepare is not None:
            self.prepare()
        torch.manual_seed(seed)
        self.counter.reset()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                pad_token_id=self.pad_id,
                repetition_penalty=1.0,
                **sampling,
                **self.extra,
            )
        outputs = out[:, width:].tolist()
        forwards = self.counter.calls
        if not self.extra:
            return RunStats(outputs=outputs, target_forwards=forwards)
        # Assisted decoding (batch 1) feeds the target the prompt, every drafted token once, and
        # each step's bonus/recovered token at the start of the next step; every forward is a
        # verification step that emits accepted + 1 tokens.
        new = len(outputs[0])
        drafted = self.counter.query_tokens - len(prompts[0]) - (forwards - 1)
        return RunStats(
            outputs=outputs,
            target_forwards=forwards,
            num_verify_steps=forwards,
            num_drafted=drafted,
            num_accepted=new - forwards,
            num_emitted_in_verify=new,
        )


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python, an optional peer) on a GGUF file of the target, batch 1,
    greedy: the same prompt token ids (Qwen's GGUF keeps the HF vocabulary), exactly ``n`` new
    tokens (``Llama.generate`` does not stop at EOS), as many threads as the grid point. With a
    draft model attached to ``llm`` (llama-cpp-python's prompt lookup) it speculates: target
    forwards are counted as its ``eval`` calls after the prompt's."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def start_repeat(self) -> None:
        """Nothing carries over between calls (the context is reset per prompt)."""

    def run(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int
    ) -> RunStats:
        import llama_cpp

        if len(prompts) != 1 or temperature != 0:
            raise ValueError("llamacpp systems run batch 1, greedy")
        threads = torch.get_num_threads()
        llama_cpp.llama_set_n_threads(self.llm.ctx, threads, threads)
        calls = 0
        evaluate = type(self.llm).eval.__get__(self.llm)

        def counted(tokens):
            nonlocal calls
            calls += 1
            return evaluate(tokens)

        self.llm.eval = counted  # the instance's own attribute: counts this run's forwards
        out: list[int] = []
        try:
            for token in self.llm.generate(list(prompts[0]), top_k=1, top_p=1.0, temp=0.0,
                                           repeat_penalty=1.0, reset=True):  # fmt: skip
                out.append(int(token))
                if len(out) == n:
                    break
        finally:
            del self.llm.eval
        if self.llm.draft_model is None:
            return RunStats(outputs=[out], target_forwards=n)
        forwards = max(calls - 1, 0) + 1  # the prompt's pass yields the first token
        return RunStats(outputs=[out], target_forwards=forwards, num_verify_steps=forwards - 1,
                        num_emitted_in_verify=n - 1)  # fmt: skip


# ----------------------------------------------------------------------------- models


class ModelPool:
    """Every model loaded at most once per process, on first use.

    specdec and transformers hold separate copies (bf16 1.5B ~3.6 GB, 0.5B ~1.3 GB each).
    All specdec generators share one target ``LlamaModel``; each has its own KV cache sized by
    ``cache_config``.
    """

    def __init__(
        self, target: Path, draft: Path, dtype: str, cache_config, tokenizer, mtp_head: Path | None = None
    ) -> None:
        self.target_path = target
        self.draft_path = draft
        self.mtp_head = mtp_head
        self.mtp_draft_vocab: int | None = None
        self.eagle_head: Path | None = None
        self.head_quantization: str | None = None  # MTP / EAGLE heads' linear layers
        self.llamacpp_target: Path | None = None
        self.tree_top_k = 4
        self.tree_depth = 5
        self.tree_min_prob = 0.0  # specdec-eagle-tree-confident: the least verified path probability
        self.draft_quantization: str | None = None
        self.draft_confidence = 0.0  # specdec-*-draft-confident, -mtp-confident: where a chain ends
        self.draft_vocab_size = 32768  # the -vocab systems: draft from this many tokens
        self._drafts: dict[str | None, object] = {}
        self._targets: dict[str | None, object] = {}
        self.dtype = dtype
        self.cache_config = cache_config
        self.tokenizer = tokenizer

    @functools.cached_property
    def specdec_plain(self):
        return self.specdec_target(None)

    def specdec_target(self, quantization: str | None):
        """The plain specdec generator of the target with ``quantization`` (``None``: ``dtype``
        weights), loaded once."""
        from specdec import Generator

        if quantization not in self._targets:
            self._targets[quantization] = Generator.from_pretrained(
                self.target_path, dtype=self.dtype, cache_config=self.cache_config,
                quantization=quantization,
            )  # fmt: skip
        return self._targets[quantization]

    @property
    def specdec_draft_model(self):
        return self.draft_model(self.draft_quantization)

    def draft_model(self, quantization: str | None):
        """The specdec draft ``LlamaModel`` with ``quantization`` (``None``: ``dtype`` weights),
        loaded once."""
        from specdec.proposers import DraftModel

        if quantization not in self._drafts:
            self._drafts[quantization] = DraftModel.from_pretrained(
                self.draft_path, dtype=self.dtype, quantization=quantization
            ).model
        return self._drafts[quantization]

    @functools.cached_property
    def draft_vocab(self):
        """The ``draft_vocab_size`` tokens most frequent in Python's standard library sources
        (code and docstrings; no benchmark prompt is among them; ~45k distinct tokens), then
        unseen ones in id order: the -vocab systems' drafts."""
        from transformers import AutoConfig

        from benchmarks.common import code_token_ids
        from specdec.models.sub_vocab import frequent_token_ids

        vocab = AutoConfig.from_pretrained(self.draft_path).vocab_size  # no model loaded for it
        ids = code_token_ids(self.tokenizer)
        return frequent_token_ids([ids], self.draft_vocab_size, vocab, fill=True)

    def specdec_generator(self, proposer, policy=None, quantization: str | None = None):
        """A generator on the shared target (stored with ``quantization``) with ``proposer``
        (``None``: plain), its own KV and ``policy`` (``None``: the default adaptive policy)."""
        return self.specdec_target(quantization).with_proposer(
            proposer, cache_config=self.cache_config, policy=policy
        )

    def _hf_load(self, path: Path):
        return hf_model_ignoring_eos(path, self.dtype)

    @functools.cached_property
    def hf_target(self):
        return self._hf_load(self.target_path)

    @functools.cached_property
    def hf_counter(self) -> ForwardCounter:
        return ForwardCounter(self.hf_target)

    @functools.cached_property
    def hf_draft(self):
        # A separate object even when draft == target, so the counter sees target calls only.
        return self._hf_load(self.draft_path)

    def llamacpp_model(self, draft_model=None):
        """A llama.cpp context on --llamacpp-target (the GGUF is memory-mapped: contexts share
        its pages); ``draft_model``: llama-cpp-python's proposer, for its speculation."""
        try:
            from llama_cpp import Llama
        except ImportError as err:
            raise ImportError("llamacpp-plain needs llama-cpp-python: pip install 'specdec[llamacpp]'") from err
        if self.llamacpp_target is None:
            raise ValueError("llamacpp-plain needs --llamacpp-target FILE.gguf (the target as GGUF)")
        return Llama(model_path=str(self.llamacpp_target), n_ctx=4096, n_batch=512, n_threads=1,
                     n_threads_batch=1, verbose=False, draft_model=draft_model)  # fmt: skip

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)


# ----------------------------------------------------------------------------- systems


def _specdec_plain(pool: ModelPool, k: int | None) -> SpecdecRunner:
    return SpecdecRunner(pool.specdec_generator(None))


# The grid's k is a fixed k (FixedPolicy): this harness compares speculation at a known k with
# transformers' at the same k; specdec-draft-adaptive lets the adaptive policy choose up to k
# (benchmarks/throughput.py measures it across batch sizes).
def _specdec_draft(
    pool: ModelPool, k: int | None, *, adaptive: bool = False, unquantized: bool = False, vocab: bool = False
) -> SpecdecRunner:
    from specdec import FixedPolicy
    from specdec.proposers import DraftModel

    model = pool.draft_model(None) if unquantized else pool.specdec_draft_model
    draft_vocab = pool.draft_vocab if vocab else None

    def build():
        return pool.specdec_generator(
            DraftModel.from_model(model, num_speculative_tokens=k, draft_vocab=draft_vocab),
            policy=None if adaptive else FixedPolicy(k),
        )

    return SpecdecRunner(build(), fresh=build if adaptive else None)


def _specdec_quantized(
    pool: ModelPool,
    k: int | None,
    *,
    quantization: str,
    draft: bool = False,
    adaptive: bool = False,
    confident: bool = False,
    vocab: bool = False,
) -> SpecdecRunner:
    """A target stored with ``quantization``, plain or with a draft model stored the same way
    (the fastest draft for a quantized target: what a user of that format would run);
    ``confident``: chains end below --draft-confidence (k is a ceiling); ``vocab``: the draft
    drafts from --draft-vocab tokens only."""
    from specdec import FixedPolicy
    from specdec.proposers import DraftModel

    if not draft:
        return SpecdecRunner(pool.specdec_generator(None, quantization=quantization))
    model = pool.draft_model(quantization)
    threshold = pool.draft_confidence if confident else 0.0
    draft_vocab = pool.draft_vocab if vocab else None

    def build():
        return pool.specdec_generator(
            DraftModel.from_model(
                model, num_speculative_tokens=k, confidence_threshold=threshold, draft_vocab=draft_vocab
            ),
            policy=None if adaptive else FixedPolicy(k),
            quantization=quantization,
        )

    return SpecdecRunner(build(), fresh=build if adaptive else None)


def _quantized_systems(quantization: str) -> tuple[System, ...]:
    plain = f"specdec-{quantization}-plain"
    build = functools.partial(_specdec_quantized, quantization=quantization)
    return (
        System(name=plain, build=build, speculative=False, plain=plain),
        System(
            name=f"specdec-{quantization}-draft",
            build=functools.partial(build, draft=True),
            speculative=True,
            plain=plain,
        ),
        System(
            name=f"specdec-{quantization}-draft-adaptive",
            build=functools.partial(build, draft=True, adaptive=True),
            speculative=True,
            plain=plain,
            largest_k_only=True,
        ),
        System(
            name=f"specdec-{quantization}-draft-confident",
            build=functools.partial(build, draft=True, confident=True),
            speculative=True,
            plain=plain,
        ),
        System(
            name=f"specdec-{quantization}-draft-confident-vocab",
            build=functools.partial(build, draft=True, confident=True, vocab=True),
            speculative=True,
            plain=plain,
        ),
        System(
            name=f"specdec-{quantization}-draft-adaptive-confident",
            build=functools.partial(build, draft=True, adaptive=True, confident=True),
            speculative=True,
            plain=plain,
            largest_k_only=True,
        ),
    )


def _specdec_lookup(pool: ModelPool, k: int | None) -> SpecdecRunner:
    from specdec import FixedPolicy
    from specdec.proposers import PromptLookup

    return SpecdecRunner(
        pool.specdec_generator(PromptLookup(num_speculative_tokens=k), policy=FixedPolicy(k))
    )


def _specdec_mtp(pool: ModelPool, k: int | None, *, confident: bool = False) -> SpecdecRunner:
    from specdec import FixedPolicy
    from specdec.proposers import MTPHead

    if pool.mtp_head is None:
        raise ValueError("specdec-mtp needs --mtp-head DIR (a head trained for --target)")
    head = MTPHead.from_pretrained(
        pool.mtp_head,
        num_speculative_tokens=k,
        draft_vocab_size=pool.mtp_draft_vocab,
        quantization=pool.head_quantization,
        confidence_threshold=pool.draft_confidence if confident else 0.0,
    )
    return SpecdecRunner(pool.specdec_generator(head, policy=FixedPolicy(k)))


def _specdec_eagle(
    pool: ModelPool, k: int | None, *, tree: bool = False, adaptive: bool = False, confident: bool = False
) -> SpecdecRunner:
    from specdec import FixedPolicy
    from specdec.proposers import EAGLETree
    from specdec.proposers.tree_shape import TreeShape
    from specdec.training.eagle import chain_tree

    if pool.eagle_head is None:
        raise ValueError("specdec-eagle systems need --eagle-head DIR (a head trained for --target)")

    # The dynamic tree grows --tree-top-k children per node to --tree-depth and the k best
    # nodes are verified (EAGLE-2: a tree smaller than its expansions keeps the best of them);
    # a chain is the static tree of k drafts, each the best child of the previous one.
    nodes = max(k, TreeShape.min_verify_tokens(pool.tree_top_k, pool.tree_depth))

    def build():
        proposer = EAGLETree.from_pretrained(
            pool.eagle_head,
            None if tree else chain_tree(k),
            top_k=pool.tree_top_k,
            depth=pool.tree_depth,
            num_verify_tokens=nodes,
            quantization=pool.head_quantization,
            min_path_prob=pool.tree_min_prob if confident else 0.0,
        )
        return pool.specdec_generator(proposer, policy=None if adaptive else FixedPolicy(k))

    return SpecdecRunner(build(), fresh=build if adaptive else None)


def _llamacpp_plain(pool: ModelPool, k: int | None) -> LlamaCppRunner:
    return LlamaCppRunner(pool.llamacpp_model())


def _llamacpp_lookup(pool: ModelPool, k: int | None) -> LlamaCppRunner:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return LlamaCppRunner(pool.llamacpp_model(LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=3)))


def _hf_plain(pool: ModelPool, k: int | None) -> HFRunner:
    return HFRunner(pool, {})


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

    return HFRunner(pool, {"assistant_model": draft}, prepare)


def _hf_lookup(pool: ModelPool, k: int | None) -> HFRunner:
    return HFRunner(pool, {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3})


REFERENCE = "specdec-plain"
HF_REFERENCE = "hf-plain"


@attrs.frozen(kw_only=True)
class System:
    """One benchmarked system. ``speculative`` systems run once per k; ``twin`` names the
    transformers system doing the same thing (for the specdec / transformers ratio); ``plain``
    is the plain decoder of the same stack (same kernels, so greedy output must match it even
    where bf16 rounding makes the two stacks differ)."""

    name: str
    build: Callable[[ModelPool, int | None], SpecdecRunner | HFRunner]
    speculative: bool
    plain: str
    twin: str | None = None
    max_batch_size: int | None = None  # transformers assisted generation is batch-1 only
    largest_k_only: bool = False  # an adaptive policy: the grid's largest k is its upper bound


SYSTEMS = {
    s.name: s
    for s in (
        System(
            name=REFERENCE,
            build=_specdec_plain,
            speculative=False,
            plain=REFERENCE,
            twin=HF_REFERENCE,
        ),
        System(
            name="specdec-draft",
            build=_specdec_draft,
            speculative=True,
            plain=REFERENCE,
            twin="hf-assisted",
        ),
        System(
            name="specdec-draft-vocab",
            build=functools.partial(_specdec_draft, vocab=True),
            speculative=True,
            plain=REFERENCE,
        ),
        System(
            # The draft's weights in --dtype even when --draft-quantization is set.
            name="specdec-draft-unquantized",
            build=functools.partial(_specdec_draft, unquantized=True),
            speculative=True,
            plain=REFERENCE,
        ),
        System(
            name="specdec-draft-adaptive",
            build=functools.partial(_specdec_draft, adaptive=True),
            speculative=True,
            plain=REFERENCE,
            largest_k_only=True,
        ),
        System(
            name="specdec-lookup",
            build=_specdec_lookup,
            speculative=True,
            plain=REFERENCE,
            twin="hf-lookup",
        ),
        System(name="specdec-mtp", build=_specdec_mtp, speculative=True, plain=REFERENCE),
        System(
            name="specdec-mtp-confident",
            build=functools.partial(_specdec_mtp, confident=True),
            speculative=True,
            plain=REFERENCE,
        ),
        System(name="specdec-eagle", build=_specdec_eagle, speculative=True, plain=REFERENCE),
        System(
            name="specdec-eagle-tree",
            build=functools.partial(_specdec_eagle, tree=True),
            speculative=True,
            plain=REFERENCE,
        ),
        System(
            name="specdec-eagle-tree-confident",
            build=functools.partial(_specdec_eagle, tree=True, confident=True),
            speculative=True,
            plain=REFERENCE,
        ),
        System(
            name="specdec-eagle-adaptive",
            build=functools.partial(_specdec_eagle, tree=True, adaptive=True),
            speculative=True,
            plain=REFERENCE,
            largest_k_only=True,
        ),
        *_quantized_systems("int8"),
        *_quantized_systems("q4"),
        System(name="llamacpp-plain", build=_llamacpp_plain, speculative=False,
               plain="llamacpp-plain", max_batch_size=1),  # fmt: skip
        System(name="llamacpp-lookup", build=_llamacpp_lookup, speculative=True,
               plain="llamacpp-plain", max_batch_size=1),  # fmt: skip
        System(name=HF_REFERENCE, build=_hf_plain, speculative=False, plain=HF_REFERENCE),
        System(
            name="hf-assisted",
            build=_hf_assisted,
            speculative=True,
            plain=HF_REFERENCE,
            max_batch_size=1,
        ),
        System(
            name="hf-lookup",
            build=_hf_lookup,
            speculative=True,
            plain=HF_REFERENCE,
            max_batch_size=1,
        ),
    )
}

# ----------------------------------------------------------------------------- the grid


@attrs.frozen(kw_only=True)
class HarnessConfig:
    # The README table; specdec-mtp needs --mtp-head, specdec-eagle* --eagle-head.
    systems: tuple[str, ...] = tuple(
        n
        for n in SYSTEMS
        if not n.startswith(("specdec-mtp", "specdec-eagle", "specdec-int8", "specdec-q4", "llamacpp"))
        and n not in ("specdec-draft-adaptive", "specdec-draft-unquantized")
    )
    prompt_sets: tuple[str, ...] = ("humaneval",)
    num_prompts: int = 10
    ks: tuple[int, ...] = (2, 4)
    temperatures: tuple[float, ...] = (0.0,)
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    warmup_tokens: int = 8
    threads: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    draft_quantization: str | None = None  # "int8": the draft's linear layers as int8
    draft_confidence: float = 0.4  # the -draft-confident and -mtp-confident systems' confidence_threshold
    # Per-system k lists that replace ``ks`` (e.g. one k for transformers' slower systems).
    system_ks: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    mtp_head: str | None = None
    mtp_draft_vocab: int | None = None  # draft from the head's N most frequent training tokens
    draft_vocab: int = 32768  # the -vocab systems: the N tokens most frequent in stdlib code
    eagle_head: str | None = None
    head_quantization: str | None = None  # "int8" / "q4": the MTP and EAGLE heads' linear layers
    llamacpp_target: str | None = None  # the target as a GGUF file, for llamacpp-plain
    tree_top_k: int = 4
    tree_depth: int = 5
    tree_min_prob: float = 0.1  # specdec-eagle-tree-confident: the least verified path probability
    seed: int = 0
    out: str = "harness"
    out_dir: str = str(RESULTS)
    plots: bool = True

    def __attrs_post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
        unknown = set(self.prompt_sets) - set(PROMPT_SETS)
        if unknown:
            raise ValueError(
                f"--prompt-sets: unknown {sorted(unknown)}; choose from {list(PROMPT_SETS)}"
            )
        if not self.threads or any(t < 1 for t in self.threads):
            raise ValueError(f"--threads takes integers >= 1, got {self.threads}")
        for name in ("num_prompts", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if any(k < 1 for k in self.ks) or any(b < 1 for b in self.batch_sizes):
            raise ValueError("--k and --batch-sizes take integers >= 1")
        if any(t < 0 for t in self.temperatures):
            raise ValueError("--temperatures must be >= 0")
        if self.tree_top_k < 1 or self.tree_depth < 1:
            raise ValueError(
                f"--tree-top-k and --tree-depth must be >= 1, got {self.tree_top_k}, {self.tree_depth}"
            )
        if not 0.0 <= self.tree_min_prob < 1.0:
            raise ValueError(f"--tree-min-prob must be in [0, 1), got {self.tree_min_prob}")
        for name, ks in self.system_ks.items():
            if name not in SYSTEMS or not SYSTEMS[name].speculative:
                speculative = [n for n, s in SYSTEMS.items() if s.speculative]
                raise ValueError(f"--system-ks: {name!r} is not one of {speculative}")
            if not ks or any(k < 1 for k in ks):
                raise ValueError(f"--system-ks: {name} needs integers >= 1, got {ks}")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_grid(cfg: HarnessConfig) -> dict:
    """Run the whole grid and return the JSON payload (without writing it)."""
    from transformers import AutoTokenizer

    from specdec import CacheConfig
    from specdec.hub import resolve_model

    target_path, draft_path = resolve_model(cfg.target), resolve_model(cfg.draft)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompts = {
        name: tokenize_prompts(tokenizer, PROMPT_SETS[name], cfg.num_prompts)
        for name in cfg.prompt_sets
    }
    longest = max(len(p.token_ids) for ps in prompts.values() for p in ps)
    cache = CacheConfig(
        max_batch_size=max(cfg.batch_sizes), max_num_tokens=longest + cfg.max_new_tokens
    )
    mtp_head = Path(cfg.mtp_head) if cfg.mtp_head else None
    pool = ModelPool(target_path, draft_path, cfg.dtype, cache, tokenizer, mtp_head)
    pool.draft_quantization = cfg.draft_quantization
    pool.draft_confidence = cfg.draft_confidence
    pool.mtp_draft_vocab = cfg.mtp_draft_vocab
    pool.draft_vocab_size = cfg.draft_vocab
    pool.eagle_head = Path(cfg.eagle_head) if cfg.eagle_head else None
    pool.head_quantization = cfg.head_quantization
    pool.llamacpp_target = Path(cfg.llamacpp_target) if cfg.llamacpp_target else None
    pool.tree_top_k, pool.tree_depth = cfg.tree_top_k, cfg.tree_depth
    pool.tree_min_prob = cfg.tree_min_prob
    instances = [
        (SYSTEMS[name], k)
        for name in cfg.systems
        for k in _ks(SYSTEMS[name], cfg.system_ks.get(name, cfg.ks))
    ]
    runners = {}
    for system, k in instances:
        _log(f"building {system.name}" + (f" k={k}" if k else ""))
        runners[system.name, k] = system.build(pool, k)

    runs, skipped, bounds = [], [], []
    for threads, set_name, temperature, batch in itertools.product(
        cfg.threads, cfg.prompt_sets, cfg.temperatures, cfg.batch_sizes
    ):
        if not bounds or bounds[-1]["threads"] != threads:
            if bounds:
                _close_bound(bounds[-1])  # sets its own thread count: open the next bound after
            torch.set_num_threads(threads)
            bounds.append(_open_bound(threads, pool))
        group = dict(threads=threads, prompt_set=set_name, temperature=temperature, batch_size=batch)
        active = [
            (s, k) for s, k in instances if s.max_batch_size is None or batch <= s.max_batch_size
        ]
        skipped += [
            dict(group, system=s.name, k=k, reason=f"batch size > {s.max_batch_size} unsupported")
            for s, k in instances
            if (s, k) not in active
        ]
        batches = [
            prompts[set_name][i : i + batch] for i in range(0, len(prompts[set_name]), batch)
        ]
        runs += _run_group(
            cfg, group, [(s.name, k, runners[s.name, k]) for s, k in active], batches
        )
    _close_bound(bounds[-1])
    _check_against_plain(runs)
    summary = summarize(runs)
    _rate_against_bounds(summary, bounds)
    return {
        "machine": machine_info(),
        "threads": cfg.threads,
        "dtype": cfg.dtype,
        "versions": _versions(),
        "config": attrs.asdict(cfg),
        "models": {"target": str(target_path), "draft": str(draft_path),
                   "draft_quantization": cfg.draft_quantization, "mtp_head": cfg.mtp_head,
                   "draft_confidence": cfg.draft_confidence,
                   "mtp_draft_vocab": cfg.mtp_draft_vocab, "draft_vocab": cfg.draft_vocab,
                   "eagle_head": cfg.eagle_head, "head_quantization": cfg.head_quantization,
                   "llamacpp_target": cfg.llamacpp_target,
                   "tree_top_k": cfg.tree_top_k, "tree_depth": cfg.tree_depth,
                   "tree_min_prob": cfg.tree_min_prob},
        "hf_settings": HF_SETTINGS,
        "skipped": skipped,
        "bounds": bounds,
        "runs": runs,
        "summary": summary,
    }


def _ks(system: System, ks: tuple[int, ...]) -> tuple[int | None, ...]:
    if not system.speculative:
        return (None,)
    return (max(ks),) if system.largest_k_only else ks


def _open_bound(threads: int, pool: ModelPool) -> dict:
    from benchmarks.bandwidth import read_bandwidth, weight_bytes

    target = pool.specdec_plain.engine.target
    return {"threads": threads, "weight_bytes": weight_bytes(target), "bandwidth": [read_bandwidth()]}


# A smaller buffer for the probes around every specdec-plain run (each ~0.3 s): still 10x the
# last-level cache, so it measures memory, not cache.
PROBE_GIB = 0.5


@functools.cache
def _probe():
    from benchmarks.bandwidth import BandwidthProbe

    return BandwidthProbe(PROBE_GIB)


def _close_bound(bound: dict) -> None:
    """Measure the bandwidth again after the runs, at the bound's own thread count, and keep the
    better (the tighter bound). A closing probe taken after the switch to the next thread count
    once set a 1-thread bound from 2 threads' bandwidth."""
    from benchmarks.bandwidth import read_bandwidth

    torch.set_num_threads(bound["threads"])
    bound["bandwidth"].append(read_bandwidth())
    best = max(bound["bandwidth"])
    bound["read_bandwidth_gb_s"] = best / 1e9
    bound["bound_decode_steps_per_s"] = best / bound["weight_bytes"]


def _rate_against_bounds(summary: list[dict], bounds: list[dict]) -> None:
    """specdec-plain's decode rate as a fraction of its weight-read bound (batch b: b tokens a
    step)."""
    by_threads = {b["threads"]: b for b in bounds}
    for s in summary:
        bound = by_threads.get(s["threads"])
        pairs = s.pop("paired_decode_bound_seconds", None)
        if s.get("decode_tokens_per_s") is None or bound is None:
            continue
        s["bound_decode_tokens_per_s"] = bound["bound_decode_steps_per_s"] * s["batch_size"]
        s["fraction_of_bound"] = s["decode_tokens_per_s"] / s["bound_decode_tokens_per_s"]
        if pairs:
            # Each run against the bandwidth probed right next to it: decode steps x weight
            # bytes / bandwidth = the time reading the weights once per step would take.
            bound_s = sum(b for _, b in pairs) * bound["weight_bytes"]
            s["fraction_of_paired_bound"] = bound_s / sum(d for d, _ in pairs)


def _run_group(cfg: HarnessConfig, group: dict, active: list, batches: list) -> list[dict]:
    """Warm up, then repeats in which the systems take turns on every prompt batch.

    The turn order rotates by one system per repeat, so no system always runs first (right
    after another system's cache-cold start) or always last.
    """
    if not active:
        return []
    temperature = group["temperature"]
    for _, _, runner in active:
        for _ in range(cfg.warmup):
            runner.run([p.token_ids for p in batches[0]], cfg.warmup_tokens, temperature, cfg.seed)
    runs = []
    for repeat in range(cfg.repeats):
        shift = repeat % len(active)
        for _, _, runner in active:
            runner.start_repeat()
        for b_index, prompt_batch in enumerate(batches):
            for name, k, runner in active[shift:] + active[:shift]:
                before = _probe()(repeats=3) if name == REFERENCE else None
                row = _timed_run(runner, prompt_batch, cfg, temperature, b_index)
                if name == REFERENCE:
                    # The same prompts for one token: the prefill (and one step), timed apart so
                    # the plain decode rate can be set against the weight-read bound; the read
                    # bandwidth probed just before and just after, so the bound is the
                    # machine's at the time of this run (the better probe: the tighter bound).
                    row["prefill_seconds"] = _timed_prefill(runner, prompt_batch, temperature, cfg.seed)
                    row["read_bandwidth_probes"] = [before, _probe()(repeats=3)]
                row.update(group, system=name, k=k, repeat=repeat)
                _log(
                    f"{name:15s} k={k!s:4s} T={temperature:g} b={group['batch_size']} r={repeat} "
                    f"{row['prompt_id']:24s} {row['tokens_per_s']:8.2f} tok/s"
                )
                runs.append(row)
    return runs


HF_SETTINGS = {
    "all": "generate(input_ids, attention_mask, max_new_tokens=n, do_sample, repetition_penalty=1.0, "
    "pad_token_id); model.generation_config.eos_token_id=None so EOS neither stops nor is masked "
    "(specdec: SamplingParams(ignore_eos=True)); sampling: temperature=T, top_k=0, top_p=1.0",
    "hf-assisted": "generate(assistant_model=draft); on the assistant's generation_config: "
    "num_assistant_tokens=k, num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0.0",
    "hf-lookup": "generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)",
    "counters": "target forwards by a forward pre-hook on the transformers target; assisted drafted "
    "tokens = query tokens fed - prompt - (forwards - 1), accepted = new tokens - forwards",
}


def _timed_run(
    runner, prompt_batch: list[Prompt], cfg: HarnessConfig, temperature: float, b_index: int
) -> dict:
    ids = [p.token_ids for p in prompt_batch]
    start = time.perf_counter()
    stats = runner.run(ids, cfg.max_new_tokens, temperature, cfg.seed + b_index * len(ids))
    seconds = time.perf_counter() - start
    new = sum(len(o) for o in stats.outputs)
    steps = stats.num_verify_steps
    return {
        "prompt_id": "+".join(p.prompt_id for p in prompt_batch),
        "prompt_tokens": [len(p.token_ids) for p in prompt_batch],
        "seconds": seconds,
        "num_new_tokens": new,
        "tokens_per_s": new / seconds,
        "target_forwards": stats.target_forwards,
        "num_verify_steps": steps,
        "num_drafted": stats.num_drafted,
        "num_accepted": stats.num_accepted,
        "num_emitted_in_verify": stats.num_emitted_in_verify,
        "mean_accepted_length": stats.num_emitted_in_verify / steps if steps else None,
        "acceptance_rate": stats.num_accepted / stats.num_drafted if stats.num_drafted else None,
        "accepted_per_position": stats.accepted_per_position,
        "drafted_per_position": stats.drafted_per_position,
        "per_position_acceptance": _ratios(stats.accepted_per_position, stats.drafted_per_position),
        "k_histogram": stats.k_histogram,
        "output_token_ids": stats.outputs,
    }


def _timed_prefill(runner, prompt_batch: list[Prompt], temperature: float, seed: int) -> float:
    ids = [p.token_ids for p in prompt_batch]
    start = time.perf_counter()
    runner.run(ids, 1, temperature, seed)
    return time.perf_counter() - start


def _ratios(num: list[int] | None, den: list[int] | None) -> list[float] | None:
    if num is None or den is None:
        return None
    return [a / d if d else 0.0 for a, d in zip(num, den)]


def _check_against_plain(runs: list[dict]) -> None:
    """Set ``matches_plain``/``first_divergence`` and ``matches_own_plain`` on greedy runs.

    ``matches_plain``: the output equals specdec-plain's for the same prompts in the same
    repeat (hf-plain's when specdec-plain was not run). ``matches_own_plain``: it equals the
    plain decoder of its own stack (specdec or transformers). ``None`` when sampling or when
    the reference did not run.
    """

    def key(r: dict) -> tuple:
        return (
            r.get("threads", 1), r["prompt_set"], r["temperature"], r["batch_size"], r["repeat"],
            r["prompt_id"],
        )

    outputs = {(key(r), r["system"]): r["output_token_ids"] for r in runs}
    for r in runs:
        greedy = r["temperature"] == 0
        ref = outputs.get((key(r), REFERENCE), outputs.get((key(r), HF_REFERENCE)))
        own = outputs.get((key(r), SYSTEMS[r["system"]].plain))
        r["matches_plain"] = r["output_token_ids"] == ref if greedy and ref else None
        r["first_divergence"] = _first_divergence(r["output_token_ids"], ref) if greedy else None
        r["matches_own_plain"] = r["output_token_ids"] == own if greedy and own else None


def _first_divergence(outputs: list[list[int]], ref: list[list[int]] | None) -> int | None:
    """Index of the first differing new token (over the batch's prompts), or ``None``."""
    pairs = zip(outputs, ref or [])
    return next(
        (i for out, want in pairs for i, (a, b) in enumerate(zip(out, want)) if a != b), None
    )


# ----------------------------------------------------------------------------- summary


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (prompt set, temperature, batch size, system, k): medians and ratios.

    Speedups are ratios of median tokens/s within the same prompt set, temperature and batch
    size; ``vs_twin`` is specdec over its transformers twin at the same k.
    """

    def group_key(r: dict) -> tuple:
        return r.get("threads", 1), r["prompt_set"], r["temperature"], r["batch_size"]

    rows = {}
    for r in runs:
        rows.setdefault((*group_key(r), r["system"], r["k"]), []).append(r)
    medians = {key: statistics.median(r["tokens_per_s"] for r in rs) for key, rs in rows.items()}
    out = []
    for (threads, set_name, temperature, batch, system, k), rs in rows.items():
        g = (threads, set_name, temperature, batch)
        med = medians[g + (system, k)]
        plain = medians.get(g + (REFERENCE, None))
        hf_plain = medians.get(g + (HF_REFERENCE, None))
        own_plain = medians.get(g + (SYSTEMS[system].plain, None))
        twin_name = SYSTEMS[system].twin
        twin = medians.get(g + (twin_name, k)) if twin_name else None
        checked = [r["matches_plain"] for r in rs if r["matches_plain"] is not None]
        own = [r["matches_own_plain"] for r in rs if r["matches_own_plain"] is not None]
        steps = sum(r["num_verify_steps"] for r in rs)
        drafted = sum(r["num_drafted"] for r in rs)
        acc_pos, draft_pos = _sum_positions(rs)
        out.append(
            {
                "threads": threads,
                "prompt_set": set_name,
                "temperature": temperature,
                "batch_size": batch,
                "system": system,
                "k": k,
                "num_runs": len(rs),
                "median_tokens_per_s": med,
                "median_seconds": statistics.median(r["seconds"] for r in rs),
                "speedup_vs_specdec_plain": med / plain if plain else None,
                # over the plain decoder of its own stack and weights (a q4 system's: q4 plain)
                "speedup_vs_own_plain": med / own_plain if own_plain else None,
                "speedup_vs_hf_plain": med / hf_plain if hf_plain else None,
                "twin": twin_name,
                "vs_twin": med / twin if twin else None,
                "mean_target_forwards": statistics.fmean(r["target_forwards"] for r in rs),
                "target_forwards_per_token": sum(r["target_forwards"] for r in rs)
                / sum(r["num_new_tokens"] for r in rs),
                "mean_accepted_length": sum(r["num_emitted_in_verify"] for r in rs) / steps
                if steps
                else None,
                "acceptance_rate": sum(r["num_accepted"] for r in rs) / drafted
                if drafted
                else None,
                "per_position_acceptance": _ratios(acc_pos, draft_pos),
                "k_histogram": _sum_histograms(rs),
                "matches_plain": all(checked) if checked else None,
                "num_mismatched_runs": checked.count(False),
                "num_own_mismatched_runs": own.count(False),
                "matches_own_plain": all(own) if own else None,
                "decode_tokens_per_s": _decode_rate(rs),
                "paired_decode_bound_seconds": _paired_bound_seconds(rs),
            }
        )
    out.sort(
        key=lambda s: (
            s["threads"],
            s["prompt_set"],
            s["temperature"],
            s["batch_size"],
            s["k"] or 0,
            list(SYSTEMS).index(s["system"]),
        )
    )
    return out


def _decode_rate(rs: list[dict]) -> float | None:
    """Median tokens/s after the first token (runs that timed their prefill apart)."""
    rates = [
        (r["num_new_tokens"] - len(r["prompt_tokens"])) / (r["seconds"] - r["prefill_seconds"])
        for r in rs
        if r.get("prefill_seconds") is not None and r["seconds"] > r["prefill_seconds"]
    ]
    return statistics.median(rates) if rates else None


def _paired_bound_seconds(rs: list[dict]) -> list[tuple[float, float]] | None:
    """Per run that probed the bandwidth next to it: (decode seconds, the decode tokens' bound
    in seconds at that bandwidth, before dividing by the weight bytes). ``None`` if none did."""
    pairs = [
        (
            r["seconds"] - r["prefill_seconds"],
            (r["num_new_tokens"] - len(r["prompt_tokens"])) / len(r["prompt_tokens"])
            / max(r["read_bandwidth_probes"]),
        )
        for r in rs
        if r.get("read_bandwidth_probes") and r["seconds"] > r["prefill_seconds"]
    ]
    return pairs or None


def _sum_histograms(rs: list[dict]) -> dict[int, int] | None:
    """The runs' k histograms added up (``None`` for systems without one: transformers)."""
    hists = [r.get("k_histogram") for r in rs if r.get("k_histogram") is not None]
    if not hists:
        return None
    total: dict[int, int] = {}
    for h in hists:
        for k, n in h.items():
            total[int(k)] = total.get(int(k), 0) + n
    return dict(sorted(total.items()))


def _sum_positions(rs: list[dict]) -> tuple[list[int] | None, list[int] | None]:
    if any(r["accepted_per_position"] is None for r in rs):
        return None, None
    width = max(len(r["drafted_per_position"]) for r in rs)
    acc, dra = [0] * width, [0] * width
    for r in rs:
        for j, (a, d) in enumerate(zip(r["accepted_per_position"], r["drafted_per_position"])):
            acc[j] += a
            dra[j] += d
    return acc, dra


TABLE_COLUMNS = (
    "threads",
    "prompts",
    "T",
    "batch",
    "system",
    "k",
    "tok/s",
    "× specdec-plain",
    "× hf-plain",
    "× own plain",
    "specdec / HF twin",
    "mean acc. len",
    "acc. rate",
    "target fwd / token",
    "= plain",
)


def markdown_table(summary: list[dict]) -> str:
    """The README table. Speedups of rows whose greedy text differs from specdec-plain's are
    struck out; ``†`` marks rows that still equal their own stack's plain output (bf16
    rounding differs between the stacks, not a speculation error)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for s in summary:
        # A quantized system is another model: it must equal its own plain decoder, not bf16's.
        bad = (s["matches_own_plain"] if _own_weights(s) else s["matches_plain"]) is False
        cells = [
            str(s["threads"]),
            s["prompt_set"],
            f"{s['temperature']:g}",
            str(s["batch_size"]),
            s["system"],
            _k_cell(s),
            f"{s['median_tokens_per_s']:.2f}",
            _ratio(s["speedup_vs_specdec_plain"], bad and s["system"] != REFERENCE),
            _ratio(s["speedup_vs_hf_plain"], bad and s["system"] != HF_REFERENCE),
            _ratio(s.get("speedup_vs_own_plain"), bad) if _own_weights(s) else "",
            _ratio(s["vs_twin"], bad) if s["k"] is not None else "",
            _num(s["mean_accepted_length"]),
            _num(s["acceptance_rate"]),
            f"{s['target_forwards_per_token']:.3f}",
            _match_cell(s),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _k_cell(s: dict) -> str:
    """The k column: the fixed k, or for adaptive systems their cap and the mean k chosen per
    decode step (0 = a plain step), so a table shows what the policy did."""
    if s["k"] is None:
        return "-"
    hist = s.get("k_histogram")
    system = SYSTEMS.get(s["system"])
    if system is None or not system.largest_k_only or not hist:
        return str(s["k"])
    steps = sum(hist.values())
    return f"<= {s['k']} (mean {sum(int(k) * n for k, n in hist.items()) / steps:.1f})"


def _own_weights(s: dict) -> bool:
    """Whether the system's model differs from specdec-plain's (quantized weights)."""
    return SYSTEMS[s["system"]].plain not in (REFERENCE, HF_REFERENCE)


def _match_cell(s: dict) -> str:
    if _own_weights(s):
        if s["matches_own_plain"] is None:
            return "n/a"
        own = "yes" if s["matches_own_plain"] else f"NO ({s['num_own_mismatched_runs']}/{s['num_runs']})"
        return f"{own} (own plain)"
    if s["matches_plain"] is None:
        return "n/a"
    if s["matches_plain"]:
        return "yes"
    dagger = "†" if s["matches_own_plain"] else ""
    return f"NO ({s['num_mismatched_runs']}/{s['num_runs']}){dagger}"


def _ratio(x: float | None, struck: bool) -> str:
    if x is None:
        return ""
    return f"~~{x:.2f}×~~" if struck else f"{x:.2f}×"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _versions() -> dict[str, str]:
    import transformers

    import specdec

    versions = {
        "specdec": specdec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:  # the optional llama.cpp peer
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    return versions


# ----------------------------------------------------------------------------- CLI


def _csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x.strip())


def _system_ks(text: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, ks = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=K[,K...], got {item!r}")
        out[name.strip()] = _csv(int)(ks)
    return out


PRESETS = {
    # Issue 12's table: every way to decode on the CPU, batch 1, one and two threads.
    "cpu": dict(
        systems=("specdec-plain", "specdec-draft", "specdec-draft-adaptive",
                 "specdec-draft-unquantized", "specdec-lookup", "hf-plain", "hf-assisted"),
        ks=(1, 2, 3, 4, 5, 6),
        # One k where the k grid would cost an hour of transformers' decoding per k: the best
        # fixed k of the int8 draft on one thread (2026-12-01).
        system_ks={"specdec-draft-unquantized": (4,), "specdec-lookup": (4,), "hf-assisted": (4,)},
        threads=(1, 2),
        draft_quantization="int8",
        num_prompts=10,
        max_new_tokens=128,
        repeats=1,
    ),
    # Issue 17's table: bf16, int8 and 4-bit targets, plain and with a draft of the same format
    # (add llamacpp-plain to --systems with --llamacpp-target FILE.gguf for the llama.cpp peer).
    "quant": dict(
        systems=("specdec-plain", "specdec-int8-plain", "specdec-int8-draft", "specdec-q4-plain",
                 "specdec-q4-draft", "specdec-q4-draft-adaptive"),
        ks=(3, 4),
        system_ks={"specdec-int8-draft": (4,), "specdec-q4-draft-adaptive": (6,)},
        threads=(1, 2),
        num_prompts=10,
        max_new_tokens=128,
        repeats=1,
    ),
}


def parse_args(argv: Sequence[str] | None = None) -> HarnessConfig:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS))
    known, _ = pre.parse_known_args(argv)
    preset = dict(PRESETS.get(known.preset, {}))
    d = HarnessConfig(**preset)
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="defaults for a named table (cpu: plain, int8 draft k=1..6 and adaptive, bf16 draft, "
        "lookup, transformers plain and assisted (k=4 for the last three); HumanEval 0-9 x 128 tokens; 1 and 2 threads; "
        "add specdec-mtp with --systems and --mtp-head); other flags override them",
    )
    ap.add_argument(
        "--systems", type=_csv(str), default=d.systems, help=f"comma list of {','.join(SYSTEMS)}"
    )
    ap.add_argument(
        "--prompt-sets",
        type=_csv(str),
        default=d.prompt_sets,
        help=f"comma list of {','.join(PROMPT_SETS)}",
    )
    ap.add_argument(
        "--num-prompts", type=int, default=d.num_prompts, help="first N prompts of each set"
    )
    ap.add_argument(
        "--k", dest="ks", type=_csv(int), default=d.ks, help="num_speculative_tokens, comma list"
    )
    ap.add_argument(
        "--system-ks",
        type=_system_ks,
        default=d.system_ks,
        help="per-system k lists replacing --k, e.g. 'hf-assisted=4;specdec-lookup=2,4'",
    )
    ap.add_argument("--temperatures", type=_csv(float), default=d.temperatures)
    ap.add_argument("--batch-sizes", type=_csv(int), default=d.batch_sizes)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument(
        "--warmup", type=int, default=d.warmup, help="warm-up runs per system and group"
    )
    ap.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens)
    ap.add_argument(
        "--threads", type=_csv(int), default=d.threads, help="torch.set_num_threads, comma list"
    )
    ap.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--target", default=d.target, help="known model name or HF directory")
    ap.add_argument("--draft", default=d.draft, help="known model name or HF directory")
    ap.add_argument(
        "--draft-quantization", choices=("int8",), default=d.draft_quantization,
        help="specdec draft systems: the draft's linear layers as int8",
    )
    ap.add_argument(
        "--draft-confidence", type=float, default=d.draft_confidence,
        help="the -draft-confident and -mtp-confident systems: a chain ends after a draft token of lower draft probability",
    )
    ap.add_argument("--mtp-head", default=d.mtp_head, help="MTP head directory for specdec-mtp")
    ap.add_argument("--mtp-draft-vocab", type=int, default=d.mtp_draft_vocab, help="draft vocabulary size for specdec-mtp")
    ap.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                    help="the -vocab systems: the draft model drafts from this many tokens (most frequent in stdlib code)")
    ap.add_argument("--eagle-head", default=d.eagle_head, help="EAGLE head directory for specdec-eagle*")
    ap.add_argument(
        "--head-quantization", choices=("int8", "q4"), default=d.head_quantization,
        help="specdec-mtp and specdec-eagle*: the heads' linear layers in this format",
    )
    ap.add_argument("--llamacpp-target", default=d.llamacpp_target,
                    help="the target as a GGUF file, for llamacpp-plain (llama-cpp-python)")  # fmt: skip
    ap.add_argument("--tree-top-k", type=int, default=d.tree_top_k, help="specdec-eagle-tree: children per node")
    ap.add_argument("--tree-depth", type=int, default=d.tree_depth, help="specdec-eagle-tree: depth")
    ap.add_argument("--tree-min-prob", type=float, default=d.tree_min_prob,
                    help="specdec-eagle-tree-confident: verify only nodes of at least this path probability")  # fmt: skip
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out, help="result name: <out-dir>/<out>-<stamp>.json")
    ap.add_argument("--out-dir", default=d.out_dir)
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    args = vars(ap.parse_args(argv))
    args.pop("preset")
    return HarnessConfig(**args)


def bounds_markdown(bounds: list[dict], summary: list[dict]) -> str:
    """One line per thread count: bandwidth, bound and specdec-plain's share of it."""
    lines = []
    for b in bounds:
        plain = [
            s for s in summary
            if s["system"] == REFERENCE and s["threads"] == b["threads"] and s.get("fraction_of_bound")
        ]
        shares = ", ".join(
            f"{s['prompt_set']} b={s['batch_size']}: plain decodes {s['decode_tokens_per_s']:.2f} tok/s "
            f"= {s['fraction_of_bound']:.0%} of it"
            + (
                f" ({s['fraction_of_paired_bound']:.0%} of the bound at the bandwidth probed "
                "next to each run)"
                if s.get("fraction_of_paired_bound")
                else ""
            )
            for s in plain
        )
        lines.append(
            f"- {b['threads']} thread(s): read bandwidth {b['read_bandwidth_gb_s']:.1f} GB/s, "
            f"target weights {b['weight_bytes'] / 1e9:.2f} GB, bound "
            f"{b['bound_decode_steps_per_s']:.2f} decode steps/s" + (f"; {shares}" if shares else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Path:
    cfg = parse_args(argv)
    payload = run_grid(cfg)
    payload["markdown"] = markdown_table(payload["summary"])
    payload["bounds_markdown"] = bounds_markdown(payload["bounds"], payload["summary"])
    path = write_json(cfg.out, payload, out_dir=cfg.out_dir)
    print(payload["markdown"])
    print()
    print(payload["bounds_markdown"])
    print(f"\nwrote {path}")
    if cfg.plots:
        from benchmarks.plots import plot_all

        for png in plot_all(path):
            print(f"wrote {png}")
    return path


if __name__ == "__main__":
    main()
