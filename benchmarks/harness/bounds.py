"""The plain decoding bound: a batch-1 decode step reads every target weight once, so
``read bandwidth / weight bytes`` steps per second at most.

Per thread count the grid probes the bandwidth before and after its runs (the better of the
two: the tighter bound); around every specdec-plain run it probes again, so that run can be set
against the machine's bandwidth at that time, which drifts by 10-30% within minutes.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.harness.pool import ModelPool

# A smaller buffer for the probes around every specdec-plain run (each ~0.3 s): still 10x the
# last-level cache, so it measures memory, not cache.
PROBE_GIB = 0.5


def open_bound(threads: int, pool: ModelPool) -> dict:
    """A thread count's bound, its bandwidth probed once before the runs (at ``threads``)."""
    from benchmarks.bandwidth import read_bandwidth, weight_bytes

    target = pool.specdec_plain.engine.target
    return {"threads": threads, "weight_bytes": weight_bytes(target), "bandwidth": [read_bandwidth()]}


def close_bound(bound: dict) -> None:
    """Measure the bandwidth again after the runs, at the bound's own thread count, and keep the
    better (the tighter bound). A closing probe taken after the switch to the next thread count
    once set a 1-thread bound from 2 threads' bandwidth."""
    # Looked up at call time, so a test can stand in for the probe.
    from benchmarks.bandwidth import read_bandwidth

    torch.set_num_threads(bound["threads"])
    bound["bandwidth"].append(read_bandwidth())
    best = max(bound["bandwidth"])
    bound["read_bandwidth_gb_s"] = best / 1e9
    bound["bound_decode_steps_per_s"] = best / bound["weight_bytes"]


def decode_rate(rs: list[dict]) -> float | None:
    """Median tokens/s after the first token (runs that timed their prefill apart)."""
    rates = [
        (r["num_new_tokens"] - len(r["prompt_tokens"])) / (r["seconds"] - r["prefill_seconds"])
        for r in rs
        if r.get("prefill_seconds") is not None and r["seconds"] > r["prefill_seconds"]
    ]
    return statistics.median(rates) if rates else None


def paired_bound_seconds(rs: list[dict]) -> list[tuple[float, float]] | None:
    """Per run that probed the bandwidth next to it: (decode seconds, the decode tokens' bound
    in seconds at that bandwidth, before dividing by the weight bytes). ``None`` if none did."""
    pairs = [
        (
            r["seconds"] - r["prefill_seconds"],
            (r["num_new_tokens"] - len(r["prompt_tokens"])) / len(r["prompt_tokens"])
            / max(r["read_bandwidth_probes"]),
        )
        for r in rs
        if r.get("read_bandwidth_probes") and r["seconds"] > r["prefill_seconds"]
    ]
    return pairs or None


def rate_against_bounds(summary: list[dict], bounds: list[dict]) -> None:
    """specdec-plain's decode rate as a fraction of its weight-read bound (batch b: b tokens a
    step)."""
    by_threads = {b["threads"]: b for b in bounds}
    for s in summary:
        bound = by_threads.get(s["threads"])
        pairs = s.pop("paired_decode_bound_seconds", None)
        if s.get("decode_tokens_per_s") is None or bound is None:
            continue
        s["bound_decode_tokens_per_s"] = bound["bound_decode_steps_per_s"] * s["batch_size"]
        s["fraction_of_bound"] = s["decode_tokens_per_s"] / s["bound_decode_tokens_per_s"]
        if pairs:
            # Each run against the bandwidth probed right next to it: decode steps x weight
            # bytes / bandwidth = the time reading the weights once per step would take.
            bound_s = sum(b for _, b in pairs) * bound["weight_bytes"]
            s["fraction_of_paired_bound"] = bound_s / sum(d for d, _ in pairs)
