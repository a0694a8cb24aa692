"""Resident memory of a model loaded in bf16, int8 and 4-bit, each in a fresh process.

For each format a child process imports specdec, reads its resident set size (``VmRSS``),
loads the model with ``load_model`` (from the on-disk cache of packed / quantized models once it
exists: the first load of a format quantizes and writes it), reads it again (the model's
memory), then builds a Generator (its KV cache, default ``CacheConfig``) and generates 16
tokens, and reads it once more. Also reported: the bytes of the model's tensors
(each storage once: a tied embedding and LM head count once).

    python -m benchmarks.quant_memory --model qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine_info, write_json

_CHILD = r"""
import json, sys
import torch
from specdec import Generator, SamplingParams
from specdec.models.loading import load_model

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

path, quantization = sys.argv[1], (sys.argv[2] if sys.argv[2] != "none" else None)
torch.set_num_threads(1)
before = rss()
model, _, _ = load_model(path, quantization=quantization)
loaded = rss()
gen = Generator.from_components(model)  # allocates its KV cache (default CacheConfig)
seen, tensor_bytes = set(), 0
for t in list(gen.target.parameters()) + list(gen.target.buffers()):
    key = t.untyped_storage().data_ptr()
    if key not in seen:
        seen.add(key)
        tensor_bytes += t.untyped_storage().nbytes()
gen.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=16, ignore_eos=True))
print(json.dumps({"rss_before_load": before, "rss_after_load": loaded, "rss_after_generate": rss(),
                  "tensor_bytes": tensor_bytes}))
"""


def measure(path: str, quantization: str | None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, quantization or "none"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    gb = {k: v / 1e9 for k, v in raw.items()}
    gb["model_rss"] = gb["rss_after_load"] - gb["rss_before_load"]
    return gb


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--formats", default="bfloat16,int8,q4")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    from specdec.hub import resolve_model

    path = args.model if Path(args.model).exists() else str(resolve_model(args.model))
    results = {}
    for fmt in args.formats.split(","):
        results[fmt] = measure(path, None if fmt == "bfloat16" else fmt)
        r = results[fmt]
        print(f"{fmt}: tensors {r['tensor_bytes']:.3f} GB, RSS +{r['model_rss']:.3f} GB by the load, "
              f"{r['rss_after_generate']:.3f} GB in all with a Generator's KV cache, after generating", flush=True)
    payload = {"machine": machine_info(), "model": args.model, "results_gb": results}
    write_json(f"quant-memory-{Path(args.model).name.replace('.', '')}", payload, args.out_dir)
    return payload


if __name__ == "__main__":
    main()
