"""``specdec train-mtp`` / ``train-eagle`` end to end: data -> cached target features ->
training -> a head on disk -> its held-out acceptance.

The Python forms are :func:`train_mtp_pipeline` and :func:`train_eagle_pipeline`; the CLI maps
their flags onto them one to one. Both run one pipeline (:func:`run_pipeline`), each supplying
its :class:`HeadRecipe`: the trainer, how a trained head loads, and the proposer shapes its
acceptance is measured with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
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
from specdec.training.loop import config_json
from specdec.training.mtp import MTPTrainConfig, measure_acceptance, train_mtp

__all__ = ["HeadRecipe", "run_pipeline", "train_mtp_pipeline", "train_eagle_pipeline"]


@attrs.frozen(kw_only=True)
class HeadRecipe:
    """What one kind of head brings to :func:`run_pipeline`."""

    config: object  # the trainer's config (MTPTrainConfig, EagleTrainConfig)
    train: Callable  # train_mtp / train_eagle: (target, features, config, out, **run) -> TrainResult
    load: Callable  # (directory, target) -> the trained head in float32 (for eval_only)
    measure: Callable  # (head, target, prompts, tokenizer=, max_new_tokens=, **shape) -> dict
    shapes: dict[str, dict[str, object]]  # name -> the measure's shape keywords, reported
    validation: str  # the name of the shape validation measures every val_every steps
    feature_layers: Callable | None = None  # target -> the layers to cache; None: the last
    log_line: Callable[[str, dict], str]  # (shape name, acceptance) -> one line
    reported: dict[str, object] = attrs.field(factory=dict)  # added to the summary as they are


def train_mtp_pipeline(target: str | Path, out_dir: str | Path, data: TrainData, *, val_k: int = 1,
                       config: MTPTrainConfig | None = None, **options) -> dict[str, object]:
    """Train an MTP head for ``target`` and write it to ``out_dir``; returns the summary that is
    also written to ``out_dir/summary.json`` (timings, final losses, greedy acceptance through
    ``MTPHead`` at k = 1, 2, 3 and ``val_k``, which validation also uses). ``options``:
    ``dtype``, ``device``, ``features_dir``, ``eval_only``, ``log``, as :func:`run_pipeline`
    takes them (``eval_only`` measures the head already in ``out_dir``)."""
    from specdec.models.mtp_head import load_mtp_head

    recipe = HeadRecipe(
        config=config or MTPTrainConfig(), train=train_mtp,
        load=lambda path, model: load_mtp_head(path, model, dtype=torch.float32),
        measure=measure_acceptance, validation=f"k={val_k}",
        shapes={f"k={k}": {"num_speculative_tokens": k} for k in sorted({1, 2, 3, val_k})},
        log_line=lambda name, a: f"held-out greedy {name}: acceptance {a['acceptance_rate']:.3f}, "
        f"mean accepted length {a['mean_accepted_length']:.2f}, per position [{_rates(a)}]",
    )  # fmt: skip
    return run_pipeline(target, out_dir, data, recipe, **options)


def train_eagle_pipeline(target: str | Path, out_dir: str | Path, data: TrainData, *, top_k: int = 4, depth: int = 5,
                         num_verify_tokens: int = 16, config: EagleTrainConfig | None = None,
                         **options) -> dict[str, object]:
    """Train an EAGLE head for ``target`` and write it to ``out_dir``; returns the summary also
    written to ``out_dir/summary.json``: timings, final losses, and held-out greedy acceptance
    through ``EAGLETree`` with the dynamic tree (``top_k``, ``depth``, ``num_verify_tokens``;
    also the validation every ``val_every`` steps) and with chains of k = 1 and 3. ``options``:
    ``dtype``, ``device``, ``features_dir``, ``eval_only``, ``log``, as :func:`run_pipeline`
    takes them (``eval_only`` measures the head already in ``out_dir``).

    Example:
        >>> train_eagle_pipeline(bundled_model_path(), "heads/e", TrainData(self_distill_samples=64),
        ...                      config=EagleTrainConfig(steps=100), dtype="float32")
    """
    from specdec.models.eagle_checkpoints import load_eagle_head
    from specdec.proposers.tree_shape import TreeShape

    config = config or EagleTrainConfig()
    TreeShape(paths=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens)  # fail before any work
    tree = dict(tree=None, top_k=top_k, depth=depth, num_verify_tokens=num_verify_tokens)
    recipe = HeadRecipe(
        config=config, train=train_eagle,
        load=lambda path, model: load_eagle_head(path, model, dtype=torch.float32),
        measure=measure_eagle, validation="tree",
        shapes={"tree": tree, "chain k=1": dict(tree=chain_tree(1)), "chain k=3": dict(tree=chain_tree(3))},
        feature_layers=lambda model: eagle_feature_layers(model, config),
        log_line=lambda name, a: f"held-out greedy {name}: mean accepted length "
        f"{a['mean_accepted_length']:.2f} per verify step, acceptance per depth [{_rates(a)}]",
        reported={"tree": tree},
    )  # fmt: skip
    return run_pipeline(target, out_dir, data, recipe, **options)


def run_pipeline(
    target: str | Path,
    out_dir: str | Path,
    data: TrainData,
    recipe: HeadRecipe,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    features_dir: str | Path | None = None,
    eval_only: bool = False,
    log=print,
) -> dict[str, object]:
    """Load ``target``, build the chunks and held-out prompts of ``data``, cache the target's
    features (in ``features_dir``, default ``out_dir/features``), train the head into ``out_dir``
    and measure its held-out greedy acceptance for each of ``recipe.shapes``; the summary is
    written to ``out_dir/summary.json`` (``eval.json`` with ``eval_only``, which skips features
    and training and measures the head already in ``out_dir`` on the same prompts)."""
    t0 = time.perf_counter()
    model, tokenizer, path, chunks, prompts, timings = _prepare(target, data, dtype=dtype, device=device, log=log)
    out = Path(out_dir)

    def measure(head, name: str) -> dict[str, object]:
        return recipe.measure(head, model, prompts, tokenizer=tokenizer, max_new_tokens=data.val_tokens,
                              **recipe.shapes[name])  # fmt: skip

    if eval_only:  # measure a head already trained into out_dir on the same held-out prompts
        head, steps, history = recipe.load(out, model), None, []
    else:
        t = time.perf_counter()
        layers = None if recipe.feature_layers is None else recipe.feature_layers(model)
        features = compute_features(model, chunks, features_dir or out / "features", layers=layers, log=log)
        timings["features_s"] = time.perf_counter() - t
        result = recipe.train(model, features, recipe.config, out, validate=lambda h: measure(h, recipe.validation), log=log)
        timings["train_s"] = result.train_seconds
        head, steps, history = result.head, result.steps, result.history
    acceptance = {name: measure(head, name) for name in recipe.shapes}
    timings["total_s"] = time.perf_counter() - t0
    summary = _summary(path, dtype, device, chunks, steps, timings, history, acceptance, recipe.config, data)
    summary.update(recipe.reported)
    (out / ("eval.json" if eval_only else "summary.json")).write_text(json.dumps(summary, indent=1))
    if log:
        for name, a in acceptance.items():
            log(recipe.log_line(name, a))
    return summary


def _rates(acceptance: dict[str, object]) -> str:
    return ", ".join(f"{x:.2f}" for x in acceptance["per_position_acceptance"])


def _prepare(target, data: TrainData, *, dtype: str, device: str, log) -> tuple:
    """Load the target and build the training chunks and held-out prompts (both pipelines'
    first two stages): ``(model, tokenizer, path, chunks, prompts, timings)``."""
    from specdec.codec import load_tokenizer
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
