"""``specdec train-mtp`` / ``train-eagle`` end to end: data -> cached target features ->
training -> a head on disk.

The Python forms are :func:`train_mtp_pipeline` and :func:`train_eagle_pipeline`; the CLI maps
their flags onto them one to one. Both share the data and feature stages (``_prepare``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.training.data import self_distill, text_files, token_chunks
from specdec.training.eagle import (
    EagleTrainConfig,
    chain_tree,
    eagle_feature_layers,
    measure_eagle,
    train_eagle,
)
from specdec.training.features import compute_features
from specdec.training.mtp import MTPTrainConfig, config_json, measure_acceptance, train_mtp

__all__ = ["train_mtp_pipeline", "train_eagle_pipeline"]

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
    from specdec.models.heads import load_mtp_head

    config = config or MTPTrainConfig()
    t0 = time.perf_counter()
    model, tokenizer, path, chunks, prompts, timings = _prepare(
        target, dtype=dtype, device=device, data=data, self_distill_samples=self_distill_samples,
        distill_prompts=distill_prompts, distill_tokens=distill_tokens, distill_temperature=distill_temperature,
        chunk_len=chunk_len, max_chunks=max_chunks, max_bytes=max_bytes, val_prompts=val_prompts, log=log,
    )
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
    summary = _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config)
    (out / ("eval.json" if eval_only else "summary.json")).write_text(json.dumps(summary, indent=1))
    if log:
        for k, a in acceptance.items():
            per_pos = ", ".join(f"{x:.2f}" for x in a["per_position_acceptance"])
            log(f"held-out greedy {k}: acceptance {a['acceptance_rate']:.3f}, mean accepted length "
                f"{a['mean_accepted_length']:.2f}, per position [{per_pos}]")
    return summary


def train_eagle_pipeline(
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
    val_tokens: int = 64,
    top_k: int = 4,
    depth: int = 5,
    num_verify_tokens: int = 16,
    config: EagleTrainConfig | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    features_dir: str | Path | None = None,
    eval_only: bool = False,
    log=print,
) -> dict[str, object]:
    """Train an EAGLE head for ``target`` and write it to ``out_dir``; returns the summary also
    written to ``out_dir/summary.json``: timings, final losses, and held-out greedy acceptance
    through ``EAGLETree`` with the dynamic tree (``top_k``, ``depth``, ``num_verify_tokens``;
    also the validation every ``val_every`` steps) and with chains of k = 1 and 3.

    ``eval_only`` measures the head already in ``out_dir`` (written to ``out_dir/eval.json``).

    Example:
        >>> train_eagle_pipeline(bundled_model_path(), "heads/e", self_distill_samples=64,
        ...                      config=EagleTrainConfig(steps=100), dtype="float32")
    """
    from specdec.models.eagle import load_eagle_head
    from specdec.proposers.tree_shape import TreeShape

    config = config or EagleTrainConfig()
    TreeShape(paths=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens)  # fail before any work
    t0 = time.perf_counter()
    model, tokenizer, path, chunks, prompts, timings = _prepare(
        target, dtype=dtype, device=device, data=data, self_distill_samples=self_distill_samples,
        distill_prompts=distill_prompts, distill_tokens=distill_tokens, distill_temperature=distill_temperature,
        chunk_len=chunk_len, max_chunks=max_chunks, max_bytes=max_bytes, val_prompts=val_prompts, log=log,
    )
    out = Path(out_dir)
    trees = {"tree": dict(tree=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens),
             "chain k=1": dict(tree=chain_tree(1)), "chain k=3": dict(tree=chain_tree(3))}

    def measure(head, shape):
        return measure_eagle(head, model, prompts, tokenizer=tokenizer, max_new_tokens=val_tokens, **shape)

    if eval_only:
        head = load_eagle_head(out, model, dtype=torch.float32)
        steps, history = None, []
    else:
        t = time.perf_counter()
        layers = eagle_feature_layers(model, config)
        features = compute_features(model, chunks, features_dir or out / "features", layers=layers, log=log)
        timings["features_s"] = time.perf_counter() - t
        result = train_eagle(model, features, config, out, validate=lambda h: measure(h, trees["tree"]), log=log)
        timings["train_s"] = result.train_seconds
        head, steps, history = result.head, result.steps, result.history
    acceptance = {name: measure(head, shape) for name, shape in trees.items()}
    timings["total_s"] = time.perf_counter() - t0
    summary = _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config)
    summary["tree"] = trees["tree"]
    (out / ("eval.json" if eval_only else "summary.json")).write_text(json.dumps(summary, indent=1))
    if log:
        for name, a in acceptance.items():
            per_pos = ", ".join(f"{x:.2f}" for x in a["per_position_acceptance"])
            log(f"held-out greedy {name}: mean accepted length {a['mean_accepted_length']:.2f} per verify "
                f"step, acceptance per depth [{per_pos}]")
    return summary


def _prepare(target, *, dtype: str, device: str, log, **data_args) -> tuple:
    """Load the target and build the training chunks and held-out prompts (both pipelines'
    first two stages): ``(model, tokenizer, path, chunks, prompts, timings)``."""
    from specdec.generator import load_tokenizer
    from specdec.models.loading import load_model

    if not data_args["data"] and data_args["self_distill_samples"] <= 0:
        raise ValueError("give data (text files) or self_distill_samples > 0 (the target's own generations)")
    t0 = time.perf_counter()
    model, _, path = load_model(target, dtype=dtype, device=device)
    tokenizer = load_tokenizer(path)
    timings: dict[str, float] = {"load_s": time.perf_counter() - t0}
    t = time.perf_counter()
    chunks, prompts = build_chunks(model, tokenizer, **data_args)
    timings["data_s"] = time.perf_counter() - t
    if log:
        log(f"data: {len(chunks)} training chunks x {data_args['chunk_len']} tokens, {len(prompts)} held-out prompts")
    return model, tokenizer, path, chunks, prompts, timings


def _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config) -> dict[str, object]:
    last = history[-1] if history else {}
    return {
        "target": str(path), "dtype": dtype, "device": device, "num_chunks": len(chunks),
        "chunk_len": len(chunks[0]), "num_train_tokens": len(chunks) * len(chunks[0]), "steps": steps,
        "timings": timings, "final": {k: v for k, v in last.items() if k != "step"},
        "held_out_acceptance": acceptance, "config": config_json(config),
    }


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
