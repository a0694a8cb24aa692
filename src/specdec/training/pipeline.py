"""``specdec train-mtp`` / ``train-eagle`` end to end: data -> cached target features ->
training -> a head on disk.

The Python forms are :func:`train_mtp_pipeline` and :func:`train_eagle_pipeline`; the CLI maps
their flags onto them one to one. Both share the data and feature stages (``_prepare``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import attrs
import torch

from specdec.training.data import TrainData, build_chunks
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


def train_mtp_pipeline(
    target: str | Path,
    out_dir: str | Path,
    data: TrainData,
    *,
    val_k: int = 1,
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
    model, tokenizer, path, chunks, prompts, timings = _prepare(target, data, dtype=dtype, device=device, log=log)
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
                                      num_speculative_tokens=val_k, max_new_tokens=data.val_tokens)

        result = train_mtp(model, features, config, out, validate=validate, log=log)
        timings["train_s"] = result.train_seconds
        head, steps, history = result.head, result.steps, result.history
    acceptance = {}
    for k in sorted({1, 2, 3, val_k}):
        acceptance[f"k={k}"] = measure_acceptance(head, model, prompts, tokenizer=tokenizer,
                                                  num_speculative_tokens=k, max_new_tokens=data.val_tokens)
    timings["total_s"] = time.perf_counter() - t0
    summary = _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config, data)
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
    data: TrainData,
    *,
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
        >>> train_eagle_pipeline(bundled_model_path(), "heads/e", TrainData(self_distill_samples=64),
        ...                      config=EagleTrainConfig(steps=100), dtype="float32")
    """
    from specdec.models.eagle import load_eagle_head
    from specdec.proposers.tree_shape import TreeShape

    config = config or EagleTrainConfig()
    TreeShape(paths=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens)  # fail before any work
    t0 = time.perf_counter()
    model, tokenizer, path, chunks, prompts, timings = _prepare(target, data, dtype=dtype, device=device, log=log)
    out = Path(out_dir)
    trees = {"tree": dict(tree=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens),
             "chain k=1": dict(tree=chain_tree(1)), "chain k=3": dict(tree=chain_tree(3))}

    def measure(head, shape):
        return measure_eagle(head, model, prompts, tokenizer=tokenizer, max_new_tokens=data.val_tokens, **shape)

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
    summary = _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config, data)
    summary["tree"] = trees["tree"]
    (out / ("eval.json" if eval_only else "summary.json")).write_text(json.dumps(summary, indent=1))
    if log:
        for name, a in acceptance.items():
            per_pos = ", ".join(f"{x:.2f}" for x in a["per_position_acceptance"])
            log(f"held-out greedy {name}: mean accepted length {a['mean_accepted_length']:.2f} per verify "
                f"step, acceptance per depth [{per_pos}]")
    return summary


def _prepare(target, data: TrainData, *, dtype: str, device: str, log) -> tuple:
    """Load the target and build the training chunks and held-out prompts (both pipelines'
    first two stages): ``(model, tokenizer, path, chunks, prompts, timings)``."""
    from specdec.generator import load_tokenizer
    from specdec.models.loading import load_model

    if not isinstance(data, TrainData):
        raise TypeError(f"data must be a TrainData, got {type(data).__name__}")
    t0 = time.perf_counter()
    model, _, path = load_model(target, dtype=dtype, device=device)
    tokenizer = load_tokenizer(path)
    timings: dict[str, float] = {"load_s": time.perf_counter() - t0}
    t = time.perf_counter()
    chunks, prompts = build_chunks(model, tokenizer, data)
    timings["data_s"] = time.perf_counter() - t
    if log:
        log(f"data: {len(chunks)} training chunks x {data.chunk_len} tokens, {len(prompts)} held-out prompts")
    return model, tokenizer, path, chunks, prompts, timings


def _summary(path, dtype, device, chunks, steps, timings, history, acceptance, config, data) -> dict[str, object]:
    last = history[-1] if history else {}
    return {
        "target": str(path), "dtype": dtype, "device": device, "num_chunks": len(chunks),
        "chunk_len": len(chunks[0]), "num_train_tokens": len(chunks) * len(chunks[0]), "steps": steps,
        "timings": timings, "final": {k: v for k, v in last.items() if k != "step"},
        "held_out_acceptance": acceptance, "config": config_json(config),
        "data": json.loads(json.dumps(attrs.asdict(data), default=list)),
    }
