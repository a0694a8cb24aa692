"""The greedy check: every system's output token for token against a plain decoder's."""

from __future__ import annotations

from benchmarks.harness.systems import HF_REFERENCE, REFERENCE, all_systems


def check_against_plain(runs: list[dict]) -> None:
    """Set ``matches_plain``/``first_divergence`` and ``matches_own_plain`` on greedy runs.

    ``matches_plain``: the output equals specdec-plain's for the same prompts in the same
    repeat (hf-plain's when specdec-plain was not run). ``matches_own_plain``: it equals the
    plain decoder of its own stack (specdec or transformers). ``None`` when sampling or when
    the reference did not run.
    """

    def key(r: dict) -> tuple:
        return (
            r.get("threads", 1), r["prompt_set"], r["temperature"], r["batch_size"], r["repeat"],
            r["prompt_id"],
        )

    systems = all_systems()
    outputs = {(key(r), r["system"]): r["output_token_ids"] for r in runs}
    for r in runs:
        greedy = r["temperature"] == 0
        ref = outputs.get((key(r), REFERENCE), outputs.get((key(r), HF_REFERENCE)))
        own = outputs.get((key(r), systems[r["system"]].plain))
        r["matches_plain"] = r["output_token_ids"] == ref if greedy and ref else None
        r["first_divergence"] = first_divergence(r["output_token_ids"], ref) if greedy else None
        r["matches_own_plain"] = r["output_token_ids"] == own if greedy and own else None


def first_divergence(outputs: list[list[int]], ref: list[list[int]] | None) -> int | None:
    """Index of the first differing new token (over the batch's prompts), or ``None``."""
    pairs = zip(outputs, ref or [])
    return next(
        (i for out, want in pairs for i, (a, b) in enumerate(zip(out, want)) if a != b), None
    )
