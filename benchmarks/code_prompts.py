"""Code-completion prompts for self-distillation: function headers with their docstrings.

HumanEval's prompts are a signature and a docstring that the model completes; a head serves
best on text like what it is used on, so self-distilled training data for code heads starts from
prompts of that shape. This takes them from Python sources found on every machine (the
standard library by default), never from HumanEval, and writes a JSON-lines file for
``specdec train-eagle/train-mtp --distill-prompts``::

    python -m benchmarks.code_prompts --out prompts.jsonl --num 512
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from collections.abc import Iterable
from pathlib import Path

__all__ = ["function_prompts", "main"]


def function_prompts(source: str, *, min_doc_chars: int = 40, max_chars: int = 1500) -> list[str]:
    """``def`` line(s) through the end of the docstring of every top-level function of
    ``source`` that has a docstring of at least ``min_doc_chars`` characters, newline-ended,
    each at most ``max_chars`` long. Sources that do not parse give no prompt."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    prompts = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        if doc is None or len(doc) < min_doc_chars or first.end_lineno is None:
            continue
        text = "\n".join(lines[node.lineno - 1 : first.end_lineno]) + "\n"
        if len(text) <= max_chars:
            prompts.append(text)
    return prompts


_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def _sources(root: Path) -> Iterable[str]:
    """Texts of the ``.py`` files under ``root``, in sorted order, leaving out installed packages
    (they differ between machines) and test suites (they rarely document functions as an API does)."""
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.code_prompts", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="directory of Python sources")
    parser.add_argument("--out", required=True, help="JSON-lines file to write")
    parser.add_argument("--num", type=int, default=512, help="how many prompts (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num < 1:
        parser.error(f"--num must be >= 1, got {args.num}")
    root = Path(args.root)
    if not root.is_dir():
        parser.error(f"--root {args.root!r} is not a directory")
    prompts = sorted({p for src in _sources(root) for p in function_prompts(src)})
    random.Random(args.seed).shuffle(prompts)
    chosen = prompts[: args.num]
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in chosen), encoding="utf-8")
    print(f"{len(chosen)} prompts of {len(prompts)} found under {root} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
