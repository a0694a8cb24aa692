"""Prefix caching: time to first token of a request whose long prefix another request computed.

Qwen2.5-Coder-1.5B-Instruct (bf16) on the CPU. Each round builds a fresh shared prefix of
``--prefix-tokens`` tokens (HumanEval prompts, a different slice per round, so nothing is cached
before the round starts) and two requests: prefix + question A, then prefix + question B, one
after the other. Two generators share the loaded weights: one with the prefix cache, one
without. Per round and generator the TTFT of A and of B is measured (submit to the first
emitted token); with the cache, B's prefill computes only its question (its prefix's full pages
are cached), without it, all of B. Greedy outputs must be identical across the two generators.
The generators take turns going first, so the drift of a shared machine hits both.

Writes ``benchmarks/results/prefix-cache-<UTC stamp>.json`` (and ``-latest``) and prints a
markdown table; about 2 minutes on two shared cores.

    python -m benchmarks.prefix_cache [--prefix-tokens 1000] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import humaneval_prompts, machine_info, write_json

QUESTIONS = (
    "\n\n# Which of the functions above sorts its input? Answer with its name:",
    "\n\n# Which of the functions above returns a boolean? Answer with its name:",
)


def prefixes(tokenizer, num_tokens: int, rounds: int) -> list[list[int]]:
    """``rounds`` distinct prefixes of exactly ``num_tokens`` tokens of HumanEval prompts."""
    ids = tokenizer.encode("\n".join(humaneval_prompts()))
    if len(ids) < rounds * num_tokens:
        raise ValueError(f"HumanEval gives {len(ids)} tokens; need {rounds * num_tokens}")
    return [ids[r * num_tokens : (r + 1) * num_tokens] for r in range(rounds)]


def ttft(gen, prompt: list[int], params) -> tuple[float, list[int]]:
    """Seconds from submit to the first emitted token, and the whole greedy output."""
    start = time.perf_counter()
    handle = gen.submit(prompt, params)
    first = None
    for _ in handle.tokens():
        if first is None:
            first = time.perf_counter() - start
    return first, handle.result().token_ids


def run(args) -> dict:
    from specdec import CacheConfig, Generator, SamplingParams
    from specdec.hub import resolve_model

    torch.set_num_threads(args.threads)
    path = resolve_model(args.target)
    base = CacheConfig(max_batch_size=2, max_model_len=args.prefix_tokens + 64 + args.max_new_tokens)
    cached = Generator.from_pretrained(path, dtype="bfloat16", cache_config=base)
    fresh = cached.with_proposer(None, cache_config=CacheConfig(
        max_batch_size=2, max_model_len=base.max_model_len, prefix_caching=False))  # fmt: skip
    tok = cached.tokenizer
    questions = [tok.encode(q) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    fresh.generate(tok.encode("def f(x):"), params)  # warm up kernels and allocator
    rounds = []
    for r, prefix in enumerate(prefixes(tok, args.prefix_tokens, args.rounds)):
        order = [("cached", cached), ("fresh", fresh)]
        if r % 2:
            order.reverse()
        row: dict[str, object] = {"round": r}
        outputs = {}
        for name, gen in order:
            times, outs = [], []
            for q in questions:
                t, out = ttft(gen, prefix + q, params)
                times.append(t)
                outs.append(out)
            row[name] = {"ttft_first_s": times[0], "ttft_second_s": times[1]}
            outputs[name] = outs
        assert outputs["cached"] == outputs["fresh"], f"round {r}: outputs differ with the cache"
        row["second_over_first_cached"] = row["cached"]["ttft_second_s"] / row["cached"]["ttft_first_s"]
        row["second_over_first_fresh"] = row["fresh"]["ttft_second_s"] / row["fresh"]["ttft_first_s"]
        rounds.append(row)
        print(row)
    stats = cached.kv_stats()
    return {
        "benchmark": "prefix-cache",
        "machine": machine_info(),
        "target": str(path),
        "dtype": "bfloat16",
        "threads": args.threads,
        "prefix_tokens": args.prefix_tokens,
        "question_tokens": [len(q) for q in questions],
        "max_new_tokens": args.max_new_tokens,
        "rounds": rounds,
        "median_second_over_first_cached": statistics.median(r["second_over_first_cached"] for r in rounds),
        "median_second_over_first_fresh": statistics.median(r["second_over_first_fresh"] for r in rounds),
        "outputs_identical": True,
        "prefix_cache_stats": {k: v for k, v in stats.items() if k.startswith("prefix_cache")},
    }


def table(result: dict) -> str:
    lines = [
        "| round | TTFT first (cache) | TTFT second (cache) | second/first (cache) | second/first (no cache) |",
        "|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        c = r["cached"]
        lines.append(
            f"| {r['round']} | {c['ttft_first_s']:.2f} s | {c['ttft_second_s']:.3f} s | "
            f"{r['second_over_first_cached']:.3f} | {r['second_over_first_fresh']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    result = run(args)
    path = write_json("prefix-cache", result)
    print(table(result))
    print(f"median second/first TTFT with the cache: {result['median_second_over_first_cached']:.3f}; "
          f"without: {result['median_second_over_first_fresh']:.2f}  ->  {path}")  # fmt: skip
    return path


if __name__ == "__main__":
    main()
