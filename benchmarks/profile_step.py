"""Where the time of a decode step goes: per model, per pass width, per kind of work.

Runs greedy generation (batch 1, HumanEval prompts) plain and with the draft model at a fixed
k (its linear layers in bf16, and in int8), with timers wrapped around the model's parts (this script patches classes in its own
process only), and reports milliseconds per forward for each (model, rows) pass:

- ``linear``: the projections and the LM head (packed kernel or ``nn.Linear``),
- ``attention``: KV write + paged attention (``backend.run``),
- ``plan``: the attention plan built once per forward (indices, masks),
- ``norm``/``rope``: RMSNorm and rotary embedding,
- ``other``: everything else inside the forward (residual adds, activations, views, Python),

next to the forward's weight-read floor (weight bytes / read bandwidth measured in the same
run) and, per engine step, the time outside model forwards (sampling, verification,
bookkeeping). The parts are timed on the Python loop over layers; ``tokens_per_s_decoder_kernel``
is the same generation with every layer in one kernel call (the default on CPUs), untimed.

    python -m benchmarks.profile_step [--threads 1] [--k 4] [--tokens 64] [--prompts 2]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch

from benchmarks.bandwidth import read_bandwidth, weight_bytes
from benchmarks.common import humaneval_prompts, machine_info, write_json

PARTS = ("linear", "attention", "plan", "norm", "rope")


class Profiler:
    """Accumulates wall time per (model, rows, part) while patches are installed."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, int, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, int], int] = defaultdict(int)
        self.step_time = 0.0
        self.steps = 0
        self.forward_time = 0.0
        self._model: tuple[str, int] | None = None
        self._pending_plan = 0.0
        self._inside: set[str] = set()
        self._names: dict[int, str] = {}

    def name(self, model, label: str) -> None:
        self._names[id(model)] = label

    @contextlib.contextmanager
    def installed(self):
        from specdec.attention.cpu_backend import CpuAttentionBackend
        from specdec.attention.torch_backend import TorchAttentionBackend
        from specdec.engine import Engine
        from specdec.models import llama
        from specdec.models.packed import PackedLinear
        from specdec.models.quantized import Int8Linear, Q4Linear

        patches = [
            (PackedLinear, "forward", self._part("linear")),
            (Int8Linear, "forward", self._part("linear")),
            (Q4Linear, "forward", self._part("linear")),
            (torch.nn.Linear, "forward", self._part("linear")),
            (TorchAttentionBackend, "run", self._part("attention")),
            (TorchAttentionBackend, "plan", self._part("plan")),
            (CpuAttentionBackend, "run", self._part("attention")),
            (CpuAttentionBackend, "plan", self._part("plan")),
            (llama.RMSNorm, "forward", self._part("norm")),
            (llama, "apply_rope", self._part("rope")),
            (llama.LlamaModel, "rope", self._part("rope")),
            (llama.LlamaModel, "forward", self._forward),
            (Engine, "step", self._step),
        ]
        originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
        try:
            for owner, attr, make in patches:
                setattr(owner, attr, make(getattr(owner, attr)))
            yield self
        finally:
            for owner, attr, fn in originals:
                setattr(owner, attr, fn)

    def _part(self, part: str):
        def make(fn):
            def wrapped(*args, **kwargs):
                if part in self._inside:  # a subclass calling its base: timed once, outside
                    return fn(*args, **kwargs)
                self._inside.add(part)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._inside.discard(part)
                    # plan runs before the model's forward (outside it): charge the model that runs next
                    if self._model is not None:
                        self.totals[(*self._model, part)] += time.perf_counter() - start
                    elif part == "plan":
                        self._pending_plan = time.perf_counter() - start

            return wrapped

        return make

    def _forward(self, fn):
        def wrapped(model, layout, *args, **kwargs):
            key = (self._names.get(id(model), "model"), int(layout.token_ids.numel()))
            self._model = key
            start = time.perf_counter()
            try:
                return fn(model, layout, *args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._model = None
                self.totals[(*key, "total")] += elapsed
                self.totals[(*key, "plan")] += getattr(self, "_pending_plan", 0.0)
                self._pending_plan = 0.0
                self.calls[key] += 1
                self.forward_time += elapsed

        return wrapped

    def _step(self, fn):
        def wrapped(engine, *args, **kwargs):
            start = time.perf_counter()
            forwards = self.forward_time
            try:
                return fn(engine, *args, **kwargs)
            finally:
                self.step_time += (time.perf_counter() - start) - (self.forward_time - forwards)
                self.steps += 1

        return wrapped

    def table(self, bounds: dict[str, float]) -> list[dict]:
        rows = []
        for (model, n), calls in sorted(self.calls.items()):
            ms = {p: 1e3 * self.totals[(model, n, p)] / calls for p in (*PARTS, "total")}
            # plan is built outside the forward: add it to the pass's cost
            total = ms["total"] + ms["plan"]
            other = ms["total"] - sum(ms[p] for p in PARTS if p != "plan")
            rows.append({
                "model": model, "rows": n, "calls": calls, "ms_total": total,
                **{f"ms_{p}": ms[p] for p in PARTS}, "ms_other": other,
                "ms_bound": 1e3 * bounds[model],
                "fraction_of_bound": bounds[model] * 1e3 / total,
            })
        return rows


@contextlib.contextmanager
def _python_layers():
    """The Python loop over layers, whose parts the patches can time (the decoder kernel of
    :mod:`specdec.models.cpu_decoder` runs every layer in one call, out of their sight)."""
    import os

    saved = os.environ.get("SPECDEC_DISABLE_CPU_DECODER")
    os.environ["SPECDEC_DISABLE_CPU_DECODER"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SPECDEC_DISABLE_CPU_DECODER"]
        else:
            os.environ["SPECDEC_DISABLE_CPU_DECODER"] = saved


def run(
    target: str, draft: str, threads: int, k: int, tokens: int, prompts: int,
    quantization: str | None = None, draft_formats: tuple[str, ...] = ("bfloat16", "int8"),
) -> dict:  # fmt: skip
    from specdec import FixedPolicy, Generator, SamplingParams
    from specdec.hub import resolve_model
    from specdec.proposers import DraftModel

    torch.set_num_threads(threads)
    plain = Generator.from_pretrained(resolve_model(target), quantization=quantization)
    drafters = {
        "draft" if fmt == "bfloat16" else f"draft-{fmt}": DraftModel.from_pretrained(
            resolve_model(draft), num_speculative_tokens=k,
            quantization=None if fmt == "bfloat16" else fmt,
        )  # fmt: skip
        for fmt in draft_formats
    }
    gens = {"plain": plain} | {
        f"{name}-k{k}": plain.with_proposer(d, policy=FixedPolicy(k)) for name, d in drafters.items()
    }
    bandwidth = read_bandwidth()
    bounds = {"target": weight_bytes(plain.engine.target) / bandwidth} | {
        name: weight_bytes(d.model) / bandwidth for name, d in drafters.items()
    }
    texts = humaneval_prompts(prompts)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    for gen in gens.values():
        gen.generate(texts[0], SamplingParams(max_new_tokens=4))  # warm-up
    report = {}
    for label, gen in gens.items():
        prof = Profiler()
        prof.name(plain.engine.target, "target")
        for name, d in drafters.items():
            prof.name(d.model, name)
        with prof.installed(), _python_layers():
            start = time.perf_counter()
            n = sum(len(gen.generate(t, params).token_ids) for t in texts)
            wall = time.perf_counter() - start
        start = time.perf_counter()
        n_kernel = sum(len(gen.generate(t, params).token_ids) for t in texts)
        wall_kernel = time.perf_counter() - start
        report[label] = {
            "tokens_per_s": n / wall,
            "tokens_per_s_decoder_kernel": n_kernel / wall_kernel,
            "engine_ms_per_step_outside_forwards": 1e3 * prof.step_time / max(prof.steps, 1),
            "steps": prof.steps,
            "tokens_per_step": n / max(prof.steps, 1),
            "passes": prof.table(bounds),
        }
    return {"threads": threads, "target_quantization": quantization, "read_bandwidth_gb_s": bandwidth / 1e9, "bounds_ms": {
        m: 1e3 * b for m, b in bounds.items()}, "runs": report}


def markdown(result: dict) -> str:
    lines = [
        f"{result['threads']} thread(s), read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s",
        "",
        "| run | model | rows | ms/pass | floor | of floor | linear | attention | plan | norm | rope | other |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, run_ in result["runs"].items():
        for p in run_["passes"]:
            if p["calls"] < 3:
                continue  # prefill passes and rare widths
            lines.append(
                f"| {label} | {p['model']} | {p['rows']} | {p['ms_total']:.1f} | {p['ms_bound']:.1f} | "
                f"{p['fraction_of_bound']:.0%} | {p['ms_linear']:.1f} | {p['ms_attention']:.1f} | "
                f"{p['ms_plan']:.1f} | {p['ms_norm']:.1f} | {p['ms_rope']:.1f} | {p['ms_other']:.1f} |"
            )
        lines.append(
            f"| {label} | engine (outside forwards) | | {run_['engine_ms_per_step_outside_forwards']:.1f} "
            f"per step | | | | | | | | |"
        )
        lines.append(
            f"| {label} | whole run | | {run_['tokens_per_s']:.2f} tok/s timed, "
            f"{run_['tokens_per_s_decoder_kernel']:.2f} with the decoder kernel, "
            f"{run_['tokens_per_step']:.2f} tokens per step | | | | | | | | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--quantization", choices=("int8", "q4"), default=None, help="the target's weights")
    parser.add_argument("--draft-formats", default="bfloat16,int8", help="drafts to profile (bfloat16, int8, q4)")
    args = parser.parse_args()
    results = []
    for t in (int(x) for x in args.threads.split(",")):
        result = run(args.target, args.draft, t, args.k, args.tokens, args.prompts,
                     args.quantization, tuple(args.draft_formats.split(",")))  # fmt: skip
        print(markdown(result), flush=True)
        results.append(result)
    write_json("profile_step", {"machine": machine_info(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
