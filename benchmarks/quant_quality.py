"""How much a quantized model differs from its bf16 self: top-1 agreement and perplexity.

- **Agreement**: the bf16 model continues HumanEval prompts greedily (``--tokens`` each); every
  model then reads prompt + continuation in one teacher-forced pass, and the benchmark counts
  the continuation positions where the quantized model's top-1 token equals the bf16 model's.
- **Perplexity** on Python standard-library source text (``--ppl-files``; text no model here
  was tuned on by specdec): ``--ppl-chunks`` chunks of ``--chunk-len`` tokens, all models on
  the same tokens.

Both passes run through specdec's own inference path (batched prefill over the paged KV
cache), with the same kernels decoding uses. Writes ``benchmarks/results/quant-quality-*.json``.

    python -m benchmarks.quant_quality --model qwen2.5-coder-1.5b-instruct --threads 2
"""

from __future__ import annotations

import argparse
import gc
import math
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.common import humaneval_prompts, machine_info, write_json

DEFAULT_PPL_FILES = ("textwrap.py", "difflib.py", "argparse.py", "inspect.py")


def _logits(model, tokens: list[int]) -> torch.Tensor:  # [T, vocab] float32
    from specdec.training.features import batch_hidden_states

    hidden = batch_hidden_states(model, [tokens])[0]  # [T, hidden]
    with torch.inference_mode():
        return model.logits(hidden).float()


def _continuations(path: str, prompts: list[str], tokens: int) -> tuple[list[list[int]], list[int]]:
    """bf16 greedy continuations: ``(prompt + continuation token rows, prompt lengths)``."""
    from specdec import Generator, SamplingParams

    gen = Generator.from_pretrained(path)
    ids = [gen.tokenizer.encode(p) for p in prompts]
    outs = gen.generate(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    rows = [list(i) + list(o.token_ids) for i, o in zip(ids, outs)]
    return rows, [len(i) for i in ids]


def _ppl_chunks(tokenizer, files: list[str], chunks: int, chunk_len: int) -> list[list[int]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in files:
        ids += tokenizer.encode((stdlib / name).read_text())
        if len(ids) >= chunks * chunk_len:
            break
    if len(ids) < chunks * chunk_len:
        raise ValueError(f"--ppl-files hold {len(ids)} tokens, fewer than {chunks} x {chunk_len}")
    return [ids[i * chunk_len : (i + 1) * chunk_len] for i in range(chunks)]


def _measure(model, rows, prompt_lens, chunks) -> dict[str, object]:
    """Top-1 tokens over each continuation and the summed NLL over the perplexity chunks."""
    top1 = []
    for row, n in zip(rows, prompt_lens):
        top1.append(_logits(model, row)[n - 1 : len(row) - 1].argmax(-1))  # predicts row[n:]
    nll, count = 0.0, 0
    for chunk in chunks:
        logp = torch.log_softmax(_logits(model, chunk)[:-1], dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(chunk) - 1
    return {"top1": top1, "nll": nll, "count": count}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--quantizations", default="int8,q4")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ppl-files", default=",".join(DEFAULT_PPL_FILES))
    parser.add_argument("--ppl-chunks", type=int, default=8)
    parser.add_argument("--chunk-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdec.codec import load_tokenizer
    from specdec.hub import resolve_model
    from specdec.models.loading import load_model

    path = str(resolve_model(args.model)) if not Path(args.model).exists() else args.model
    t0 = time.perf_counter()
    rows, prompt_lens = _continuations(path, humaneval_prompts(args.num_prompts), args.tokens)
    chunks = _ppl_chunks(load_tokenizer(Path(path)), args.ppl_files.split(","), args.ppl_chunks, args.chunk_len)
    results: dict[str, dict[str, object]] = {}
    reference = None
    for quantization in [None, *[q for q in args.quantizations.split(",") if q]]:
        model, _, _ = load_model(path, quantization=quantization)
        measured = _measure(model, rows, prompt_lens, chunks)
        del model
        gc.collect()
        name = quantization or "bfloat16"
        if reference is None:
            reference = measured
        agree = sum(int((a == b).sum()) for a, b in zip(measured["top1"], reference["top1"]))
        total = sum(len(a) for a in reference["top1"])
        ppl = math.exp(measured["nll"] / measured["count"])
        results[name] = {
            "top1_agreement": agree / total,
            "positions": total,
            "perplexity": ppl,
            "perplexity_vs_bf16": ppl / math.exp(reference["nll"] / reference["count"]),
        }
        print(f"{name}: top-1 agreement {agree / total:.4f} over {total} positions, perplexity {ppl:.4f}", flush=True)
    payload = {
        "machine": machine_info(),
        "model": args.model,
        "config": vars(args),
        "ppl_tokens": sum(len(c) - 1 for c in chunks),
        "results": results,
        "seconds": time.perf_counter() - t0,
    }
    slug = Path(args.model).name.replace(".", "")
    write_json(f"quant-quality-{slug}", payload, args.out_dir)
    return payload


if __name__ == "__main__":
    main()
