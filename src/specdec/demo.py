"""``specdec demo``: the default model pair, plain vs speculative decoding, side by side.

Fetches and caches the Qwen2.5-Coder pair on first use, generates greedily for a few code
prompts with and without speculation in the same run, checks the texts are identical, and
prints acceptance, tokens/s and the speedup, plus where the time went.
"""

from __future__ import annotations

import argparse
import time

import torch

__all__ = ["run_demo", "DEFAULT_PROMPTS"]

DEFAULT_PROMPTS = (
    'def has_close_elements(numbers: list[float], threshold: float) -> bool:\n    """Check if in given list of numbers, are any two numbers closer to each other than\n    given threshold.\n    """\n',
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    'def parse_csv_line(line: str) -> list[str]:\n    """Split a CSV line into fields, honouring double quotes."""\n',
)
# Measured on this project's CPU machine, HumanEval 0-9 x 128 tokens, int8 draft, one thread
# (benchmarks/results/harness-cpu-1t-20261201-1457.json): fixed k = 4 is the best fixed k
# (1.68x plain); the adaptive policy from a fresh Generator with k <= 6 reaches 1.63x.
DEFAULT_K = {"adaptive": 6, "fixed": 4}
# Tokens a demo request may reach without --max-model-len (see _max_model_len).
DEMO_MAX_MODEL_LEN = 2048


def _stamp(label: str, start: float, timings: dict[str, float]) -> float:
    now = time.perf_counter()
    timings[label] = now - start
    print(f"  [{label}: {now - start:.1f} s]", flush=True)
    return now


def run_demo(args: argparse.Namespace) -> int:
    from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
    from specdec.hub import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec.proposers import DraftModel

    timings: dict[str, float] = {}
    policy_name = getattr(args, "policy", "adaptive")
    k = args.num_speculative_tokens or DEFAULT_K[policy_name]
    print("specdec demo: speculative decoding on a real model pair (greedy, lossless)\n")
    start = time.perf_counter()
    target_path = resolve_model(args.target or DEFAULT_TARGET)
    draft_path = resolve_model(args.draft or DEFAULT_DRAFT)
    start = _stamp("fetch or find cached models", start, timings)
    cache = CacheConfig(max_batch_size=1, max_model_len=_max_model_len(args, target_path))
    target_quantization, quantization = _quantizations(args)
    plain = Generator.from_pretrained(
        target_path, dtype=args.dtype, cache_config=cache, quantization=target_quantization
    )
    draft = DraftModel.from_pretrained(draft_path, dtype=args.dtype, quantization=quantization).model
    # The adaptive policy by default: from a fresh Generator it tries speculating on its first
    # request (docs/concepts.md, "Choosing k") and lands within 5% of the best fixed k.
    policy = None if policy_name == "adaptive" else FixedPolicy(k)
    spec = plain.with_proposer(DraftModel.from_model(draft, num_speculative_tokens=k), policy=policy)
    start = _stamp("load target + draft", start, timings)
    plain.generate("def f():", SamplingParams(max_new_tokens=2))  # warm-up (builds the kernel)
    spec.generate("def f():", SamplingParams(max_new_tokens=2))
    start = _stamp("warm-up", start, timings)

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    all_same = True
    for i, prompt in enumerate(prompts):
        # Plain and speculative back to back so machine noise hits both alike, in alternating
        # order (a system that always runs second would inherit warm caches and turbo state).
        (a, ta), (b, tb) = _timed_pair(plain, spec, prompt, params, swap=i % 2 == 1)
        totals["plain"][0] += len(a.token_ids)
        totals["plain"][1] += ta
        totals["spec"][0] += len(b.token_ids)
        totals["spec"][1] += tb
        same = a.token_ids == b.token_ids
        all_same &= same
        print("-" * 72)
        print(prompt + b.text)
        print(
            f"  plain {len(a.token_ids) / ta:5.2f} tok/s | speculative "
            f"{len(b.token_ids) / tb:5.2f} tok/s | acceptance {b.metrics.acceptance_rate:.2f} "
            f"| mean accepted length {b.metrics.mean_accepted_length:.2f} | "
            f"{'identical text' if same else 'TEXT DIFFERS'}"
        )
    _stamp("generation", start, timings)
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["spec"][0] / totals["spec"][1]
    m = spec.metrics
    print("=" * 72)
    mode = "adaptive, at most" if policy is None else "fixed"
    weights = f"{quantization} draft weights" if quantization else f"{args.dtype} draft weights"
    target_weights = f"{target_quantization} weights" if target_quantization else args.dtype
    print(f"target {target_path.name} ({target_weights}), draft {draft_path.name} ({weights}), "
          f"k={k} ({mode}), {torch.get_num_threads()} threads")
    print(f"plain decoding       {plain_tps:6.2f} tokens/s")
    print(f"speculative decoding {spec_tps:6.2f} tokens/s   speedup {spec_tps / plain_tps:.2f}x")
    print(f"acceptance rate {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}, "
          f"per-position acceptance {[round(a, 2) for a in m.per_position_acceptance]}")
    print(f"greedy outputs identical: {all_same}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return 0 if all_same else 1


def _max_model_len(args: argparse.Namespace, target_path) -> int:
    """``--max-model-len``, else DEMO_MAX_MODEL_LEN within the target's context: the demo's
    prompts are short, and a KV cache of the whole context (32k for the default pair) would
    cost the plain and the speculative generator a gigabyte each for nothing."""
    from specdec.models.loading import local_context

    given = getattr(args, "max_model_len", None)
    return given or min(DEMO_MAX_MODEL_LEN, local_context(target_path) or DEMO_MAX_MODEL_LEN)


def _quantizations(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(target, draft)`` weight formats: ``--quantization`` for the target (default: none);
    ``--draft-quantization`` for the draft (default: the target's format, else int8)."""
    target = getattr(args, "quantization", "none")
    target = None if target in (None, "none") else target
    draft = getattr(args, "draft_quantization", None) or target or "int8"
    return target, None if draft == "none" else draft


def _timed_pair(first, second, prompt: str, params, *, swap: bool):
    """``((output, seconds) of first, (output, seconds) of second)``, two generators on one
    prompt, ``second`` running first when ``swap``."""
    order = (second, first) if swap else (first, second)
    timed = []
    for gen in order:
        start = time.perf_counter()
        timed.append((gen.generate(prompt, params), time.perf_counter() - start))
    return (timed[1], timed[0]) if swap else (timed[0], timed[1])
