"""benchmarks.code_prompts: function headers with docstrings as self-distillation prompts."""

from __future__ import annotations

import pytest

from benchmarks.code_prompts import function_prompts, main
from specdec.training import read_prompts

SOURCE = '''import os


def documented(a, b=1):
    """Add a and b, the way the tests expect them added.

    More words.
    """
    return a + b


def short(x):
    """Too short."""
    return x


def undocumented(x):
    return x


@decorator
def decorated(x):
    """A decorated function whose docstring is long enough to count."""
    return x


class Holder:
    def method(self):
        """A method: only top-level functions are prompts, like HumanEval's."""


async def fetch(
    url,
):
    """Fetch a url: a signature over several lines stays whole."""
    return url
'''


def test_function_prompts_take_the_header_and_the_docstring_only():
    prompts = function_prompts(SOURCE)
    assert prompts == [
        'def documented(a, b=1):\n    """Add a and b, the way the tests expect them added.\n\n    More words.\n    """\n',
        'async def fetch(\n    url,\n):\n    """Fetch a url: a signature over several lines stays whole."""\n',
    ]
    assert function_prompts(SOURCE, min_doc_chars=5)[1].startswith("def short(x):")
    assert function_prompts(SOURCE, max_chars=60) == []
    assert function_prompts("def broken(:\n") == []


def test_main_writes_a_seeded_sample_the_trainer_reads(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(SOURCE)
    (tmp_path / "src" / "site-packages").mkdir()
    (tmp_path / "src" / "site-packages" / "b.py").write_text(SOURCE.replace("documented", "installed"))
    (tmp_path / "src" / "tests").mkdir()
    (tmp_path / "src" / "tests" / "c.py").write_text(SOURCE.replace("documented", "tested"))
    out = tmp_path / "p.jsonl"
    assert main(["--root", str(tmp_path / "src"), "--out", str(out), "--num", "5"]) == 0
    prompts = read_prompts(out)
    assert sorted(p.split("(")[0] for p in prompts) == ["async def fetch", "def documented"]  # others skipped
    assert "2 prompts of 2" in capsys.readouterr().out
    assert main(["--root", str(tmp_path / "src"), "--out", str(out), "--num", "1", "--seed", "3"]) == 0
    assert len(read_prompts(out)) == 1
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path / "missing"), "--out", str(out)])
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path / "src"), "--out", str(out), "--num", "0"])
