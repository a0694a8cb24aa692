"""``specdec generate``'s proposer options come from the registry: aliases, context errors, help."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from helpers import run_cli

from specdec.cli import build_parser, bundled_model_path, main
from specdec.proposers.registry import load_registry

EAGLE_HEAD = bundled_model_path().parent / "stories260K-eagle"


_cli = run_cli  # (exit code, stdout, stderr) of one `specdec` command


def _generate(*extra: str) -> list[str]:
    return ["generate", "--target", str(bundled_model_path()), "--prompt", "Once upon a time",
            "--max-new-tokens", "12", "--dtype", "float32", *extra]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--tree-top-k", "2"], ["--tree-top-k", "--proposer eagle"]),
        (["--draft", "d", "--tree-depth", "3"], ["--tree-depth", "--draft"]),
        (["--draft-quantization", "q4"], ["--draft-quantization", "--proposer draft"]),
        (["--prompt-lookup", "--draft-confidence", "0.5"], ["--draft-confidence", "--prompt-lookup"]),
        (["-k", "3"], ["-k", "--proposer"]),
        (["--policy", "fixed"], ["--policy", "--proposer"]),
        (["--proposer", "mtp", "--draft", "d"], ["--draft", "--proposer mtp"]),
        (["--eagle-head", "h", "--prompt-lookup"], ["--prompt-lookup", "--eagle-head"]),
        (["--proposer", "draft"], ["--proposer draft", "--draft PATH"]),
        (["--proposer", "nope"], ["--proposer", "'draft'", "'prompt-lookup'"]),
    ],
    ids=["tree-without-eagle", "tree-with-draft", "draft-quant-alone", "confidence-with-lookup",
         "k-alone", "policy-alone", "two-proposers", "two-aliases", "missing-path", "unknown"],
)
def test_an_option_out_of_its_context_is_a_usage_error(capsys, args, names):
    code, out, err = _cli(_generate(*args), capsys)
    assert code == 2 and "usage:" in err and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("specdec generate: error: argument") or "needs" in last, last
    for name in names:
        assert name in last, last


def test_proposer_name_and_alias_select_the_same_entry(capsys):
    assert main(_generate()) == 0
    plain = capsys.readouterr().out.split("\n[")[0]
    runs = [
        ["--proposer", "prompt-lookup", "-k", "2"],
        ["--proposer", "draft", "--draft", str(bundled_model_path()), "-k", "2", "--policy", "fixed"],
        ["--proposer", "eagle", "--eagle-head", str(EAGLE_HEAD), "--tree-top-k", "2", "-k", "8"],
    ]
    for args in runs:
        assert main(_generate(*args)) == 0
        out = capsys.readouterr().out
        assert out.split("\n[")[0] == plain, args
        assert "drafted " in out and "acceptance" in out


def _parsers(parser: argparse.ArgumentParser, prog: str = "specdec"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_flag_of_every_command_has_help():
    parsers = dict(_parsers(build_parser(load_registry())))
    assert {"specdec generate", "specdec demo", "specdec train-mtp", "specdec train-eagle"} <= set(parsers)
    missing = [
        f"{prog} {'/'.join(action.option_strings) or action.dest}"
        for prog, parser in parsers.items()
        for action in parser._actions
        if not (action.help or "").strip()
    ]
    assert missing == []


def test_generate_help_lists_every_registered_proposer_and_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for entry in load_registry().entries:
        assert f"--proposer {entry.name}" in text
        for option in entry.options:
            assert option.flag in text


def test_demo_refuses_a_zero_k(capsys):
    code, _, err = _cli(["demo", "-k", "0"], capsys)
    assert code == 2 and "must be an int >= 1" in err


def test_python_dash_m_specdec():
    run = subprocess.run([sys.executable, "-m", "specdec", "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for command in ("generate", "fetch", "demo", "train-mtp", "train-eagle"):
        assert command in run.stdout
    bad = subprocess.run([sys.executable, "-m", "specdec", "generate", "--target", "x", "--prompt", "y", "-k", "2"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("specdec generate: error: argument -k")
