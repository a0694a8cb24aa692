"""Issue 45's cold-start table from a harness run: the adaptive policy against every fixed k.

For each weight format and thread count of a harness JSON holding ``specdec[-int8|-q4]-plain``,
``-draft`` (fixed k) and ``-draft-adaptive`` runs, totals are all prompts' tokens over their
summed seconds. Two ways to name "the best fixed k":

- after the fact: the k with the best total over every repeat. The minimum of six noisy
  totals is biased low (the winner's curse), so this ratio under-states the policy;
- held out (two or more repeats): the k is chosen on the other repeats and timed on this one,
  as a user tuning k on one run and using it on the next would; the mean over repeats.

    python -m benchmarks.controller_summary benchmarks/results/controller-heldout-*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

WEIGHTS = {"": "bf16", "int8-": "int8", "q4-": "q4"}


def totals(runs: list[dict]) -> dict:
    """``(weights, threads, system, k, repeat) -> (tokens, seconds)`` summed over prompts."""
    out: dict = defaultdict(lambda: [0, 0.0])
    for row in runs:
        name = row["system"].removeprefix("specdec-")
        for prefix, weights in WEIGHTS.items():
            rest = name[len(prefix) :]
            if name.startswith(prefix) and rest in ("plain", "draft", "draft-adaptive"):
                k = row["k"] if rest == "draft" else None  # adaptive: k is its upper bound
                key = (weights, row["threads"], rest, k, row["repeat"])
                out[key][0] += row["num_new_tokens"]
                out[key][1] += row["seconds"]
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (weights, threads): rates and ratios (see the module docstring)."""
    t = totals(runs)
    rows = []
    settings = sorted({(w, th) for w, th, *_ in t})
    for weights, threads in settings:
        repeats = sorted({r for w, th, s, k, r in t if (w, th) == (weights, threads)})

        def rate(system, k, reps, weights=weights, threads=threads):
            tok = sum(t[(weights, threads, system, k, r)][0] for r in reps)
            sec = sum(t[(weights, threads, system, k, r)][1] for r in reps)
            return tok / sec if sec else float("nan")

        ks = sorted({k for w, th, s, k, r in t if (w, th, s) == (weights, threads, "draft")})
        if not ks or (weights, threads, "draft-adaptive", None, repeats[0]) not in t:
            continue
        plain = rate("plain", None, repeats)
        adaptive = rate("draft-adaptive", None, repeats)
        best_k = max(ks, key=lambda k: rate("draft", k, repeats))
        row = {
            "weights": weights,
            "threads": threads,
            "repeats": len(repeats),
            "adaptive_over_plain": adaptive / plain,
            "best_k": best_k,
            "best_over_plain": rate("draft", best_k, repeats) / plain,
            "adaptive_over_best": adaptive / rate("draft", best_k, repeats),
        }
        if len(repeats) > 1:
            held = []
            for r in repeats:
                others = [o for o in repeats if o != r]
                k = max(ks, key=lambda k, others=others: rate("draft", k, others))
                held.append(rate("draft-adaptive", None, [r]) / rate("draft", k, [r]))
            row["adaptive_over_heldout_best"] = statistics.mean(held)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| weights | threads | adaptive / plain | best fixed k / plain | adaptive / best fixed "
        "(after the fact) | adaptive / best fixed (k held out) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        held = r.get("adaptive_over_heldout_best")
        lines.append(
            f"| {r['weights']} | {r['threads']} | {r['adaptive_over_plain']:.2f}x | "
            f"{r['best_over_plain']:.2f}x (k = {r['best_k']}) | **{r['adaptive_over_best']:.3f}** | "
            + (f"**{held:.3f}** |" if held is not None else "n/a |")
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    runs = [row for f in args.files for row in json.loads(f.read_text())["runs"]]
    print(markdown(summarize(runs)))


if __name__ == "__main__":
    main()
