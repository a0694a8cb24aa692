"""``specdec train-mtp`` end to end: data -> cached target features -> training -> a head on disk.

The Python form is :func:`train_mtp_pipeline`; the CLI maps its flags onto it one to one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from specdec.training.data import self_distill, text_files, token_chunks
from specdec.training.features import compute_features
from specdec.training.mtp import MTPTrainConfig, measure_acceptance, train_mtp

__all__ = ["train_mtp_pipeline"]

NUM_VAL_PROMPTS = 8  # held-out chunks whose beginnings are the acceptance prompts
VAL_PROMPT_TOKENS = 48


def train_mtp_pipeline(
    target: str | Path,
    out_dir: str | Path,
    *,
    data: Sequence[str] = (),
    self_distill_samples: int = 0,
    distill_prompts: Sequence[str] = (),
    distill_tokens: int = 256,
    distill_temperature: float = 1.0,
    chunk_len: int = 256,
    max_chunks: int | None = None,
    max_bytes: int | None = None,
    val_prompts: Sequence[str] = (),
    val_k: int = 1,
    val_tokens: int = 64,
    config: MTPTrainConfig | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    features_dir: str | Path | None = None,
    eval_only: bool = False,
    log=print,
) -> dict[str, object]:
    """Train an MTP head for ``target`` and write it to ``out_dir``; returns the summary that is
    also written to ``out_dir/summary.json`` (timings, final losses, acceptance per k).

    ``eval_only`` skips features and training and measures the head already in ``out_dir`` on
    the same held-out prompts (written to ``out_dir/eval.json``)."""
    from specdec.generator import load_tokenizer
    from specdec.models.heads import load_mtp_head
    from specdec.models.loading import load_model

    config = config or MTPTrainConfig()
    if not data and self_distill_samples <= 0:
        raise ValueError("give data (text files) or self_distill_samples > 0 (the target's own generations)")
    t0 = time.perf_counter()
    model, _, path = load_model(target, dtype=dtype, device=device)
    tokenizer = load_tokenizer(path)
    timings: dict[str, float] = {"load_s": time.perf_counter() - t0}

    t = time.perf_counter()
    chunks, prompts = build_chunks(
        model, tokenizer, data=data, self_distill_samples=self_distill_samples, distill_prompts=distill_prompts,
        distill_tokens=distill_tokens, distill_temperature=distill_temperature, chunk_len=chunk_len,
        max_chunks=max_chunks, max_bytes=max_bytes, val_prompts=val_prompts,
    )
    timings["data_s"] = time.perf_counter() - t
    if log:
        log(f"data: {len(chunks)} training chunks x {chunk_len} tokens, {len(prompts)} held-out prompts")

    out = Path(out_dir)
    if eval_only:  # measure a head already trained into out_dir on the same held-out prompts
        head = load_mtp_head(out, model, dtype=torch.float32)
        steps, history = None, []
    else:
        t = time.perf_counter()
        features = compute_features(model, chunks, features_dir or out / "features", log=log)
        timings["features_s"] = time.perf_counter() - t

        def validate(head):
            return measure_acceptance(head, model, prompts, tokenizer=tokenizer,
                                      num_speculative_tokens=val_k, max_new_tokens=val_tokens)

        result = train_mtp(model, features, config, out, validate=validate, log=log)
        timings["train_s"] = result.train_seconds
        head, steps, history = result.head, result.steps, result.history
    acceptance = {}
    for k in sorted({1, 2, 3, val_k}):
        acceptance[f"k={k}"] = measure_acceptance(head, model, prompts, tokenizer=tokenizer,
                                                  num_speculative_tokens=k, max_new_tokens=val_tokens)
    timings["total_s"] = time.perf_counter() - t0
    last = history[-1] if history else {}
    summary = {
        "target": str(path), "dtype": dtype, "device": device, "num_chunks": len(chunks), "chunk_len": chunk_len,
        "num_train_tokens": len(chunks) * chunk_len, "steps": steps, "timings": timings,
        "final": {k: v for k, v in last.items() if k != "step"}, "held_out_acceptance": acceptance,
        "config": attrs.asdict(config),
    }
    (out / ("eval.json" if eval_only else "summary.json")).write_text(json.dumps(summary, indent=1))
    if log:
        for k, a in acceptance.items():
            per_pos = ", ".join(f"{x:.2f}" for x in a["per_position_acceptance"])
            log(f"held-out greedy {k}: acceptance {a['acceptance_rate']:.3f}, mean accepted length "
                f"{a['mean_accepted_length']:.2f}, per position [{per_pos}]")
    return summary


def build_chunks(
    model,
    tokenizer,
    *,
    data: Sequence[str] = (),
    self_distill_samples: int = 0,
    distill_prompts: Sequence[str] = (),
    distill_tokens: int = 256,
    distill_temperature: float = 1.0,
    chunk_len: int = 256,
    max_chunks: int | None = None,
    max_bytes: int | None = None,
    val_prompts: Sequence[str] = (),
) -> tuple[list[list[int]], list]:
    """Training chunks and held-out prompts: text files and/or the target's own generations;
    the last NUM_VAL_PROMPTS chunks are held out and their beginnings are the prompts."""
    from specdec import CacheConfig, Generator, SamplingParams

    chunks: list[list[int]] = []
    if data:
        texts = text_files(data, max_bytes=max_bytes)
        chunks += token_chunks(tokenizer, texts, chunk_len=chunk_len, max_chunks=max_chunks,
                               separator_id=next(iter(model.config.eos_token_ids), None))
    if self_distill_samples > 0:
        prompts = list(distill_prompts) or [[tokenizer.bos_token_id or 0]]
        longest = max(len(p) if not isinstance(p, str) else len(tokenizer.encode(p)) for p in prompts)
        gen = Generator.from_components(
            model, tokenizer, cache_config=CacheConfig(max_batch_size=64, max_num_tokens=longest + distill_tokens + 1)
        )
        prompts = [prompts[i % len(prompts)] for i in range(self_distill_samples)]
        params = [SamplingParams(max_new_tokens=distill_tokens, temperature=distill_temperature, seed=i, ignore_eos=True)
                  for i in range(self_distill_samples)]
        sequences = []
        for i in range(0, len(prompts), 64):
            sequences += self_distill(gen, prompts[i : i + 64], params[i : i + 64])
        chunks += [s[j : j + chunk_len] for s in sequences for j in range(0, len(s) - chunk_len + 1, chunk_len)]
    if len(chunks) < NUM_VAL_PROMPTS + 2:
        raise ValueError(f"only {len(chunks)} chunks of {chunk_len} tokens: give more data or a smaller chunk_len")
    held_out = chunks[-NUM_VAL_PROMPTS:]  # never trained on
    return chunks[:-NUM_VAL_PROMPTS], list(val_prompts) or [c[:VAL_PROMPT_TOKENS] for c in held_out]
