"""Plots of a harness result: tokens/s per system, speedup vs k, per-position acceptance.

    python -m benchmarks.plots benchmarks/results/harness-latest.json [--out-dir DIR]

Writes ``<stem>-tokens_per_s.png``, ``<stem>-speedup_vs_k.png`` and
``<stem>-acceptance_per_position.png`` next to the JSON (or into ``--out-dir``), one panel
per (prompt set, temperature, batch size). Bars of systems whose greedy text differed from
specdec-plain are hatched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

COLORS = {
    "specdec-plain": "#4c72b0",
    "specdec-draft": "#55a868",
    "specdec-lookup": "#8172b2",
    "hf-plain": "#c44e52",
    "hf-assisted": "#dd8452",
    "hf-lookup": "#937860",
}


def _groups(summary: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for s in summary:
        groups.setdefault((s["prompt_set"], s["temperature"], s["batch_size"]), []).append(s)
    return groups


def _title(key: tuple) -> str:
    prompt_set, temperature, batch = key
    return f"{prompt_set}, T={temperature:g}, batch {batch}"


def _panels(n: int, width: float = 6.0, height: float = 4.0):
    fig, axes = plt.subplots(1, max(n, 1), figsize=(width * max(n, 1), height), squeeze=False)
    return fig, list(axes[0])


def plot_tokens_per_s(summary: list[dict], path: Path) -> Path:
    groups = _groups(summary)
    fig, axes = _panels(len(groups))
    for ax, (key, rows) in zip(axes, groups.items()):
        labels = [r["system"] + ("" if r["k"] is None else f"\nk={r['k']}") for r in rows]
        bars = ax.bar(
            range(len(rows)),
            [r["median_tokens_per_s"] for r in rows],
            color=[COLORS.get(r["system"], "grey") for r in rows],
        )
        for bar, r in zip(bars, rows):
            if r["matches_plain"] is False:
                bar.set_hatch("//")
        ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("median tokens/s")
        ax.set_title(_title(key))
    _finish(fig, axes, groups)
    return _save(fig, path)


def plot_speedup_vs_k(summary: list[dict], path: Path) -> Path:
    groups = _groups(summary)
    fig, axes = _panels(len(groups))
    for ax, (key, rows) in zip(axes, groups.items()):
        ax.axhline(1.0, color=COLORS["specdec-plain"], lw=1, label="specdec-plain")
        for r in rows:
            if r["system"] == "hf-plain" and r["speedup_vs_specdec_plain"]:
                ax.axhline(
                    r["speedup_vs_specdec_plain"],
                    color=COLORS["hf-plain"],
                    lw=1,
                    ls="--",
                    label="hf-plain",
                )
        for system in dict.fromkeys(r["system"] for r in rows if r["k"] is not None):
            pts = sorted(
                (r["k"], r["speedup_vs_specdec_plain"])
                for r in rows
                if r["system"] == system and r["speedup_vs_specdec_plain"] is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS.get(system, "grey"), label=system)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("k (num_speculative_tokens)")
        ax.set_ylabel("speedup vs specdec-plain (median tokens/s)")
        ax.set_title(_title(key))
        ax.legend(fontsize=8)
    _finish(fig, axes, groups)
    return _save(fig, path)


def plot_acceptance_per_position(summary: list[dict], path: Path) -> Path:
    groups = _groups(summary)
    fig, axes = _panels(len(groups))
    for ax, (key, rows) in zip(axes, groups.items()):
        for r in rows:
            acc = r.get("per_position_acceptance")
            if acc:
                ax.plot(
                    range(1, len(acc) + 1),
                    acc,
                    marker="o",
                    color=COLORS.get(r["system"], "grey"),
                    alpha=0.4 + 0.6 * r["k"] / max(x["k"] or 1 for x in rows),
                    label=f"{r['system']} k={r['k']}",
                )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(draft token at position accepted)")
        ax.set_ylim(0, 1.05)
        ax.set_title(_title(key))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5, 0.5, "no per-position data", ha="center", va="center", transform=ax.transAxes
            )
    _finish(fig, axes, groups)
    return _save(fig, path)


def _finish(fig, axes, groups) -> None:
    if not groups:
        axes[0].text(0.5, 0.5, "no data", ha="center", va="center", transform=axes[0].transAxes)
    fig.tight_layout()


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTS = {
    "tokens_per_s": plot_tokens_per_s,
    "speedup_vs_k": plot_speedup_vs_k,
    "acceptance_per_position": plot_acceptance_per_position,
}


def plot_all(json_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write every plot of the harness result at ``json_path``; return the PNG paths."""
    json_path = Path(json_path)
    summary = json.loads(json_path.read_text())["summary"]
    out_dir = json_path.parent if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot(summary, out_dir / f"{json_path.stem}-{name}.png") for name, plot in PLOTS.items()]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("json", help="a harness result JSON")
    ap.add_argument("--out-dir", default=None, help="default: the JSON's directory")
    args = ap.parse_args()
    for png in plot_all(args.json, args.out_dir):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
