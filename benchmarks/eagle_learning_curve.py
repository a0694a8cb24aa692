"""An EAGLE head's learning curve and the training budget it projects to beat a draft model.

Reads a head's ``train_log.json`` (``specdec train-eagle``: held-out greedy tree acceptance every
``--val-every`` steps) and, optionally, a harness result holding the EAGLE tree and the draft
model on one target. Writes JSON + a plot: mean accepted length per verify step against the
training tokens the head has seen (steps x batch x chunk length), a fit ``L = a + b ln(tokens)``
through the points, and the projection:

- the accepted length the tree needs to match the draft model's tokens/s on that target, from
  the harness row of the same tree (``--tree-k`` nodes, the validated tree's size): ``L* = draft tokens/s x (seconds per tree step)``, where the tree's seconds
  per verify step are its measured ``mean accepted length / tokens/s`` (the tree's per-step
  cost does not depend on how good the head is);
- the tokens at which the fit reaches ``L*``.

A log fit through three points is a rough guide (acceptance saturates; more distinct data is not
the same as more epochs over the same data); the JSON says so next to the number.

    python -m benchmarks.eagle_learning_curve --train-log heads/qwen05-eagle3/train_log.json \\
        --harness benchmarks/results/eagle-qwen15-latest.json --out eagle-learning-curve
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.common import machine_info, write_json


def curve_points(train_log: dict, chunk_len: int) -> list[dict]:
    """``[{step, tokens, mean_accepted_length}]`` from the validations in a training log."""
    batch = train_log["config"]["batch_size"]
    return [
        {"step": h["step"], "tokens": h["step"] * batch * chunk_len,
         "mean_accepted_length": h["val_mean_accepted_length"]}
        for h in train_log["history"]
        if "val_mean_accepted_length" in h
    ]  # fmt: skip


def log_fit(points: list[dict]) -> tuple[float, float]:
    """Least squares ``L = a + b ln(tokens)``: ``(a, b)``."""
    xs = [math.log(p["tokens"]) for p in points]
    ys = [p["mean_accepted_length"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def needed_length(summary: list[dict], tree_system: str, draft_system: str, tree_k: int) -> dict | None:
    """The accepted length the ``tree_k``-node tree needs to match the best draft-model row of a
    harness summary. ``tree_k`` must be the node count of the tree the curve was validated with:
    a smaller tree's cheaper step against a larger tree's acceptance would compare unequal work.
    ``None`` if the summary lacks that tree or the draft model."""
    trees = [s for s in summary if s["system"] == tree_system and s["k"] == tree_k and s.get("mean_accepted_length")]
    drafts = [s for s in summary if s["system"] == draft_system]
    if not trees or not drafts:
        return None
    tree = max(trees, key=lambda s: s["median_tokens_per_s"])
    draft = max(drafts, key=lambda s: s["median_tokens_per_s"])
    step_seconds = tree["mean_accepted_length"] / tree["median_tokens_per_s"]
    return {
        "tree_k": tree["k"], "tree_tokens_per_s": tree["median_tokens_per_s"],
        "tree_mean_accepted_length": tree["mean_accepted_length"], "tree_seconds_per_step": step_seconds,
        "draft_k": draft["k"], "draft_tokens_per_s": draft["median_tokens_per_s"],
        "needed_mean_accepted_length": draft["median_tokens_per_s"] * step_seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-log", required=True, help="a head's train_log.json")
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--harness", help="harness JSON with the tree and the draft model on one target")
    ap.add_argument("--tree-system", default="specdec-eagle-tree")
    ap.add_argument("--draft-system", default="specdec-draft")
    ap.add_argument("--tree-k", type=int, default=16,
                    help="node count of the tree the training validated (train-eagle --num-verify-tokens)")
    ap.add_argument("--out", default="eagle-learning-curve")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    points = curve_points(json.loads(Path(args.train_log).read_text()), args.chunk_len)
    if len(points) < 2:
        raise SystemExit(f"--train-log: {len(points)} validation point(s); the fit needs >= 2")
    a, b = log_fit(points)
    payload = {
        "machine": machine_info(), "train_log": args.train_log, "points": points,
        "fit": {"form": "L = a + b ln(tokens)", "a": a, "b": b},
        "caveat": "a log fit through the validation points of one run (epochs over the same data); "
                  "acceptance saturates, so the projection is a lower bound on the budget at best",
    }  # fmt: skip
    if args.harness:
        need = needed_length(json.loads(Path(args.harness).read_text())["summary"], args.tree_system,
                             args.draft_system, args.tree_k)
        if need is None:
            payload["projection"] = None
            print(f"--harness has no {args.tree_system} row with k = {args.tree_k} (the validated tree) "
                  f"and a {args.draft_system} row: no projection")
        else:
            target = need["needed_mean_accepted_length"]
            need["harness"] = args.harness
            need["projected_tokens"] = math.exp((target - a) / b) if b > 0 else None
            payload["projection"] = need
    path = write_json(args.out, payload, out_dir=args.out_dir)
    _plot(payload, path.with_name(path.stem + "-curve.png"))
    print(json.dumps({k: payload[k] for k in ("points", "fit", "projection") if k in payload}, indent=1))
    print(f"wrote {path}")
    return path


def _plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = payload["points"]
    a, b = payload["fit"]["a"], payload["fit"]["b"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["tokens"] for p in pts]
    ax.plot(xs, [p["mean_accepted_length"] for p in pts], "o", label="held-out, greedy tree")
    proj = payload.get("projection") or {}
    top = max(xs) * 4
    if proj.get("projected_tokens"):
        top = max(top, proj["projected_tokens"] * 1.5)
        ax.axhline(proj["needed_mean_accepted_length"], ls=":", c="gray", label="matches the draft model")
    grid = [min(xs) * (top / min(xs)) ** (i / 50) for i in range(51)]
    ax.plot(grid, [a + b * math.log(x) for x in grid], "-", lw=1, label="a + b ln(tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("mean accepted length per verify step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
