"""benchmarks/eagle_learning_curve: the fit and the projection against a harness run."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import eagle_learning_curve as lc


def _log(points):  # (step, mean accepted length) -> a train_log.json payload
    history = [{"step": s, "loss": 1.0} for s in range(1, 10)]
    history += [{"step": s, "loss": 1.0, "val_mean_accepted_length": v} for s, v in points]
    return {"config": {"batch_size": 4}, "history": history}


def test_points_fit_and_projection(tmp_path):
    # L = 1 + 0.5 ln(tokens / 1024): points at 1024, 2048 and 4096 tokens (steps 1, 2, 4).
    points = lc.curve_points(_log([(1, 1.0), (2, 1.0 + 0.5 * math.log(2)), (4, 1.0 + 0.5 * math.log(4))]), 256)
    assert [p["tokens"] for p in points] == [1024, 2048, 4096]
    a, b = lc.log_fit(points)
    assert b == pytest.approx(0.5) and a + b * math.log(1024) == pytest.approx(1.0)
    summary = [
        {"system": "specdec-eagle-tree", "k": 8, "median_tokens_per_s": 10.0, "mean_accepted_length": 2.0},
        {"system": "specdec-eagle-tree", "k": 16, "median_tokens_per_s": 8.0, "mean_accepted_length": 2.2},
        {"system": "specdec-draft", "k": 4, "median_tokens_per_s": 15.0, "mean_accepted_length": 4.0},
    ]
    need = lc.needed_length(summary, "specdec-eagle-tree", "specdec-draft", 8)
    # The 8-node tree takes 0.2 s a step: 15 tok/s needs 3 tokens a step.
    assert need["tree_k"] == 8 and need["needed_mean_accepted_length"] == pytest.approx(3.0)
    # The 16-node tree the curve validated is slower (0.275 s a step), not the faster 8-node one.
    assert lc.needed_length(summary, "specdec-eagle-tree", "specdec-draft", 16)["needed_mean_accepted_length"] == pytest.approx(4.125)
    assert lc.needed_length(summary, "specdec-eagle-tree", "hf-assisted", 8) is None
    assert lc.needed_length(summary, "specdec-eagle-tree", "specdec-draft", 4) is None
    log = tmp_path / "train_log.json"
    log.write_text(json.dumps(_log([(1, 1.0), (2, 1.0 + 0.5 * math.log(2)), (4, 1.0 + 0.5 * math.log(4))])))
    harness = tmp_path / "h.json"
    harness.write_text(json.dumps({"summary": summary}))
    pytest.importorskip("matplotlib")
    path = lc.main(["--train-log", str(log), "--harness", str(harness), "--tree-k", "8", "--out", "lc", "--out-dir", str(tmp_path)])
    payload = json.loads(path.read_text())
    # 1 + 0.5 ln(t / 1024) = 3  ->  t = 1024 e^4
    assert payload["projection"]["projected_tokens"] == pytest.approx(1024 * math.exp(4))
    assert path.with_name(path.stem + "-curve.png").stat().st_size > 1000


def test_one_point_is_refused(tmp_path):
    log = tmp_path / "train_log.json"
    log.write_text(json.dumps(_log([(4, 1.5)])))
    with pytest.raises(SystemExit, match="needs >= 2"):
        lc.main(["--train-log", str(log), "--out-dir", str(tmp_path)])
