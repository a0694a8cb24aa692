"""benchmarks/gpu/check.py stays runnable: its --smoke mode (tiny shapes, CPU, the torch
reference in FlashInfer's place) runs every check and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_in_smoke_mode(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--out", str(tmp_path), "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert all(v == 0.0 for v in report["parity"].values()), report["parity"]
    exactness = report["exactness"]
    assert set(exactness) == {"plain-graphs", "draft", "lookup", "draft-graphs", "lookup-graphs"}
    assert all(r["identical"] for r in exactness.values())
    assert all(r["drafted"] > 0 for name, r in exactness.items() if name != "plain-graphs")
    assert report["decode_1.5b"]["batch16"]["specdec_tok_s"] > 0
    assert report["decode_1.5b"]["batch16"]["graphs_identical"]
    oracle = {k: v for k, v in report["oracle_1.5b"].items() if isinstance(v, dict)}
    assert len(oracle) == 12 and all(v["identical"] for v in oracle.values())
    # alpha = 1 accepts every draft (the last step of a run is cut short by max_new_tokens)
    assert oracle["chain-k5-a1.0"]["emitted_per_step"] > 4
    assert oracle["tree16-k16-a1.0"]["emitted_per_step"] > 5
    assert all(v["identical"] for v in report["adaptive_1.5b"].values())
    assert any(k != "0" for k in report["adaptive_1.5b"]["batch1-a0.8"]["k_histogram"])
    assert all(r["steps"] > 0 for r in report["host_syncs"].values())
