"""The transformers adapter's speed against transformers' own ``generate`` (and the native path).

One transformers model object, used by every system without a copy:

- ``hf-generate``: ``model.generate`` (greedy, its own dynamic KV cache), one prompt at a time;
- ``adapter``: specdec's engine over the same object (``model_impl="transformers"``: the
  model's own forward, specdec's paged KV), plain decoding;
- ``adapter+lookup``: the same with prompt lookup (k = 4, default adaptive policy);
- ``native`` (Qwen only): specdec's own decoder on the same checkpoint, plain (what a native
  family gains over the adapter).

Models: ``qwen`` = Qwen2.5-Coder-0.5B-Instruct (real weights, HumanEval prompts), ``gpt2`` = a
GPT-2-small shape (124M) with random weights and random prompts (no native family: the adapter
is its only path). Greedy, ``--max-new-tokens`` per prompt; the systems take turns going first;
outputs are compared with ``hf-generate``'s.

Writes ``benchmarks/results/adapter-<UTC stamp>.json`` (and ``-latest``):

    taskset -c 0 python -m benchmarks.adapter [--models qwen,gpt2] [--num-prompts 3] [--max-new-tokens 64]
    # smoke test: --models gpt2 --num-prompts 1 --max-new-tokens 4 --out-dir /tmp/adapter
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch

from benchmarks.common import hf_model_ignoring_eos, humaneval_prompts, machine_info, write_json


def _gpt2_small(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to(dtype).eval()  # GPT-2 small: 12 x 768, 50257 words
    model.generation_config.eos_token_id = None
    return model


def build(name: str, args) -> tuple[torch.nn.Module, dict, list[list[int]], str]:
    """(the transformers model, specdec generators by system, prompts, model description)."""
    from specdec import CacheConfig, Generator
    from specdec.hub import resolve_model
    from specdec.proposers import PromptLookup

    dtype = getattr(torch, args.dtype)
    # GPT-2's whole context is 1024 tokens: its KV sized by it.
    # No prefix caching: the warm-up runs a timed prompt, and transformers' generate caches nothing:
    # with caching specdec would skip most of that prompt's prefill (unequal work).
    cache = CacheConfig(
        max_batch_size=1,
        max_model_len=1024 + args.max_new_tokens if name == "qwen" else None,
        prefix_caching=False,
    )
    if name == "qwen":
        path = resolve_model(args.qwen)
        hf = hf_model_ignoring_eos(path, args.dtype)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok.encode(p) for p in humaneval_prompts(args.num_prompts)]
        described = str(path)
    else:
        hf, tok = _gpt2_small(dtype), None
        g = torch.Generator().manual_seed(1)
        prompts = [(torch.randint(0, 50257, (40,), generator=g).tolist() * 3)[:100] for _ in range(args.num_prompts)]
        described = "GPT-2 small shape (124M), random weights"
    adapter = Generator.from_pretrained(hf, tokenizer=tok, cache_config=cache, model_impl="transformers")
    systems = {
        "adapter": adapter,
        "adapter+lookup": adapter.with_proposer(PromptLookup(num_speculative_tokens=4), cache_config=cache),
    }
    if name == "qwen":
        systems["native"] = Generator.from_pretrained(path, dtype=args.dtype, cache_config=cache)
    return hf, systems, prompts, described


def hf_run(hf, prompt: list[int], n: int) -> dict:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0)  # fmt: skip
    seconds = time.perf_counter() - start
    tokens = out[0, len(prompt) :].tolist()
    return {"token_ids": tokens, "tokens": len(tokens), "seconds": round(seconds, 4)}


def specdec_run(gen, prompt: list[int], n: int) -> dict:
    from specdec import SamplingParams

    start = time.perf_counter()
    out = gen.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    seconds = time.perf_counter() - start
    m = out.metrics
    return {"token_ids": out.token_ids, "tokens": len(out.token_ids), "seconds": round(seconds, 4),
            "drafted": m.num_drafted, "accepted": m.num_accepted}  # fmt: skip


def run_model(name: str, args) -> dict:
    hf, systems, prompts, described = build(name, args)
    names = ("hf-generate", *systems)
    run = {"hf-generate": lambda p, n: hf_run(hf, p, n)}
    run.update({s: functools.partial(specdec_run, g) for s, g in systems.items()})
    for s in names:  # warm-up
        run[s](prompts[0], 4)
    rows = []
    for i, ids in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        runs = {s: run[s](ids, args.max_new_tokens) for s in order}
        ref = runs["hf-generate"]["token_ids"]
        rows.append({"prompt": i, "prompt_tokens": len(ids), "order": list(order), **runs,
                     "same_as_hf": {s: runs[s]["token_ids"] == ref for s in names}})  # fmt: skip
        print(f"{name} prompt {i}: " + ", ".join(
            f"{s} {runs[s]['tokens'] / runs[s]['seconds']:.2f} tok/s" for s in names), flush=True)  # fmt: skip
    summary = {}
    for s in names:
        tokens = sum(r[s]["tokens"] for r in rows)
        seconds = sum(r[s]["seconds"] for r in rows)
        summary[s] = {"tokens_per_s": round(tokens / seconds, 3)}
        drafted = sum(r[s].get("drafted", 0) for r in rows)
        if drafted:
            summary[s]["acceptance_rate"] = round(sum(r[s]["accepted"] for r in rows) / drafted, 4)
        summary[s]["same_as_hf_generate"] = sum(r["same_as_hf"][s] for r in rows)
    for s in names:
        summary[s]["vs_hf_generate"] = round(summary[s]["tokens_per_s"] / summary["hf-generate"]["tokens_per_s"], 4)
    return {"model": described, "summary": summary, "requests": rows, "num_prompts": len(rows)}


def table(results: dict) -> str:
    lines = ["| model | system | tokens/s | vs transformers generate | same output as generate |", "|---|---|---|---|---|"]
    for name, res in results.items():
        for s, row in res["summary"].items():
            lines.append(f"| {name} | {s} | {row['tokens_per_s']:.2f} | {row['vs_hf_generate']:.2f}x | "
                         f"{row['same_as_hf_generate']}/{res['num_prompts']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,gpt2", help="comma-separated: qwen, gpt2")
    ap.add_argument("--qwen", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="adapter")
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {name: run_model(name, args) for name in args.models.split(",")}
    payload = {
        "machine": machine_info(),
        "settings": {"dtype": args.dtype, "threads": args.threads, "num_prompts": args.num_prompts,
                     "max_new_tokens": args.max_new_tokens, "greedy": True, "batch": 1},  # fmt: skip
        "results": results,
    }
    path = write_json(args.out, payload, args.out_dir)
    print(table(results))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
