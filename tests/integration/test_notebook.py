"""The tour notebook runs end to end on stories260K and writes its plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "specdec_tour.ipynb"
KERNEL_NAME = "specdec-test-python"
PLOTS = ("per_position_acceptance.png", "tokens_per_second.png")


def _kernelspec_dir(root: Path) -> Path:
    """A kernelspec that runs this interpreter, so the kernel sees the same installed specdec.

    The stock ``python3`` spec may resolve to another interpreter (a user-level spec wins over
    the venv's); a uniquely named spec under ``JUPYTER_PATH`` cannot.
    """
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "specdec test", "language": "python"})
    )
    return root


def _inject_parameters(nb, params: dict[str, object]) -> None:
    """Papermill's convention: a cell after the ``parameters`` cell overrides its values."""
    index = next(
        i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])
    )
    source = "\n".join(f"{name} = {value!r}" for name, value in params.items())
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(index + 1, cell)


def test_tour_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec_dir(tmp_path / "jupyter")))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits it before importing torch
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    out_dir = tmp_path / "plots"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(c.get("outputs", []) == [] for c in nb.cells if c.cell_type == "code"), (
        "store the notebook without outputs"
    )
    _inject_parameters(nb, {"MODEL": "stories260K", "MAX_NEW_TOKENS": 24, "OUT_DIR": str(out_dir)})
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))

    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    assert nb.cells[-1].outputs[0]["text"].strip() == sys.executable
    for name in PLOTS:
        path = out_dir / name
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
