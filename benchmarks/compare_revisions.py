"""The same harness run on two checkouts of specdec, taking turns: is a change within noise?

A refactor must not move speed. Two harness runs minutes apart differ by several percent on a
shared machine, so one run of each says little; this runs the harness alternately on checkout A
and checkout B (A B B A A B ... so neither always goes first), each in a fresh process with
``PYTHONPATH`` set to that checkout's ``src`` and the harness of that checkout, and reports each
system's tokens/s per round, its spread within a checkout (run-to-run noise) and B / A.

    git worktree add /tmp/base <old-commit>
    python -m benchmarks.compare_revisions --a /tmp/base --b . --rounds 2 -- \\
        --systems specdec-plain,specdec-draft --k 4 --num-prompts 3 --max-new-tokens 64 --threads 1

Output: ``benchmarks/results/<out>-<stamp>.json`` (+ ``<out>-latest.json``) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import machine_info, write_json


def turn_order(rounds: int) -> list[str]:
    """A B, B A, A B, ...: each checkout goes first in every other round.

    >>> turn_order(3)
    ['a', 'b', 'b', 'a', 'a', 'b']
    """
    order: list[str] = []
    for r in range(rounds):
        order += ["a", "b"] if r % 2 == 0 else ["b", "a"]
    return order


def run_harness(tree: Path, harness_args: list[str], out_dir: Path, tag: str) -> dict:
    """One harness run on ``tree`` (its own code and harness); its summary rows."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, "-m", "benchmarks.harness", *harness_args,
           "--out-dir", str(out_dir), "--out", tag, "--no-plots"]  # fmt: skip
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads((out_dir / f"{tag}-latest.json").read_text())


def row_key(row: dict) -> str:
    return f"{row['system']} k={row['k']} threads={row['threads']} T={row['temperature']} batch={row['batch_size']}"


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per system row: tokens/s of each run per checkout, their spread, and B / A of the means."""
    table: dict[str, dict] = {}
    for run in runs:
        for row in run["summary"]:
            entry = table.setdefault(row_key(row), {"a": [], "b": [], "matches_plain": True})
            entry[run["checkout"]].append(row["median_tokens_per_s"])
            entry["matches_plain"] &= bool(row.get("matches_plain", True))
    for entry in table.values():
        mean_a, mean_b = statistics.fmean(entry["a"]), statistics.fmean(entry["b"])
        entry["b_over_a"] = mean_b / mean_a
        # The median resists one slow run (a neighbour's burst) better than the mean.
        entry["b_over_a_median"] = statistics.median(entry["b"]) / statistics.median(entry["a"])
        # Run-to-run noise: the largest relative gap between two runs of the same checkout.
        entry["noise_a"] = (max(entry["a"]) - min(entry["a"])) / mean_a
        entry["noise_b"] = (max(entry["b"]) - min(entry["b"])) / mean_b
    return table


def greedy_outputs(harness_runs: list[dict]) -> dict[str, list]:
    """Each greedy run's tokens by system, k, prompts and repeat: the two checkouts must agree."""
    return {f"{r['system']} k={r['k']} threads={r.get('threads', 1)} {r['prompt_set']} {r['prompt_id']} "
            f"batch={r['batch_size']} repeat={r['repeat']}": r["output_token_ids"]
            for r in harness_runs if r["temperature"] == 0}  # fmt: skip


def same_outputs(runs: list[dict]) -> bool:
    """Whether every greedy output of every run equals the first run's for the same key."""
    first: dict[str, list] = {}
    for run in runs:
        for key, tokens in run.get("outputs", {}).items():
            if first.setdefault(key, tokens) != tokens:
                return False
    return True


def markdown(table: dict[str, dict]) -> str:
    lines = ["| system | A tok/s (runs) | B tok/s (runs) | B / A (means) | B / A (medians) | spread A | spread B | = plain |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, e in table.items():
        runs_a = ", ".join(f"{x:.2f}" for x in e["a"])
        runs_b = ", ".join(f"{x:.2f}" for x in e["b"])
        lines.append(f"| {key} | {runs_a} | {runs_b} | {e['b_over_a']:.3f} | {e['b_over_a_median']:.3f} | {e['noise_a']:.1%} "
                     f"| {e['noise_b']:.1%} | {'yes' if e['matches_plain'] else 'NO'} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (e.g. the old commit)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (e.g. the change)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each checkout (>= 2)")
    parser.add_argument("--out", default="compare-revisions", help="result file name prefix")
    args = parser.parse_args(argv[:split])
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (noise needs two runs of each), got {args.rounds}")
    harness_args = argv[split + 1 :]
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, which in enumerate(turn_order(args.rounds)):
            result = run_harness(trees[which], harness_args, Path(tmp), f"{which}{i}")
            runs.append({"checkout": which, "turn": i, "summary": result["summary"],
                         "outputs": greedy_outputs(result["runs"])})  # fmt: skip
    table = summarize(runs)
    revs = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() for k, t in trees.items()}  # fmt: skip
    out = {"machine": machine_info(), "checkouts": {k: {"path": str(trees[k]), "rev": revs[k]} for k in trees},
           "harness_args": harness_args, "turns": turn_order(args.rounds), "runs": runs,
           "table": table, "same_greedy_outputs": same_outputs(runs), "markdown": markdown(table)}  # fmt: skip
    path = write_json(args.out, out)
    print(out["markdown"])
    print(f"greedy outputs of A and B identical: {out['same_greedy_outputs']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
