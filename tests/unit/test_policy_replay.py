"""The policy replay's bookkeeping (benchmarks/policy_replay.py): agreement runs and step times."""

from __future__ import annotations

import pytest

from benchmarks.policy_replay import K_MAX, agreement_runs, replay
from specdec import FixedPolicy
from specdec.policy import AdaptivePolicy

COSTS = {
    "target": {r: 0.10 + 0.01 * (r - 1) for r in range(1, K_MAX + 2)},
    "prefill_row": 0.01,
    "draft_token": 0.03,
    "catchup_row": 0.002,
}


def test_agreement_runs_count_consecutive_right_drafts():
    assert agreement_runs([True, True, False, True, True, True]) == [2, 1, 0, 3, 2, 1]
    assert agreement_runs([]) == []


def test_fixed_k_replay_adds_up_steps_exactly():
    # Every draft right: each k=2 step emits 3 tokens. 1 + 3 * 3 = 10 tokens in 3 steps.
    trace = {"prompt_len": 10, "runs": [K_MAX] * 10}
    got = replay(FixedPolicy(2), COSTS, [trace], tokens=10, noise=0.0, seed=0)
    prefill = 10 * 0.01
    first = 2 * 0.03 + 11 * 0.002 + 0.12  # catches up on the prompt and the first token
    later = 2 * 0.03 + 0.12
    assert got == pytest.approx(prefill + first + 2 * later)


def test_rejections_and_the_budget_cap_shorten_steps():
    # Drafts wrong everywhere: each k=3 step emits 1 token; the last step's cap is 0 (plain).
    trace = {"prompt_len": 4, "runs": [0] * 4}
    got = replay(FixedPolicy(3), COSTS, [trace], tokens=4, noise=0.0, seed=0)
    # caps: after the prefill 4 - 1 - 1 = 2 -> k 2; then 1 -> k 1; then 0 -> plain
    expected = 4 * 0.01 + (2 * 0.03 + 5 * 0.002 + 0.12) + (0.03 + 0.11) + 0.10
    assert got == pytest.approx(expected)


def test_adaptive_policy_replays_without_errors_and_beats_plain_on_easy_text():
    trace = {"prompt_len": 20, "runs": [K_MAX] * 64}
    plain = 20 * 0.01 + 63 * 0.10
    got = replay(AdaptivePolicy(), COSTS, [trace, trace], tokens=64, noise=0.05, seed=1)
    assert got < 2 * plain * 0.6


def test_a_replay_from_a_file_takes_the_recordings_settings(tmp_path, monkeypatch):
    """``--from`` replays the recorded number of tokens and names its output by the recorded
    format, whatever the command line's defaults."""
    import json
    import sys

    from benchmarks import policy_replay

    recording = {
        "args": {"quantization": "q4", "num_prompts": 1, "max_new_tokens": 12, "threads": 2},
        "costs": {**COSTS, "target": {str(r): s for r, s in COSTS["target"].items()}},
        "traces": [{"prompt_len": 5, "runs": [1] * 12}],
    }
    source = tmp_path / "recording.json"
    source.write_text(json.dumps(recording))
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["policy_replay", "--from", str(source), "--seeds", "1"])
    policy_replay.main()
    (out,) = (tmp_path / "benchmarks" / "results").glob("policy-rereplay-*.json")
    result = json.loads(out.read_text())
    assert out.name.startswith("policy-rereplay-q4-")
    # a 5-row prefill (it emits token 1) + 11 plain steps of one row each
    assert result["plain_s"] == pytest.approx(5 * 0.01 + 11 * 0.10)
