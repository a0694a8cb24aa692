"""The ``specdec`` command line on the bundled model (bad input: test_bad_input.py)."""

from __future__ import annotations

import pytest

from specdec.cli import bundled_model_path, main

MTP_HEAD = bundled_model_path().parent / "stories260K-mtp"


def _common(*extra: str) -> list[str]:
    path = str(bundled_model_path())
    return ["generate", "--target", path, "--prompt", "Once upon a time", "--max-new-tokens", "12", "--dtype", "float32", *extra]


def test_generate_plain_and_speculative(capsys):
    assert main(_common()) == 0
    plain = capsys.readouterr().out
    assert main(_common("--draft", str(bundled_model_path()), "-k", "3")) == 0
    spec = capsys.readouterr().out
    assert "there was a little girl" in plain
    assert plain.split("\n[")[0] == spec.split("\n[")[0]  # same text with speculation
    assert "acceptance 1.00" in spec


@pytest.mark.parametrize(
    "proposer",
    [
        ["--prompt-lookup", "-k", "2"],
        ["--mtp-head", str(MTP_HEAD), "-k", "2"],
        ["--draft", str(bundled_model_path()), "-k", "2"],
        ["--eagle-head", str(bundled_model_path().parent / "stories260K-eagle"), "-k", "8", "--tree-top-k", "2"],
    ],
    ids=["lookup", "mtp", "draft", "eagle"],
)
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_generate_chooses_the_proposer_and_policy(capsys, proposer, policy):
    assert main(_common()) == 0
    plain = capsys.readouterr().out.split("\n[")[0]
    assert main(_common(*proposer, "--policy", policy)) == 0
    out = capsys.readouterr().out
    assert out.split("\n[")[0] == plain
    assert "acceptance" in out


def test_stream_with_several_prompts_streams_each(capsys):
    args = _common("--prompt", "The little dog")
    assert main(args) == 0
    batch = capsys.readouterr().out
    assert main([*args, "--stream"]) == 0
    streamed = capsys.readouterr().out
    for prompt in ("'Once upon a time'", "'The little dog'"):
        assert f"--- {prompt}" in streamed
    assert streamed.split("\n[")[0].strip() == batch.split("\n[")[0].strip()


@pytest.mark.usefixtures("kernel")
def test_generate_with_a_4bit_target_and_draft(capsys):
    """--quantization stores the target in 4 bits: its own text, which a 4-bit draft keeps."""
    base = ["generate", "--target", str(bundled_model_path()), "--prompt", "Once upon a time",
            "--max-new-tokens", "12", "--quantization", "q4"]  # fmt: skip
    assert main(base) == 0
    plain = capsys.readouterr().out.split("\n[")[0]
    draft = ["--draft", str(bundled_model_path()), "--draft-quantization", "q4", "-k", "3", "--policy", "fixed"]
    assert main([*base, *draft]) == 0
    spec = capsys.readouterr().out
    assert spec.split("\n[")[0] == plain and "acceptance" in spec
    assert main([*base, *draft, "--draft-confidence", "0.5"]) == 0  # chains end where it hesitates
    assert capsys.readouterr().out.split("\n[")[0] == plain


def test_generate_refuses_a_bad_draft_confidence(capsys):
    args = ["generate", "--target", str(bundled_model_path()), "--prompt", "x",
            "--draft", str(bundled_model_path()), "--draft-confidence", "1.5"]  # fmt: skip
    assert main(args) == 2
    assert "confidence_threshold must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_demo_quantization_defaults():
    """The demo's draft takes the target's format unless told otherwise (int8 for bf16)."""
    import argparse

    from specdec.demo import _quantizations

    ns = argparse.Namespace
    assert _quantizations(ns(quantization="none", draft_quantization=None)) == (None, "int8")
    assert _quantizations(ns(quantization="q4", draft_quantization=None)) == ("q4", "q4")
    assert _quantizations(ns(quantization="q4", draft_quantization="none")) == ("q4", None)
    assert _quantizations(ns(quantization="none", draft_quantization="q4")) == (None, "q4")


def test_max_model_len_bounds_generate_serve_and_demo(capsys, monkeypatch, tmp_path):
    """--max-model-len on every command that builds a Generator; without it, the model's context
    (the demo: 2048 within the target's context)."""
    import argparse
    import json

    import specdec.server
    from specdec.demo import _max_model_len

    for command in ("generate", "serve", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--max-model-len" in capsys.readouterr().out
    assert main(_common("--max-model-len", "20")) == 0
    assert "there was" in capsys.readouterr().out
    served = []
    monkeypatch.setattr(specdec.server, "serve", lambda gen, config, **kwargs: served.append(gen))
    path = str(bundled_model_path())
    assert main(["serve", path, "--dtype", "float32", "--max-model-len", "64"]) == 0
    assert main(["serve", path, "--dtype", "float32"]) == 0
    assert [g.max_sequence_len for g in served] == [64, 512]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 32768}))
    ns = argparse.Namespace
    assert _max_model_len(ns(max_model_len=None), bundled_model_path()) == 512
    assert _max_model_len(ns(max_model_len=None), tmp_path) == 2048
    assert _max_model_len(ns(max_model_len=8192), tmp_path) == 8192
