"""Cross-tokenizer drafting: the 0.5B draft through text (CrossTokenizerDraft) against the
same draft through the shared-token path (DraftModel), and plain decoding.

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft) share one
tokenizer, so the draft can run both ways: the normal path (draft token ids and distributions
go straight to the verifier) and the text path, its tokenizer treated as foreign (target tokens
-> text -> draft tokens, draft tokens -> text -> target tokens, deterministic drafts). The gap
between the two is what the text round trip costs (tokenizer calls, the partial-token guard's
extra draft step, drafts the verifier treats as one-hot). Greedy, ``--max-new-tokens`` tokens
per HumanEval prompt, one request at a time; the three systems take turns going first. Every
output must equal plain decoding's.

Writes ``benchmarks/results/cross-tokenizer-<UTC stamp>.json`` (and ``-latest``):

    taskset -c 0 python -m benchmarks.cross_tokenizer [--num-prompts 3] [--max-new-tokens 64]
    # smoke test: --num-prompts 1 --max-new-tokens 8 --out-dir /tmp/cross-tokenizer
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import humaneval_prompts, machine_info, write_json

SYSTEMS = ("plain", "shared", "cross")


def build(args):
    """The target's tokenizer and the three generators, sharing the target's and the draft's
    weights."""
    from specdec import CacheConfig, FixedPolicy, Generator
    from specdec.hub import resolve_model
    from specdec.proposers import CrossTokenizerDraft, DraftModel

    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    # No prefix caching: the warm-up runs the first timed prompt; every run prefills in full.
    cache = CacheConfig(
        max_batch_size=1, max_model_len=2048 + args.max_new_tokens, prefix_caching=False
    )
    target = Generator.from_pretrained(target_path, dtype=args.dtype, cache_config=cache)
    shared = DraftModel.from_pretrained(
        draft_path,
        num_speculative_tokens=args.k,
        dtype=args.dtype,
        quantization=args.draft_quantization,
    )
    # The same weights and tokenizer, drafting through text: the tokenizer taken as foreign.
    cross = CrossTokenizerDraft(
        DraftModel.from_model(shared.model, tokenizer=shared.tokenizer),
        num_speculative_tokens=args.k,
    )
    systems = {
        "plain": target.with_proposer(None, cache_config=cache),
        "shared": target.with_proposer(shared, cache_config=cache, policy=FixedPolicy(args.k)),
        "cross": target.with_proposer(cross, cache_config=cache, policy=FixedPolicy(args.k)),
    }
    return target.tokenizer, systems, (str(target_path), str(draft_path))


def run_one(gen, prompt: list[int], max_new_tokens: int) -> dict:
    from specdec import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = gen.generate(prompt, params)
    seconds = time.perf_counter() - start
    m = out.metrics
    return {
        "token_ids": out.token_ids,
        "tokens": len(out.token_ids),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(len(out.token_ids) / seconds, 3),
        "verify_steps": m.num_verify_steps,
        "drafted": m.num_drafted,
        "accepted": m.num_accepted,
        "acceptance_rate": round(m.acceptance_rate, 4),
        "mean_accepted_length": round(m.mean_accepted_length, 4),
    }


def summary(rows: list[dict]) -> dict:
    """Per system: tokens/s over all prompts, acceptance, speedup against plain."""
    out = {}
    for name in SYSTEMS:
        tokens = sum(r[name]["tokens"] for r in rows)
        seconds = sum(r[name]["seconds"] for r in rows)
        drafted = sum(r[name]["drafted"] for r in rows)
        accepted = sum(r[name]["accepted"] for r in rows)
        steps = sum(r[name]["verify_steps"] for r in rows)
        out[name] = {
            "tokens_per_s": round(tokens / seconds, 3),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "drafted": drafted,
            "accepted": accepted,
            "verify_steps": steps,
        }
    for name in SYSTEMS:
        out[name]["speedup_vs_plain"] = round(
            out[name]["tokens_per_s"] / out["plain"]["tokens_per_s"], 4
        )
    out["all_outputs_equal_plain"] = all(r["same_as_plain"] for r in rows)
    return out


def table(payload: dict) -> str:
    s = payload["summary"]
    lines = ["| system | tokens/s | speedup vs plain | acceptance |", "|---|---|---|---|"]
    for name in SYSTEMS:
        acc = s[name]["acceptance_rate"]
        lines.append(f"| {name} | {s[name]['tokens_per_s']:.2f} | {s[name]['speedup_vs_plain']:.2f}x | "
                     f"{'-' if acc is None else f'{acc:.3f}'} |")  # fmt: skip
    lines.append(f"outputs equal to plain: {s['all_outputs_equal_plain']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (FixedPolicy)")
    ap.add_argument(
        "--draft-quantization", default="none", help="'int8' or 'q4' for a quantized draft"
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=3, help="the first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="cross-tokenizer")
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results")
    args = ap.parse_args(argv)
    if args.draft_quantization == "none":
        args.draft_quantization = None
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tokenizer, systems, paths = build(args)
    load_s = time.perf_counter() - t0
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.num_prompts)]
    for gen in systems.values():  # warm-up: kernels and lazy caches
        run_one(gen, prompts[0], 4)

    rows = []
    for i, ids in enumerate(prompts):
        order = SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]
        runs = {name: run_one(systems[name], ids, args.max_new_tokens) for name in order}
        same = all(runs[name]["token_ids"] == runs["plain"]["token_ids"] for name in SYSTEMS)
        if not same:
            print(f"!!! GREEDY MISMATCH on prompt {i}")
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(ids),
                "order": list(order),
                "same_as_plain": same,
                **runs,
            }
        )
        print(f"prompt {i}: " + ", ".join(
            f"{n} {runs[n]['tokens_per_s']:.2f} tok/s acc {runs[n]['acceptance_rate']:.2f}" for n in SYSTEMS
        ) + f", same={same}", flush=True)  # fmt: skip

    payload = {
        "machine": machine_info(),
        "settings": {
            "target": paths[0],
            "draft": paths[1],
            "k": args.k,
            "policy": "FixedPolicy",
            "draft_quantization": args.draft_quantization,
            "dtype": args.dtype,
            "threads": args.threads,
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "greedy": True,
            "load_s": round(load_s, 2),
        },
        "summary": summary(rows),
        "requests": rows,
    }
    path = write_json(args.out, payload, args.out_dir)
    print(table(payload))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
