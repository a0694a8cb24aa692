"""The numbered example scripts and the code blocks of docs/*.md run and exit cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Pages with code to run (docs/performance.md, for one, shows shell commands only).
DOCS = [p for p in sorted((ROOT / "docs").glob("*.md")) if _PYTHON_BLOCK.search(p.read_text())]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # A fresh interpreter in a scratch directory: the scripts must not depend on the working
    # directory. One thread: the machine is shared and the models are tiny.
    env = dict(os.environ, OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_examples_found():
    assert [p.name for p in EXAMPLES][:3] == [
        "01_generate.py",
        "02_speculative.py",
        "03_custom_proposer.py",
    ]


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    proc = _run([str(script)], tmp_path)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{script.name} printed nothing"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_code_blocks_run(doc, tmp_path):
    """Every ```python block of a page runs, in order, as one script."""
    blocks = _PYTHON_BLOCK.findall(doc.read_text())
    script = tmp_path / f"{doc.stem}_blocks.py"
    script.write_text("\n\n".join(blocks))
    proc = _run([str(script)], tmp_path)
    assert proc.returncode == 0, f"code in {doc.name} failed:\n{proc.stdout}\n{proc.stderr}"
