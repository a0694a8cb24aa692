"""``specdec generate``'s proposer options come from the registry: aliases, context errors, help."""

from __future__ import annotations

import argparse
import json
import re
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


# --- sampling flags -> SamplingParams (parsing only: no model is loaded) ----------------------------


def _params(*extra: str):
    from specdec.cli import _sampling_params

    return _sampling_params(build_parser(load_registry()).parse_args(_generate(*extra)))


def test_no_sampling_flags_give_the_default_params_but_max_new_tokens():
    import attrs

    from specdec import SamplingParams

    assert _params() == attrs.evolve(SamplingParams(), max_new_tokens=12)


@pytest.mark.parametrize(
    ("args", "fields"),
    [
        (["--repetition-penalty", "1.3"], {"repetition_penalty": 1.3}),
        (["--frequency-penalty", "-0.5"], {"frequency_penalty": -0.5}),
        (["--presence-penalty", "1.5"], {"presence_penalty": 1.5}),
        (["--logit-bias", "7=-100", "--logit-bias", "3=2.5"], {"logit_bias": ((3, 2.5), (7, -100.0))}),
        (["--allowed-token-ids", "5,1,9"], {"allowed_token_ids": (5, 1, 9)}),
        (["--bad-word", "dog", "--bad-word", "big cat"], {"bad_words": ("dog", "big cat")}),
        (["--min-tokens", "4"], {"min_tokens": 4}),
        (["--n", "3", "--temperature", "0.7"], {"n": 3, "temperature": 0.7}),
        (["--prompt-logprobs", "2"], {"prompt_logprobs": 2}),
        (["--logprobs", "0"], {"logprobs": 0}),
        (["--stop-token-id", "2", "--stop-token-id", "13"], {"stop_token_ids": (2, 13)}),
        (["--ignore-eos"], {"ignore_eos": True}),
        (["--stop", "The end", "--seed", "3"], {"stop": ("The end",), "seed": 3}),
        (["--regex", "[0-9]+"], {"structured_output": {"regex": "[0-9]+"}}),
        (["--choice", "yes", "--choice", "no"], {"structured_output": {"choice": ("yes", "no")}}),
        (["--json-object"], {"structured_output": {"json_object": True}}),
        (["--json-schema", '{"type": "object"}'], {"structured_output": {"json_schema": {"type": "object"}}}),
    ],
    ids=["repetition", "frequency", "presence", "logit-bias", "allowed", "bad-words", "min-tokens", "n",
         "prompt-logprobs", "logprobs", "stop-token-ids", "ignore-eos", "stop-seed", "regex", "choice",
         "json-object", "json-schema-inline"],
)
def test_each_sampling_flag_sets_its_field(args, fields):
    import attrs

    from specdec.config import StructuredOutput

    if "structured_output" in fields:
        fields = {**fields, "structured_output": StructuredOutput(**fields["structured_output"])}
    params = _params(*args)
    assert params == attrs.evolve(_params(), **fields)
    assert params.structured_output == fields.get("structured_output")  # built only when one is given


def test_json_schema_and_grammar_files(tmp_path):
    from specdec.config import StructuredOutput

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema, indent=2))
    from_file = _params("--json-schema", str(path)).structured_output
    assert from_file == _params("--json-schema", json.dumps(schema)).structured_output
    assert from_file == StructuredOutput(json_schema=schema)
    grammar = 'root ::= "yes" | "no"\n'
    (tmp_path / "yn.ebnf").write_text(grammar)
    assert _params("--grammar", str(tmp_path / "yn.ebnf")).structured_output == StructuredOutput(grammar=grammar)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--json-object", "--regex", "a+"], ["--regex", "--json-object"]),
        (["--choice", "a", "--json-schema", "{}"], ["--json-schema", "--choice"]),
        (["--grammar", __file__, "--choice", "a"], ["--choice", "--grammar"]),
    ],
    ids=["json-object-regex", "choice-schema", "grammar-choice"],
)
def test_two_structured_output_flags_are_a_usage_error(capsys, args, names):
    code, out, err = _cli(_generate(*args), capsys)
    assert code == 2 and "usage:" in err and out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("specdec generate: error: argument") and "not allowed with" in last, last
    for name in names:
        assert name in last, last


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--logit-bias", "abc"], "argument --logit-bias: must be ID=BIAS"),
        (["--logit-bias", "5=big"], "argument --logit-bias: must be ID=BIAS"),
        (["--json-schema", "{bad"], "argument --json-schema: invalid JSON"),
        (["--json-schema", "[1, 2]"], "cannot read '[1, 2]': No such file or directory (inline JSON starts with '{')"),
        (["--json-schema", "/no/such/schema.json"], "argument --json-schema: cannot read '/no/such/schema.json'"),
        (["--grammar", "/no/such/grammar.ebnf"], "argument --grammar: cannot read"),
        (["--allowed-token-ids", "1,x"], "argument --allowed-token-ids: must be comma-separated ints"),
        (["--min-tokens", "two"], "argument --min-tokens: invalid int value"),
    ],
    ids=["bias-syntax", "bias-value", "schema-json", "schema-not-object", "schema-file", "grammar-file",
         "allowed-ids", "min-tokens-int"],
)
def test_malformed_sampling_flags_are_usage_errors(capsys, args, match):
    code, out, err = _cli(_generate(*args), capsys)
    assert code == 2 and "usage:" in err and out == "" and "Traceback" not in err
    assert match in err.strip().splitlines()[-1], err


def test_a_json_schema_file_must_hold_a_json_object(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{\"type\": ")
    (tmp_path / "list.json").write_text("[1]")
    code, _, err = _cli(_generate("--json-schema", str(tmp_path / "broken.json")), capsys)
    assert code == 2 and "argument --json-schema: invalid JSON in" in err and "broken.json" in err
    code, _, err = _cli(_generate("--json-schema", str(tmp_path / "list.json")), capsys)
    assert code == 2 and "argument --json-schema: a JSON schema must be a JSON object, got list" in err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--frequency-penalty", "5"], r"frequency_penalty must be in \[-2.0, 2.0\], got 5.0"),
        (["--presence-penalty", "-3"], r"presence_penalty must be in \[-2.0, 2.0\]"),
        (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
        (["--logit-bias", "4=150"], r"logit_bias\[4\] must be in \[-100.0, 100.0\]"),
        (["--logit-bias", "4=1", "--logit-bias", "4=2"], "--logit-bias gives token 4 twice"),
        (["--allowed-token-ids", "3,-1"], "allowed_token_ids must hold token ids >= 0"),
        (["--min-tokens", "20"], r"min_tokens \(20\) must be <= max_new_tokens \(12\)"),
        (["--n", "2"], "n = 2 needs temperature > 0"),
        (["--n", "0"], "n must be >= 1"),
        (["--prompt-logprobs", "-1"], "prompt_logprobs must be >= 0"),
        (["--choice", "a", "--ignore-eos"], "structured_output and ignore_eos contradict"),
        (["--regex", ""], "structured_output.regex must be a non-empty string"),
        (["--stop-token-id", "-2"], "stop_token_ids must hold token ids >= 0"),
    ],
    ids=["frequency", "presence", "repetition", "bias-range", "bias-twice", "allowed-negative", "min-tokens",
         "n-greedy", "n-zero", "prompt-logprobs", "choice-ignore-eos", "empty-regex", "stop-token-id"],
)
def test_out_of_range_sampling_values_are_one_line_errors(capsys, args, match):
    code, out, err = _cli(_generate(*args), capsys)  # refused before the model is loaded
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert re.search(match, lines[0]), lines[0]
