"""The cold-start table's arithmetic: totals, the after-the-fact best k and the held-out k."""

import pytest

from benchmarks.controller_summary import summarize


def _row(system, k, repeat, seconds, tokens=100, threads=1):
    return {"system": system, "k": k, "repeat": repeat, "seconds": seconds,
            "num_new_tokens": tokens, "threads": threads}  # fmt: skip


def test_best_k_after_the_fact_and_held_out():
    # k = 2 is fastest on repeat 0 only, k = 3 overall; the adaptive policy takes 10 s each time.
    runs = [_row("specdec-plain", None, r, 20.0) for r in (0, 1)]
    runs += [_row("specdec-draft", 2, 0, 8.0), _row("specdec-draft", 2, 1, 12.0)]
    runs += [_row("specdec-draft", 3, 0, 9.0), _row("specdec-draft", 3, 1, 9.5)]
    runs += [_row("specdec-draft-adaptive", 6, r, 10.0) for r in (0, 1)]
    runs += [_row("specdec-q4-plain", None, 0, 99.0)]  # another format: not mixed in
    (row,) = summarize(runs)
    assert (row["weights"], row["threads"], row["best_k"]) == ("bf16", 1, 3)
    assert row["adaptive_over_plain"] == pytest.approx(2.0)
    assert row["adaptive_over_best"] == pytest.approx(18.5 / 20.0)
    # Repeat 0 is judged against the k best on repeat 1 (3: 9.0 s), repeat 1 against the k
    # best on repeat 0 (2: 12.0 s).
    assert row["adaptive_over_heldout_best"] == pytest.approx((9.0 / 10.0 + 12.0 / 10.0) / 2)
