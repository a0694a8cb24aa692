"""The CPU kernels' build folder is keyed by the sources and by the environment that builds them
(another virtual environment writes another build.ninja, which would make ninja rebuild a
shared folder), and a build says so before its long wait."""

from __future__ import annotations

import logging
import sys

import pytest

from specdec.kernels import cpu_linear
from specdec.kernels.cpu_linear import build_environment, build_key

SOURCES = [b"// cpu_linear.cpp", b"// cpu_decoder.cpp"]
ENV = {
    "python": "/venvs/a/bin/python",
    "prefix": "/venvs/a",
    "torch_include": "/venvs/a/lib/python3.11/site-packages/torch/include",
    "cflags": "-O3 -mavx2",
}


def test_key_is_stable_for_the_same_inputs():
    assert build_key(SOURCES, ENV) == build_key(list(SOURCES), dict(ENV))
    assert build_key(SOURCES, ENV) == build_key(SOURCES, dict(reversed(list(ENV.items()))))
    assert len(build_key(SOURCES, ENV)) == 12 and int(build_key(SOURCES, ENV), 16) >= 0


@pytest.mark.parametrize("field", sorted(ENV))
def test_key_differs_for_another_environment(field):
    assert build_key(SOURCES, {**ENV, field: ENV[field] + "-other"}) != build_key(SOURCES, ENV)


def test_key_differs_for_other_sources():
    assert build_key([SOURCES[0] + b" ", SOURCES[1]], ENV) != build_key(SOURCES, ENV)
    # Per-file hashing: moving bytes from one file to the next is another build.
    assert build_key([b"ab", b"c"], ENV) != build_key([b"a", b"bc"], ENV)


def test_environment_names_this_interpreter_and_torch():
    env = build_environment()
    assert env["python"] == sys.executable and env["prefix"] == sys.prefix
    assert "torch" in env["torch_include"] and env == build_environment()


def test_a_build_is_announced_and_a_reuse_is_not(tmp_path, monkeypatch, caplog):
    """``cpp_extension.load`` stubbed: the folder is the keyed one, and the warning on the
    ``specdec.kernels`` logger comes before a build only (no built library in the folder)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []

    def fake_load(*, name, build_directory, **kwargs):
        calls.append(build_directory)
        return "kernel"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with caplog.at_level(logging.WARNING, logger="specdec.kernels"):
        assert cpu_linear._build_and_load() == "kernel"
    folder = tmp_path / "torch_extensions"
    (build_dir,) = folder.iterdir()
    codes = [
        (cpu_linear.Path(cpu_linear.__file__).parent / n).read_bytes()
        for n in (*cpu_linear._SOURCES, *cpu_linear._HEADERS)
    ]
    assert build_dir.name.endswith(build_key(codes, build_environment())) and calls == [
        str(build_dir)
    ]
    assert "building specdec CPU kernels (first use in this environment, about a minute)" in caplog.text
    caplog.clear()
    (build_dir / "specdec_cpu_kernels.so").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="specdec.kernels"):
        cpu_linear._build_and_load()
    assert caplog.text == "" and len(calls) == 2
