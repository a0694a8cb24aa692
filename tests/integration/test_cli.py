"""The ``specdec`` command line on the bundled model."""

from __future__ import annotations

from specdec.cli import bundled_model_path, main


def test_generate_plain_and_speculative(capsys):
    path = str(bundled_model_path())
    common = ["--target", path, "--prompt", "Once upon a time", "--max-new-tokens", "12", "--dtype", "float32"]
    assert main(["generate", *common]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", *common, "--draft", path, "-k", "3"]) == 0
    spec = capsys.readouterr().out
    assert "there was a little girl" in plain
    assert plain.split("\n[")[0] == spec.split("\n[")[0]  # same text with speculation
    assert "acceptance 1.00" in spec
