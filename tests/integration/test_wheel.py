"""``pip install specdec`` (a built wheel, not editable) works: every runtime file is packaged,
and a bf16 model loads and generates through the packed CPU kernel loaded from the installed
kernel source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec import Generator, SamplingParams
from specdec.kernels.cpu_linear import kernel_available

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_FILES = (
    "specdec/kernels/cpu_linear.cpp",
    "specdec/kernels/cpu_attention.cpp",
    "specdec/kernels/cpu_layer_ops.cpp",
    "specdec/kernels/cpu_quantized.cpp",
    "specdec/data/stories260K/model.safetensors",
    "specdec/data/stories260K/tokenizer.json",
    "specdec/data/stories260K-mtp/model.safetensors",
    "specdec/data/stories260K-eagle/model.safetensors",
    "specdec/data/stories260K-eagle/config.json",
)

SCRIPT = """
import json, sys, warnings
warnings.simplefilter("error")  # a kernel fallback warning fails the run
import specdec
from specdec import Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.kernels.cpu_linear import kernel_available
from specdec.proposers import EAGLETree, MTPHead
gen = Generator.from_pretrained(bundled_model_path(), dtype="bfloat16")
head = MTPHead.from_pretrained(bundled_model_path().parent / "stories260K-mtp", num_speculative_tokens=2)
spec = gen.with_proposer(head, policy=2)
params = SamplingParams(max_new_tokens=16, ignore_eos=True)
print(json.dumps({
    "file": specdec.__file__,
    "kernel": kernel_available(),
    "plain": gen.generate("Once upon a time", params).token_ids,
    "spec": spec.generate("Once upon a time", params).token_ids,
    "eagle": gen.with_proposer(EAGLETree.from_pretrained(bundled_model_path().parent / "stories260K-eagle"))
        .generate("Once upon a time", params).token_ids,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a clean copy of the project (a build in the checkout could pick up
    files from an earlier build/ or egg-info directory)."""
    tree = tmp_path_factory.mktemp("tree")
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(
        ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(tree)],
        check=True,
        cwd=out,
    )
    (path,) = out.glob("specdec-*.whl")
    return path


def test_wheel_holds_every_runtime_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in RUNTIME_FILES if f not in names]
    assert not missing, missing


def test_installed_wheel_loads_and_runs_a_bf16_model(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    # The kernel build is keyed by its sources' bytes: with the installed sources identical to
    # this checkout's, the installed package finds the build this test run already made (in
    # the run's own cache) instead of compiling the same bytes again for ~100 s.
    for name in RUNTIME_FILES:
        if name.endswith(".cpp"):
            assert (target / name).read_bytes() == (ROOT / "src" / name).read_bytes(), name
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(target)  # the wheel, not this checkout
    assert result["kernel"] == kernel_available()  # built from the installed source when possible
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    here = Generator.from_pretrained(ROOT / "src/specdec/data/stories260K", dtype="bfloat16")
    assert result["plain"] == here.generate("Once upon a time", params).token_ids
    assert result["spec"] == result["plain"]
    assert result["eagle"] == result["plain"]
