"""specdec plain greedy decoding vs ``transformers.generate`` on the same checkpoint, one run.

Batch 1, 128 new tokens (EOS neither stops nor is masked on either side, so both do equal work
and the greedy texts are comparable), bf16 and float32,
1 and 2 threads. Systems alternate inside every repeat (and which goes first alternates too) so
machine drift hits both alike; the report is the ratio of medians with every repeat's tok/s
kept (the spread), and the greedy tokens of both systems are compared.

    python -m benchmarks.plain_decode [--target qwen2.5-coder-1.5b-instruct] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from benchmarks.common import (
    hf_model_ignoring_eos,
    humaneval_prompts,
    machine_info,
    timed,
    write_json,
)


def _specdec_run(gen, prompt_ids, n):
    from specdec import SamplingParams

    out = gen.generate(prompt_ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return out.token_ids


def _hf_run(model, prompt_ids, n):
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,  # EOS neither stops nor is masked: see hf_model_ignoring_eos
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def bench(target: str, dtype: str, threads: list[int], repeats: int, new_tokens: int, prompt: str) -> dict:
    from specdec import CacheConfig, Generator
    from specdec.hub import resolve_model

    path = resolve_model(target)
    # No prefix caching: the warm-up runs a timed prompt, and transformers' generate caches nothing:
    # with caching specdec would skip most of that prompt's prefill (unequal work).
    gen = Generator.from_pretrained(path, dtype=dtype, cache_config=CacheConfig(prefix_caching=False))
    hf = hf_model_ignoring_eos(path, dtype)
    prompt_ids = gen.encode(prompt)
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        _specdec_run(gen, prompt_ids, 8)  # warm-up both
        _hf_run(hf, prompt_ids, 8)
        times = {"specdec": [], "transformers": []}
        tokens = {}
        systems = (("specdec", lambda: _specdec_run(gen, prompt_ids, new_tokens)),
                   ("transformers", lambda: _hf_run(hf, prompt_ids, new_tokens)))
        for r in range(repeats):
            # Alternate which system runs first, so neither always inherits the other's state.
            for name, fn in systems if r % 2 == 0 else systems[::-1]:
                elapsed, toks = timed(fn)
                times[name].append(elapsed)
                tokens[name] = toks
        tps = {k: [new_tokens / s for s in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in tps.items()}
        row = {
            "dtype": dtype,
            "threads": t,
            "tokens_per_s": tps,
            "median_tokens_per_s": med,
            "ratio_specdec_over_transformers": med["specdec"] / med["transformers"],
            "same_greedy_tokens": tokens["specdec"] == tokens["transformers"],
            "first_divergence": next(
                (i for i, (a, b) in enumerate(zip(tokens["specdec"], tokens["transformers"])) if a != b),
                None,
            ),
        }
        print(row, flush=True)
        rows.append(row)
    gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    prompt = humaneval_prompts(1)[0]
    rows = []
    for dtype in args.dtypes.split(","):
        rows += bench(args.target, dtype, [int(t) for t in args.threads.split(",")], args.repeats, args.new_tokens, prompt)
    path = write_json(
        "plain_decode",
        {"machine": machine_info(), "target": args.target, "batch_size": 1, "new_tokens": args.new_tokens,
         "prompt": "HumanEval/0", "repeats": args.repeats, "rows": rows},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
