"""The harness's markdown: the README table of a summary and the plain decoding bound lines."""

from __future__ import annotations

from benchmarks.harness.systems import HF_REFERENCE, REFERENCE, all_systems

TABLE_COLUMNS = (
    "threads",
    "prompts",
    "T",
    "batch",
    "system",
    "k",
    "tok/s",
    "× specdec-plain",
    "× hf-plain",
    "× own plain",
    "specdec / HF twin",
    "mean acc. len",
    "acc. rate",
    "target fwd / token",
    "= plain",
)


def markdown_table(summary: list[dict]) -> str:
    """The README table. Speedups of rows whose greedy text differs from specdec-plain's are
    struck out; ``†`` marks rows that still equal their own stack's plain output (bf16
    rounding differs between the stacks, not a speculation error)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for s in summary:
        # A quantized system is another model: it must equal its own plain decoder, not bf16's.
        bad = (s["matches_own_plain"] if _own_weights(s) else s["matches_plain"]) is False
        cells = [
            str(s["threads"]),
            s["prompt_set"],
            f"{s['temperature']:g}",
            str(s["batch_size"]),
            s["system"],
            _k_cell(s),
            f"{s['median_tokens_per_s']:.2f}",
            _ratio(s["speedup_vs_specdec_plain"], bad and s["system"] != REFERENCE),
            _ratio(s["speedup_vs_hf_plain"], bad and s["system"] != HF_REFERENCE),
            _ratio(s.get("speedup_vs_own_plain"), bad) if _own_weights(s) else "",
            _ratio(s["vs_twin"], bad) if s["k"] is not None else "",
            _num(s["mean_accepted_length"]),
            _num(s["acceptance_rate"]),
            f"{s['target_forwards_per_token']:.3f}",
            _match_cell(s),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _k_cell(s: dict) -> str:
    """The k column: the fixed k, or for adaptive systems their cap and the mean k chosen per
    decode step (0 = a plain step), so a table shows what the policy did."""
    if s["k"] is None:
        return "-"
    hist = s.get("k_histogram")
    system = all_systems().get(s["system"])
    if system is None or not system.largest_k_only or not hist:
        return str(s["k"])
    steps = sum(hist.values())
    return f"<= {s['k']} (mean {sum(int(k) * n for k, n in hist.items()) / steps:.1f})"


def _own_weights(s: dict) -> bool:
    """Whether the system's model differs from specdec-plain's (quantized weights)."""
    return all_systems()[s["system"]].plain not in (REFERENCE, HF_REFERENCE)


def _match_cell(s: dict) -> str:
    if _own_weights(s):
        if s["matches_own_plain"] is None:
            return "n/a"
        own = "yes" if s["matches_own_plain"] else f"NO ({s['num_own_mismatched_runs']}/{s['num_runs']})"
        return f"{own} (own plain)"
    if s["matches_plain"] is None:
        return "n/a"
    if s["matches_plain"]:
        return "yes"
    dagger = "†" if s["matches_own_plain"] else ""
    return f"NO ({s['num_mismatched_runs']}/{s['num_runs']}){dagger}"


def _ratio(x: float | None, struck: bool) -> str:
    if x is None:
        return ""
    return f"~~{x:.2f}×~~" if struck else f"{x:.2f}×"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def bounds_markdown(bounds: list[dict], summary: list[dict]) -> str:
    """One line per thread count: bandwidth, bound and specdec-plain's share of it."""
    lines = []
    for b in bounds:
        plain = [
            s for s in summary
            if s["system"] == REFERENCE and s["threads"] == b["threads"] and s.get("fraction_of_bound")
        ]
        shares = ", ".join(_plain_share(s) for s in plain)
        lines.append(
            f"- {b['threads']} thread(s): read bandwidth {b['read_bandwidth_gb_s']:.1f} GB/s, "
            f"target weights {b['weight_bytes'] / 1e9:.2f} GB, bound "
            f"{b['bound_decode_steps_per_s']:.2f} decode steps/s" + (f"; {shares}" if shares else "")
        )
    return "\n".join(lines)


def _plain_share(s: dict) -> str:
    """specdec-plain's decode rate in one summary row, as a share of the bound."""
    paired = (
        f" ({s['fraction_of_paired_bound']:.0%} of the bound at the bandwidth probed "
        "next to each run)"
        if s.get("fraction_of_paired_bound")
        else ""
    )
    return (
        f"{s['prompt_set']} b={s['batch_size']}: plain decodes {s['decode_tokens_per_s']:.2f} tok/s "
        f"= {s['fraction_of_bound']:.0%} of it" + paired
    )
