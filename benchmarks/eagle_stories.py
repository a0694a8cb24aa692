"""The bundled stories260K heads side by side: EAGLE trees and chains against the MTP head.

stories260K (float32, one thread), greedy, story openers the heads were not trained on x 64
tokens, every system on every prompt in turn (interleaved, so machine drift hits all alike),
each output checked equal to plain decoding. Per system: tokens/s and its ratio to plain, mean
accepted length per verify step, acceptance per depth. The EAGLE head (bundled,
``data/stories260K-eagle``) drafts a dynamic tree (top_k 4, depth 5, 16 nodes) verified whole or
in its best n nodes (speed against tree size), chains (k = 1, 3), and the dynamic tree under the
default adaptive policy; the bundled MTP head drafts chains (k = 1, 3).

    python -m benchmarks.eagle_stories [--repeats 3]   # benchmarks/results/eagle-stories-*.json + plots
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_json
from specdec import FixedPolicy, Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.proposers import EAGLETree, MTPHead
from specdec.training.eagle import chain_tree

PROMPTS = [
    "Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird",
    "The sun was", "Tim had a red ball.", "Mom said", "There was a big tree",
]
TREE = dict(top_k=4, depth=5, num_verify_tokens=16)


def systems(path: Path) -> dict[str, object]:
    """name -> (proposer factory, policy); None: plain decoding."""
    eagle, mtp = path.parent / "stories260K-eagle", path.parent / "stories260K-mtp"
    out = {"plain": None}
    for n in (1, 2, 4, 8, 16):
        out[f"eagle-tree-n{n}"] = (lambda: EAGLETree.from_pretrained(eagle, **TREE), FixedPolicy(n))
    out["eagle-tree-adaptive"] = (lambda: EAGLETree.from_pretrained(eagle, **TREE), None)
    for k in (1, 3):
        out[f"eagle-chain-k{k}"] = (
            lambda k=k: EAGLETree.from_pretrained(eagle, chain_tree(k)), FixedPolicy(k)
        )
        out[f"mtp-k{k}"] = (
            lambda k=k: MTPHead.from_pretrained(mtp, num_speculative_tokens=k), FixedPolicy(k)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = bundled_model_path()
    plain = Generator.from_pretrained(path, dtype="float32")
    gens = {
        name: plain if spec is None else plain.with_proposer(spec[0](), policy=spec[1])
        for name, spec in systems(path).items()
    }
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    for gen in gens.values():  # warm up
        gen.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    seconds = {name: [] for name in gens}
    outputs: dict[tuple[str, int], list[int]] = {}
    before = {name: gen.metrics for name, gen in gens.items()}
    for _ in range(args.repeats):
        for i, prompt in enumerate(PROMPTS):
            for name, gen in gens.items():
                start = time.perf_counter()
                out = gen.generate(prompt, params)
                seconds[name].append(time.perf_counter() - start)
                outputs[name, i] = out.token_ids
    rows = []
    plain_rate = args.tokens / statistics.median(seconds["plain"])
    for name, gen in gens.items():
        m, b = gen.metrics, before[name]
        steps = m.num_verify_steps - b.num_verify_steps
        rate = args.tokens / statistics.median(seconds[name])
        depth_acc = [
            (a - (b.accepted_per_position[j] if j < len(b.accepted_per_position) else 0))
            / max(1, d - (b.drafted_per_position[j] if j < len(b.drafted_per_position) else 0))
            for j, (a, d) in enumerate(zip(m.accepted_per_position, m.drafted_per_position))
        ]
        rows.append({
            "system": name,
            "tokens_per_s": rate,
            "speedup_vs_plain": rate / plain_rate,
            "mean_accepted_length": (m.num_emitted_in_verify - b.num_emitted_in_verify) / steps
            if steps else None,
            "acceptance_per_depth": depth_acc,
            "k_histogram": {str(k): v for k, v in m.k_histogram.items()},
            "matches_plain": all(outputs[name, i] == outputs["plain", i] for i in range(len(PROMPTS))),
        })
        print(f"{name:22s} {rate:8.1f} tok/s {rate / plain_rate:5.2f}x  "
              f"acc.len {rows[-1]['mean_accepted_length'] or 0:.2f}  = plain {rows[-1]['matches_plain']}")
    path_json = write_json("eagle-stories", {
        "machine": machine_info(), "model": "stories260K float32, 1 thread", "prompts": PROMPTS,
        "tokens_per_request": args.tokens, "repeats": args.repeats, "tree": TREE, "rows": rows,
    })
    print(path_json)
    for png in plot(rows, path_json):
        print(png)


def plot(rows: list[dict], json_path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["system"]: r for r in rows}
    stem = json_path.with_suffix("")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("eagle-tree-n16", "eagle-chain-k3", "mtp-k3"):
        acc = by[name]["acceptance_per_depth"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    ax.set(xlabel="depth", ylabel="acceptance (path reached it)", title="stories260K: acceptance per depth")
    ax.legend()
    fig.tight_layout()
    first = Path(f"{stem}-acceptance_per_depth.png")
    fig.savefig(first)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = [1, 2, 4, 8, 16]
    ax.plot(sizes, [by[f"eagle-tree-n{n}"]["speedup_vs_plain"] for n in sizes], marker="o", label="x plain")
    ax.plot(sizes, [by[f"eagle-tree-n{n}"]["mean_accepted_length"] for n in sizes], marker="s", label="tokens / verify step")
    ax.set(xscale="log", xlabel="tree nodes verified", title="stories260K: speed vs tree size")
    ax.legend()
    fig.tight_layout()
    second = Path(f"{stem}-speed_vs_tree_size.png")
    fig.savefig(second)
    plt.close(fig)
    return [first, second]


if __name__ == "__main__":
    main()
