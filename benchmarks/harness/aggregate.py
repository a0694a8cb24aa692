"""The summary: one row per grid point and system, medians and ratios over its runs."""

from __future__ import annotations

import statistics

from benchmarks.harness.bounds import decode_rate, paired_bound_seconds
from benchmarks.harness.systems import HF_REFERENCE, REFERENCE, System, all_systems


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (prompt set, temperature, batch size, system, k): medians and ratios.

    Speedups are ratios of median tokens/s within the same prompt set, temperature and batch
    size; ``vs_twin`` is specdec over its transformers twin at the same k.
    """

    def group_key(r: dict) -> tuple:
        return r.get("threads", 1), r["prompt_set"], r["temperature"], r["batch_size"]

    rows = {}
    for r in runs:
        rows.setdefault((*group_key(r), r["system"], r["k"]), []).append(r)
    medians = {key: statistics.median(r["tokens_per_s"] for r in rs) for key, rs in rows.items()}
    systems = all_systems()
    out = [_row(key, rs, medians, systems) for key, rs in rows.items()]
    out.sort(
        key=lambda s: (
            s["threads"],
            s["prompt_set"],
            s["temperature"],
            s["batch_size"],
            s["k"] or 0,
            list(systems).index(s["system"]),
        )
    )
    return out


def _row(key: tuple, rs: list[dict], medians: dict[tuple, float], systems: dict[str, System]) -> dict:
    """The summary row of one grid point and system, ``rs`` its runs."""
    threads, set_name, temperature, batch, system, k = key
    g = (threads, set_name, temperature, batch)
    med = medians[key]
    plain = medians.get(g + (REFERENCE, None))
    hf_plain = medians.get(g + (HF_REFERENCE, None))
    own_plain = medians.get(g + (systems[system].plain, None))
    twin_name = systems[system].twin
    twin = medians.get(g + (twin_name, k)) if twin_name else None
    checked = [r["matches_plain"] for r in rs if r["matches_plain"] is not None]
    own = [r["matches_own_plain"] for r in rs if r["matches_own_plain"] is not None]
    steps = sum(r["num_verify_steps"] for r in rs)
    drafted = sum(r["num_drafted"] for r in rs)
    acc_pos, draft_pos = _sum_positions(rs)
    return {
        "threads": threads,
        "prompt_set": set_name,
        "temperature": temperature,
        "batch_size": batch,
        "system": system,
        "k": k,
        "num_runs": len(rs),
        "median_tokens_per_s": med,
        "median_seconds": statistics.median(r["seconds"] for r in rs),
        "speedup_vs_specdec_plain": med / plain if plain else None,
        # over the plain decoder of its own stack and weights (a q4 system's: q4 plain)
        "speedup_vs_own_plain": med / own_plain if own_plain else None,
        "speedup_vs_hf_plain": med / hf_plain if hf_plain else None,
        "twin": twin_name,
        "vs_twin": med / twin if twin else None,
        "mean_target_forwards": statistics.fmean(r["target_forwards"] for r in rs),
        "target_forwards_per_token": sum(r["target_forwards"] for r in rs)
        / sum(r["num_new_tokens"] for r in rs),
        "mean_accepted_length": sum(r["num_emitted_in_verify"] for r in rs) / steps
        if steps
        else None,
        "acceptance_rate": sum(r["num_accepted"] for r in rs) / drafted if drafted else None,
        "per_position_acceptance": ratios(acc_pos, draft_pos),
        "k_histogram": _sum_histograms(rs),
        "matches_plain": all(checked) if checked else None,
        "num_mismatched_runs": checked.count(False),
        "num_own_mismatched_runs": own.count(False),
        "matches_own_plain": all(own) if own else None,
        "decode_tokens_per_s": decode_rate(rs),
        "paired_decode_bound_seconds": paired_bound_seconds(rs),
    }


def ratios(num: list[int] | None, den: list[int] | None) -> list[float] | None:
    """Element-wise ``num / den`` (0 where ``den`` is 0): per-position acceptance rates."""
    if num is None or den is None:
        return None
    return [a / d if d else 0.0 for a, d in zip(num, den)]


def _sum_histograms(rs: list[dict]) -> dict[int, int] | None:
    """The runs' k histograms added up (``None`` for systems without one: transformers)."""
    hists = [r.get("k_histogram") for r in rs if r.get("k_histogram") is not None]
    if not hists:
        return None
    total: dict[int, int] = {}
    for h in hists:
        for k, n in h.items():
            total[int(k)] = total.get(int(k), 0) + n
    return dict(sorted(total.items()))


def _sum_positions(rs: list[dict]) -> tuple[list[int] | None, list[int] | None]:
    """Accepted and drafted counts per draft position over the runs (``None``: not counted)."""
    if any(r["accepted_per_position"] is None for r in rs):
        return None, None
    width = max(len(r["drafted_per_position"]) for r in rs)
    acc, dra = [0] * width, [0] * width
    for r in rs:
        for j, (a, d) in enumerate(zip(r["accepted_per_position"], r["drafted_per_position"])):
            acc[j] += a
            dra[j] += d
    return acc, dra
