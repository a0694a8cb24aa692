"""The optimisation loop every head trainer shares (MTP, EAGLE), and what a run leaves behind.

A trainer builds its float32 head and a ``losses(indices, noise)`` function over its feature
store, and hands both to :func:`fit_head`: held-out chunks, AdamW with warm-up and cosine decay,
validation, checkpoints that resume exactly (safetensors + JSON, never pickles), then the
inference head saved and ``train_log.json`` written.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from specdec.config import non_negative_float, positive_float, positive_int

__all__ = ["LoopConfig", "TrainResult", "config_json", "fit_head", "lr_at", "split_indices", "train_loop"]


@attrs.frozen(kw_only=True)
class LoopConfig:
    """What the optimisation loop reads (:func:`train_loop`); every trainer's config extends it
    with its head's settings."""

    steps: int = attrs.field(default=1000, validator=positive_int)
    batch_size: int = attrs.field(default=8, validator=positive_int)  # chunks per step
    lr: float = attrs.field(default=1e-3, validator=positive_float)
    warmup_steps: int = attrs.field(default=50, validator=positive_int)
    min_lr_ratio: float = attrs.field(default=0.1, validator=non_negative_float)
    weight_decay: float = attrs.field(default=0.0, validator=non_negative_float)
    val_fraction: float = attrs.field(default=0.05, validator=non_negative_float)
    val_every: int = attrs.field(default=200, validator=positive_int)
    checkpoint_every: int = attrs.field(default=200, validator=positive_int)
    max_seconds: float | None = None  # stop early (and save) after this much training time
    seed: int = 0


@attrs.frozen
class TrainResult:
    """What a training run returns."""

    head: torch.nn.Module  # the float32 training copy
    history: list[dict[str, float]]  # one row per step: losses, lr, validation
    train_seconds: float
    steps: int


def fit_head(
    head: torch.nn.Module,
    losses: Callable[[torch.Tensor, torch.Generator | None], dict[str, torch.Tensor]],
    config: LoopConfig,
    out_dir: str | Path,
    *,
    num_chunks: int,  # chunks in the feature store that ``losses`` indexes
    save: Callable[[torch.nn.Module, Path], object],  # writes the inference head into out_dir
    validate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    resume: bool = True,
    stop_at: int | None = None,
    log: Callable[[str], None] | None = print,
) -> TrainResult:
    """Train ``head`` on ``losses`` under ``config`` (:func:`train_loop`), then ``save(head,
    out)`` and write ``out/train_log.json``. ``validate(head)`` runs every ``val_every`` steps
    and at the end; ``stop_at`` ends this call after that step with a checkpoint (the next call
    with the same config resumes and computes exactly what one call would have)."""
    out = Path(out_dir)
    train_idx, val_idx = split_indices(num_chunks, config)
    step, history, train_seconds = train_loop(
        head, losses, config, out, train_idx=train_idx, val_idx=val_idx,
        validate=validate, resume=resume, stop_at=stop_at, log=log,
    )  # fmt: skip
    save(head, out)
    (out / "train_log.json").write_text(json.dumps({"config": config_json(config), "history": history}, indent=1))
    return TrainResult(head=head, history=history, train_seconds=train_seconds, steps=step)


def split_indices(num_chunks: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` chunk indices: a seeded permutation, ``val_fraction`` held out."""
    order = torch.randperm(num_chunks, generator=torch.Generator().manual_seed(config.seed))
    num_val = 0
    if config.val_fraction > 0:
        num_val = min(num_chunks - 1, max(1, round(config.val_fraction * num_chunks)))
    return order[num_val:], order[:num_val]


def train_loop(
    head: torch.nn.Module,
    losses: Callable[[torch.Tensor, torch.Generator | None], dict[str, torch.Tensor]],
    config,
    out: Path,
    *,
    train_idx: torch.Tensor,  # [num_train] int64 chunk indices
    val_idx: torch.Tensor,  # [num_val] int64
    validate: Callable[[torch.nn.Module], dict[str, float]] | None,
    resume: bool,
    stop_at: int | None,
    log: Callable[[str], None] | None,
) -> tuple[int, list[dict[str, float]], float]:
    """The optimisation loop every head trainer shares: AdamW (betas 0.9/0.95), warm-up then
    cosine LR (:func:`lr_at`), clipping at 1.0, validation every ``val_every`` steps and at the
    end, checkpoints in ``out/checkpoint`` (resumed when ``resume``). ``config`` is any trainer
    config with the fields used here (steps, batch_size, lr, ..., seed).

    ``losses(indices, noise)`` returns ``"loss"`` (minimised) and parts to log; ``noise`` is the
    step's generator (``None`` at validation: no input noise). Returns ``(steps, history,
    train_seconds)``."""
    out.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay)
    step, history = 0, []
    ckpt = out / "checkpoint"
    if resume and (ckpt / "state.json").is_file():
        step, history = _load_checkpoint(ckpt, head, opt, config)
        if log:
            log(f"resumed from {ckpt} at step {step}")
    start = last_log = time.perf_counter()
    train_seconds = 0.0
    while step < config.steps:
        lr = lr_at(step, config)
        for group in opt.param_groups:
            group["lr"] = lr
        # Batches (and noise) depend on (seed, step) only, so a resumed run is the run it would have been.
        step_gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = train_idx[torch.randint(len(train_idx), (config.batch_size,), generator=step_gen)]
        parts = losses(idx, step_gen)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        train_seconds = time.perf_counter() - start
        row = {"step": step, "lr": lr, "seconds": round(train_seconds, 2), **{k: float(v.detach()) for k, v in parts.items()}}
        out_of_time = (config.max_seconds is not None and train_seconds >= config.max_seconds) or step == stop_at
        last = step == config.steps or out_of_time
        if step % config.val_every == 0 or last:
            row.update(_validation(head, losses, val_idx, validate))
        history.append(row)
        if log and (time.perf_counter() - last_log > 10 or step % config.val_every == 0 or last):
            last_log = time.perf_counter()
            shown = {k: round(v, 4) for k, v in row.items() if k != "step"}
            log(f"step {step}/{config.steps} {shown}")
        if step % config.checkpoint_every == 0 or last:
            _save_checkpoint(ckpt, head, opt, step, history, config)
        if out_of_time:
            break
    return step, history, train_seconds


def _validation(head, losses, val_idx, validate) -> dict[str, float]:
    row: dict[str, float] = {}
    if len(val_idx):
        head.eval()
        with torch.no_grad():
            parts = [losses(val_idx[i : i + 8], None) for i in range(0, len(val_idx), 8)]
        head.train()
        for key in parts[0]:
            row[f"val_{key}"] = float(sum(p[key] for p in parts) / len(parts))
    if validate is not None:
        head.eval()
        result = validate(head)
        head.train()
        for key, value in result.items():
            if isinstance(value, (int, float)):
                row[f"val_{key}"] = float(value)
    return row


def lr_at(step: int, config) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def config_json(config) -> dict[str, object]:
    """A trainer config as JSON data (enums by value, tuples as lists): what checkpoints record
    and compare."""
    return json.loads(json.dumps(attrs.asdict(config), default=lambda v: v.value))


def _save_checkpoint(ckpt: Path, head, opt, step: int, history, config) -> None:
    """Head weights and AdamW moments as safetensors, the rest as JSON (never pickles)."""
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True, exist_ok=True)
    state = opt.state_dict()
    tensors = {f"head.{k}": v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    scalars = {}
    for pid, pstate in state["state"].items():
        for key, value in pstate.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"opt.{pid}.{key}"] = value.contiguous().cpu()
            else:
                scalars[f"{pid}.{key}"] = float(value)
    save_file(tensors, str(ckpt / "tensors.tmp"))
    (ckpt / "tensors.tmp").replace(ckpt / "tensors.safetensors")
    meta = {"step": step, "history": history, "scalars": scalars,
            "param_groups": [{k: v for k, v in g.items()} for g in state["param_groups"]],
            "config": config_json(config)}
    (ckpt / "state.tmp").write_text(json.dumps(meta))
    (ckpt / "state.tmp").replace(ckpt / "state.json")


def _load_checkpoint(ckpt: Path, head, opt, config) -> tuple[int, list]:
    from safetensors.torch import load_file

    meta = json.loads((ckpt / "state.json").read_text())
    saved = dict(meta["config"])
    mine = config_json(config)
    # Steps and time budget may grow on resume; anything else changes the run, so refuse.
    diff = sorted(k for k in mine if k not in ("steps", "max_seconds", "val_every", "checkpoint_every") and saved.get(k) != mine[k])
    if diff:
        raise ValueError(f"checkpoint {str(ckpt)!r} was made with other settings ({diff}); use another out_dir or resume=False")
    tensors = load_file(str(ckpt / "tensors.safetensors"))
    device = next(head.parameters()).device
    head.load_state_dict({k[5:]: v.to(device) for k, v in tensors.items() if k.startswith("head.")})
    state = {"state": {}, "param_groups": meta["param_groups"]}
    for name, value in tensors.items():
        if name.startswith("opt."):
            _, pid, key = name.split(".", 2)
            state["state"].setdefault(int(pid), {})[key] = value.to(device)
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state["state"].setdefault(int(pid), {})[key] = torch.tensor(value)
    opt.load_state_dict(state)
    return int(meta["step"]), list(meta["history"])
