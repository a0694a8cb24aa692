"""The harness's one configuration: every axis of the grid and every system's options."""

from __future__ import annotations

import attrs

from benchmarks.common import RESULTS
from benchmarks.harness.prompts import PROMPT_SETS

# The README table's systems; the others need a flag (a head, a GGUF file) or answer another
# question (adaptive, unquantized, quantized targets).
DEFAULT_SYSTEMS = (
    "specdec-plain", "specdec-draft", "specdec-draft-vocab", "specdec-lookup",
    "hf-plain", "hf-assisted", "hf-lookup",
)  # fmt: skip


@attrs.frozen(kw_only=True)
class HarnessConfig:
    """One harness run: the grid (systems x prompt sets x k x temperature x batch size x
    threads), its repeats, the models and the options of the systems that take some. Fields
    are the CLI's flags (``--num-prompts`` -> ``num_prompts``); checked on construction."""

    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    prompt_sets: tuple[str, ...] = ("humaneval",)
    num_prompts: int = 10
    ks: tuple[int, ...] = (2, 4)
    temperatures: tuple[float, ...] = (0.0,)
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    warmup_tokens: int = 8
    threads: tuple[int, ...] = (1,)
    dtype: str = "bfloat16"
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: str = "qwen2.5-coder-0.5b-instruct"
    draft_quantization: str | None = None  # "int8": the draft's linear layers as int8
    draft_confidence: float = 0.4  # the -draft-confident and -mtp-confident systems' confidence_threshold
    # Per-system k lists that replace ``ks`` (e.g. one k for transformers' slower systems).
    system_ks: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    mtp_head: str | None = None
    mtp_draft_vocab: int | None = None  # draft from the head's N most frequent training tokens
    draft_vocab: int = 32768  # the -vocab systems: the N tokens most frequent in stdlib code
    eagle_head: str | None = None
    head_quantization: str | None = None  # "int8" / "q4": the MTP and EAGLE heads' linear layers
    llamacpp_target: str | None = None  # the target as a GGUF file, for llamacpp-plain
    tree_top_k: int = 4
    tree_depth: int = 5
    tree_min_prob: float = 0.1  # specdec-eagle-tree-confident: the least verified path probability
    # Options of registered plug-in proposers (their systems are specdec-<name>), by option name.
    proposer_options: dict[str, str] = attrs.field(factory=dict)
    seed: int = 0
    out: str = "harness"
    out_dir: str = str(RESULTS)
    plots: bool = True

    def __attrs_post_init__(self) -> None:
        _check_prompt_sets(self)
        _check_grid(self)


def _check_prompt_sets(cfg: HarnessConfig) -> None:
    unknown = set(cfg.prompt_sets) - set(PROMPT_SETS)
    if unknown:
        raise ValueError(f"--prompt-sets: unknown {sorted(unknown)}; choose from {list(PROMPT_SETS)}")


def _check_grid(cfg: HarnessConfig) -> None:
    if not cfg.threads or any(t < 1 for t in cfg.threads):
        raise ValueError(f"--threads takes integers >= 1, got {cfg.threads}")
    for name in ("num_prompts", "max_new_tokens", "repeats"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if any(k < 1 for k in cfg.ks) or any(b < 1 for b in cfg.batch_sizes):
        raise ValueError("--k and --batch-sizes take integers >= 1")
    if any(t < 0 for t in cfg.temperatures):
        raise ValueError("--temperatures must be >= 0")
    if cfg.tree_top_k < 1 or cfg.tree_depth < 1:
        raise ValueError(
            f"--tree-top-k and --tree-depth must be >= 1, got {cfg.tree_top_k}, {cfg.tree_depth}"
        )
    if not 0.0 <= cfg.tree_min_prob < 1.0:
        raise ValueError(f"--tree-min-prob must be in [0, 1), got {cfg.tree_min_prob}")
