"""Throughput under batching: plain decoding vs speculation with a fixed k vs the adaptive policy.

For each batch size b, b different HumanEval prompts are submitted together and decoded
greedily to exactly ``--max-new-tokens`` tokens each (EOS ignored). Systems:

    plain      Generator without a proposer (the baseline every ratio refers to)
    adaptive   Generator + DraftModel(draft, k = --max-k), default policy (AdaptivePolicy)
    fixed-<k>  Generator + DraftModel(draft, k = --max-k), FixedPolicy(k), for k in --fixed-k
    hybrid     Generator + SuffixHybrid(DraftModel(draft, k = --max-k), SuffixDecoding(16)),
               default policy: the controller (who drafts per request and step, and how much);
               on fresh prompts it should cost nothing against plain (--no-hybrid: left out)

Every system is one generator for the whole run (one target model shared by all of them), so
the adaptive policy carries what it measured from batch size to batch size and from request to
request, as it would in a server. Before the timed runs of each batch size every system runs
once on the same prompts with ``--warmup-tokens`` tokens (the adaptive policy's first exposure
to a batch size, including its exploration, falls there). Timed runs: ``--repeats`` of them.

In every run (warm-up or timed) all systems run at once: their requests are submitted
together and their engines are stepped in turn, one step each per round, each step timed alone
(:func:`run_interleaved`); machine drift hits all systems alike. A system's time is the sum of
its own steps: ``seconds`` (all of them), ``prefill_s`` (the first, which admits and prefills
all b prompts) and ``decode_s`` (the rest, which includes the draft model catching up on the
prompts). Reported: tokens/s over the whole run and
over the decode phase, ratios to plain, the adaptive policy's k histogram (decode steps per
chosen k, summed over requests), and whether every greedy output equals plain's.

    python -m benchmarks.throughput                       # the README table (~25 min, 1 thread)
    python -m benchmarks.throughput --batch-sizes 1,4 --max-new-tokens 32 --out-dir /tmp/tp
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from benchmarks.common import RESULTS, humaneval_prompts, machine_info, write_json

PLAIN = "plain"
ADAPTIVE = "adaptive"
HYBRID = "hybrid"


@attrs.frozen(kw_only=True)
class ThroughputConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    max_new_tokens: int = 48
    max_k: int = 5
    fixed_k: tuple[int, ...] = (1, 3, 5)
    # Fewer fixed ks at large batch sizes, for runtime: there every verify row costs about a
    # full target row on a CPU. Batch sizes not named run every k of fixed_k.
    fixed_k_by_batch: dict[int, tuple[int, ...]] = attrs.field(
        factory=lambda: {16: (1, 3), 32: (1,)}
    )
    prompt_tokens: int = 32  # keep each prompt's first N tokens (0: whole prompts)
    repeats: int = 1
    warmup_tokens: int = 8
    warmup_prompt_tokens: int = 16
    threads: int = 1
    dtype: str = "bfloat16"
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    goal_ratio: float = 0.95
    hybrid: bool = True
    out: str = "throughput"
    out_dir: str = str(RESULTS)

    def __attrs_post_init__(self) -> None:
        for name in ("max_new_tokens", "max_k", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        ks = [*self.fixed_k, *(k for v in self.fixed_k_by_batch.values() for k in v)]
        if any(b < 1 for b in self.batch_sizes) or any(not 1 <= k <= self.max_k for k in ks):
            raise ValueError("--batch-sizes must be >= 1 and fixed ks in 1..--max-k")

    def systems(self, batch: int) -> list[str]:
        ks = self.fixed_k_by_batch.get(batch, self.fixed_k)
        return [PLAIN, ADAPTIVE, *([HYBRID] if self.hybrid else []), *(f"fixed-{k}" for k in ks)]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_generators(cfg: ThroughputConfig, longest_prompt: int):
    """One generator per system, all on one target model; each has its own KV cache."""
    from specdec import CacheConfig, FixedPolicy, Generator
    from specdec.hub import resolve_model
    from specdec.proposers import DraftModel, SuffixDecoding, SuffixHybrid

    target_path, draft_path = resolve_model(cfg.target), resolve_model(cfg.draft)
    # No prefix caching: the warm-up's prompts are the timed prompts' first page, and a
    # generator whose draft model did not run (the policy chose k = 0) keys no pages, so with
    # caching some systems would skip part of each prefill and others not: unequal work.
    cache = CacheConfig(
        max_batch_size=max(cfg.batch_sizes),
        max_model_len=longest_prompt + cfg.max_new_tokens,
        prefix_caching=False,
    )
    plain = Generator.from_pretrained(target_path, dtype=cfg.dtype, cache_config=cache)
    draft_model = DraftModel.from_pretrained(draft_path, dtype=cfg.dtype).model

    def draft():
        return DraftModel.from_model(draft_model, num_speculative_tokens=cfg.max_k)

    gens = {PLAIN: plain, ADAPTIVE: plain.with_proposer(draft(), cache_config=cache)}
    if cfg.hybrid:
        hybrid = SuffixHybrid(draft(), SuffixDecoding(num_speculative_tokens=16))
        gens[HYBRID] = plain.with_proposer(hybrid, cache_config=cache)
    by_batch = {k for ks in cfg.fixed_k_by_batch.values() for k in ks}
    for k in sorted(set(cfg.fixed_k) | by_batch):
        gens[f"fixed-{k}"] = plain.with_proposer(draft(), cache_config=cache, policy=FixedPolicy(k))
    return gens, {"target": str(target_path), "draft": str(draft_path)}


def run_interleaved(gens: dict, names: Sequence[str], prompts, new_tokens: int) -> dict[str, dict]:
    """Run every named system on ``prompts`` at once, stepping their engines in turn.

    All systems' requests are submitted first; then each round steps every unfinished system
    once (the order rotating by one per round) and times that step alone. So every system's
    run is timed by its own steps, while all of them share the same stretch of wall-clock time:
    drift on a shared machine (other jobs, thermal state) hits them alike, step by step.
    """
    from specdec import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    handles = {n: [gens[n].submit(list(p), params) for p in prompts] for n in names}
    steps: dict[str, list[float]] = {n: [] for n in names}
    active, rnd = list(names), 0
    while active:
        shift = rnd % len(active)
        for name in active[shift:] + active[:shift]:
            start = time.perf_counter()
            gens[name].step()
            steps[name].append(time.perf_counter() - start)
        active = [n for n in active if gens[n].scheduler.has_unfinished()]
        rnd += 1
    return {n: _record([h.result() for h in handles[n]], steps[n]) for n in names}


def _record(outs, steps: list[float]) -> dict:
    hist: Counter[int] = Counter()
    drafted = accepted = verify_steps = emitted = 0
    for o in outs:
        hist.update(o.metrics.k_histogram)
        drafted += o.metrics.num_drafted
        accepted += o.metrics.num_accepted
        verify_steps += o.metrics.num_verify_steps
        emitted += o.metrics.num_emitted_in_verify
    tokens = sum(len(o.token_ids) for o in outs)
    seconds = sum(steps)
    decode_s = sum(steps[1:])
    return {
        "seconds": seconds,
        "prefill_s": steps[0],
        "decode_s": decode_s,
        "num_steps": len(steps),
        "num_new_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        # The first step admits and prefills every prompt and emits one token per request.
        "decode_tokens_per_s": (tokens - len(outs)) / decode_s if decode_s > 0 else None,
        "k_histogram": dict(sorted(hist.items())),
        "num_drafted": drafted,
        "num_accepted": accepted,
        "mean_accepted_length": emitted / verify_steps if verify_steps else None,
        "output_token_ids": [list(o.token_ids) for o in outs],
    }


def run_grid(cfg: ThroughputConfig) -> dict:
    from transformers import AutoTokenizer

    from specdec.hub import resolve_model

    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(cfg.target)))
    texts = humaneval_prompts(max(cfg.batch_sizes))
    prompts = [tokenizer.encode(t)[: cfg.prompt_tokens or None] for t in texts]
    gens, models = build_generators(cfg, max(len(p) for p in prompts))
    runs, warmups = [], []
    for batch in cfg.batch_sizes:
        batch_prompts = prompts[:batch]
        systems = cfg.systems(batch)
        # Each system once at this batch size, on the same prompts cut shorter (prefill is the
        # slow part on a CPU): kernels and KV pages warm, and the adaptive policy's first
        # exposure to the batch size, exploration included, happens here.
        warm_prompts = [p[: cfg.warmup_prompt_tokens] for p in batch_prompts]
        for name, warm in run_interleaved(gens, systems, warm_prompts, cfg.warmup_tokens).items():
            warm.update(system=name, batch_size=batch)
            del warm["output_token_ids"]
            warmups.append(warm)
            _log(f"b={batch:<3d} warm-up {name:9s}{warm['seconds']:7.1f} s k {warm['k_histogram']}")
        for repeat in range(cfg.repeats):
            shift = repeat % len(systems)
            order = systems[shift:] + systems[:shift]
            rows = run_interleaved(gens, order, batch_prompts, cfg.max_new_tokens)
            for name, row in rows.items():
                row.update(system=name, batch_size=batch, repeat=repeat)
                _log(
                    f"b={batch:<3d} r={repeat} {name:9s} {row['tokens_per_s']:7.2f} tok/s "
                    f"(decode {row['decode_tokens_per_s']:7.2f}) {row['seconds']:7.1f} s  "
                    f"k {row['k_histogram']}"
                )
                runs.append(row)
    _check_against_plain(runs)
    summary = summarize(runs)
    adaptive = gens[ADAPTIVE].policy
    return {
        "machine": machine_info(),
        "threads": cfg.threads,
        "dtype": cfg.dtype,
        "config": attrs.asdict(cfg),
        "models": models,
        "prompts": {
            "set": "humaneval (raw completion prompts, target tokenizer)",
            "ids": [f"HumanEval/{i}" for i in range(len(prompts))],
            "lengths": [len(p) for p in prompts],
        },
        "warmups": warmups,
        "runs": runs,
        "summary": summary,
        "goal": goal_check(summary, cfg.goal_ratio),
        "adaptive_policy": {
            "config": attrs.asdict(adaptive.config),
            "global_acceptance": adaptive.global_acceptance(),
            "target_cost_points": _points(adaptive.target_cost),
            "draft_cost_points": _points(adaptive.draft_cost),
        },
    }


def _points(curve) -> list[list[float]]:
    """[size, seconds] of a cost curve's points (as measured, before monotone smoothing)."""
    return [[x, y] for x, y in sorted(curve._points.values())]


def _check_against_plain(runs: list[dict]) -> None:
    ref = {
        (r["batch_size"], r["repeat"]): r["output_token_ids"] for r in runs if r["system"] == PLAIN
    }
    for r in runs:
        want = ref.get((r["batch_size"], r["repeat"]))
        r["matches_plain"] = None if want is None else r["output_token_ids"] == want
        r["first_divergence"] = next(
            (
                (i, j)
                for i, (out, exp) in enumerate(zip(r["output_token_ids"], want or []))
                for j, (a, b) in enumerate(zip(out, exp))
                if a != b
            ),
            None,
        )


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (batch size, system): medians over repeats and ratios to plain's medians."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["batch_size"], r["system"]), []).append(r)
    out = []
    for (batch, system), rs in groups.items():
        plain = groups.get((batch, PLAIN), [])
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        dtps = statistics.median(r["decode_tokens_per_s"] for r in rs)
        plain_tps = statistics.median(r["tokens_per_s"] for r in plain) if plain else None
        plain_dtps = statistics.median(r["decode_tokens_per_s"] for r in plain) if plain else None
        hist: Counter[int] = Counter()
        for r in rs:
            hist.update(r["k_histogram"])
        steps = sum(hist.values())
        checked = [r["matches_plain"] for r in rs if r["matches_plain"] is not None]
        out.append(
            {
                "batch_size": batch,
                "system": system,
                "num_runs": len(rs),
                "median_tokens_per_s": tps,
                "median_decode_tokens_per_s": dtps,
                "vs_plain": tps / plain_tps if plain_tps else None,
                "decode_vs_plain": dtps / plain_dtps if plain_dtps else None,
                "k_histogram": dict(sorted(hist.items())),
                "mean_k": sum(k * n for k, n in hist.items()) / steps if steps else 0.0,
                "mean_accepted_length": statistics.fmean(
                    r["mean_accepted_length"] for r in rs if r["mean_accepted_length"]
                )
                if any(r["mean_accepted_length"] for r in rs)
                else None,
                "matches_plain": all(checked) if checked else None,
            }
        )
    order = {PLAIN: 0, ADAPTIVE: 1, HYBRID: 2}
    out.sort(key=lambda s: (s["batch_size"], order.get(s["system"], 2), s["system"]))
    return out


def goal_check(summary: list[dict], ratio: float) -> dict:
    """The issues' goals: adaptive (and the hybrid controller) >= ratio x plain at every batch
    size, and > plain at batch 1."""
    rows = {s["batch_size"]: s for s in summary if s["system"] == ADAPTIVE}
    worst = min((min(s["vs_plain"], s["decode_vs_plain"]) for s in rows.values()), default=None)
    hybrid = [s["vs_plain"] for s in summary if s["system"] == HYBRID]
    at_1 = rows.get(1)
    return {
        "ratio": ratio,
        "adaptive_min_vs_plain": worst,
        "never_below_ratio": worst is not None and worst >= ratio,
        "hybrid_min_vs_plain": min(hybrid, default=None),
        "beats_plain_at_batch_1": None if at_1 is None else at_1["vs_plain"] > 1.0,
        "all_outputs_match_plain": all(s["matches_plain"] is not False for s in summary),
    }


TABLE_COLUMNS = (
    "batch",
    "system",
    "tok/s",
    "× plain",
    "decode tok/s",
    "decode × plain",
    "k histogram (decode steps)",
    "mean acc. len",
    "= plain",
)


def markdown_table(summary: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for s in summary:
        hist = s["k_histogram"]
        cells = [
            str(s["batch_size"]),
            s["system"],
            f"{s['median_tokens_per_s']:.2f}",
            f"{s['vs_plain']:.2f}×" if s["vs_plain"] else "",
            f"{s['median_decode_tokens_per_s']:.2f}",
            f"{s['decode_vs_plain']:.2f}×" if s["decode_vs_plain"] else "",
            ", ".join(f"{k}: {n}" for k, n in hist.items()) if s["system"] in (ADAPTIVE, HYBRID) else "",
            "" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}",
            {True: "yes", False: "NO", None: "n/a"}[s["matches_plain"]],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x.strip())


def _by_batch(text: str) -> dict[int, tuple[int, ...]]:
    out = {}
    for item in text.split():
        batch, _, ks = item.partition("=")
        out[int(batch)] = _csv(int)(ks)
    return out


def parse_args(argv: Sequence[str] | None = None) -> ThroughputConfig:
    d = ThroughputConfig()
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch-sizes", type=_csv(int), default=d.batch_sizes)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--max-k", type=int, default=d.max_k, help="the draft's k (adaptive's max)")
    ap.add_argument("--fixed-k", type=_csv(int), default=d.fixed_k)
    ap.add_argument(
        "--fixed-k-by-batch",
        type=_by_batch,
        default=d.fixed_k_by_batch,
        help="fewer fixed ks at some batch sizes, e.g. '16=1,3 32=1'",
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=d.prompt_tokens, help="0: whole prompts"
    )
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens)
    ap.add_argument("--warmup-prompt-tokens", type=int, default=d.warmup_prompt_tokens)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--target", default=d.target)
    ap.add_argument("--draft", default=d.draft)
    ap.add_argument("--goal-ratio", type=float, default=d.goal_ratio)
    ap.add_argument("--no-hybrid", dest="hybrid", action="store_false",
                    help="leave out the hybrid system (SuffixHybrid over the draft model)")
    ap.add_argument("--out", default=d.out)
    ap.add_argument("--out-dir", default=d.out_dir)
    return ThroughputConfig(**vars(ap.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> Path:
    cfg = parse_args(argv)
    payload = run_grid(cfg)
    payload["markdown"] = markdown_table(payload["summary"])
    path = write_json(cfg.out, payload, out_dir=cfg.out_dir)
    print(payload["markdown"])
    print(f"\ngoal: {payload['goal']}")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
