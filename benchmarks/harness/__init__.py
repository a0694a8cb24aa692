"""The benchmark harness: specdec and transformers, plain and speculative, side by side.

``python -m benchmarks.harness --help`` tells how to run it (:mod:`.cli`). One module a part:

- :mod:`.prompts`: the prompt sets, tokenized once.
- :mod:`.systems`: the SYSTEMS table, what each named system builds (one builder signature,
  ``build(pool, k) -> Runner``; specdec systems are a proposer factory in :class:`SpecdecBuild`).
- :mod:`.runners`: specdec, transformers and llama.cpp behind ``start_repeat``/``run``.
- :mod:`.pool`: the models the systems share, each loaded once.
- :mod:`.config`: :class:`HarnessConfig`, the grid and every system's options, checked.
- :mod:`.grid`: the grid run (warm-up, rotating turns, timing) and the result JSON.
- :mod:`.checks`, :mod:`.aggregate`, :mod:`.bounds`: greedy checks, the summary, the plain
  decoding bound.
- :mod:`.report`: the markdown table; :mod:`.cli`: flags, presets and ``main``.
"""

from benchmarks.harness.aggregate import summarize
from benchmarks.harness.bounds import close_bound, paired_bound_seconds, rate_against_bounds
from benchmarks.harness.checks import check_against_plain
from benchmarks.harness.cli import PRESETS, main, parse_args
from benchmarks.harness.config import HarnessConfig
from benchmarks.harness.grid import run_grid
from benchmarks.harness.pool import ModelPool
from benchmarks.harness.prompts import PROMPT_SETS, Prompt, PromptSet, tokenize_prompts
from benchmarks.harness.report import bounds_markdown, markdown_table
from benchmarks.harness.runners import HFRunner, LlamaCppRunner, Runner, RunStats, SpecdecRunner
from benchmarks.harness.systems import (
    HF_REFERENCE,
    REFERENCE,
    SYSTEMS,
    SpecdecBuild,
    System,
    SystemBuilder,
    grid_ks,
)

__all__ = [
    "HF_REFERENCE",
    "PRESETS",
    "PROMPT_SETS",
    "REFERENCE",
    "SYSTEMS",
    "HFRunner",
    "HarnessConfig",
    "LlamaCppRunner",
    "ModelPool",
    "Prompt",
    "PromptSet",
    "RunStats",
    "Runner",
    "SpecdecBuild",
    "SpecdecRunner",
    "System",
    "SystemBuilder",
    "bounds_markdown",
    "check_against_plain",
    "close_bound",
    "grid_ks",
    "main",
    "markdown_table",
    "paired_bound_seconds",
    "parse_args",
    "rate_against_bounds",
    "run_grid",
    "summarize",
    "tokenize_prompts",
]
