"""Runners: one system's ``generate`` over a prompt batch, timed by the grid, counted alike.

A runner is what a system builder returns (``benchmarks.harness.systems``): specdec's
Generator, transformers' ``model.generate`` or llama.cpp, each behind the same two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch


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


class Runner(Protocol):
    """One benchmarked system, built: ``run`` generates exactly ``n`` new tokens per prompt."""

    def start_repeat(self) -> None:
        """Called before every repeat (a runner that learns may start afresh)."""

    def run(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, seed: int
    ) -> RunStats: ...


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


@attrs.define
class HFRunner:
    """Runs ``model.generate`` with fixed extra kwargs; ``prepare`` runs before each call.

    ``counter`` is the :class:`ForwardCounter` hooked on ``model``; ``pad_id`` pads the batch.
    """

    model: object
    counter: ForwardCounter
    pad_id: int
    extra: dict
    prepare: Callable[[], None] | None = None

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
