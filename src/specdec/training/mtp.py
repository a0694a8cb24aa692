"""Train an MTP head on cached target features (see :mod:`specdec.training.features`).

Objective, for pair ``i`` (target hidden ``h_i``, token ``t_{i+1}``) with head output ``g_i``:

- token loss: cross-entropy of the head's distribution against the *target's* distribution at
  position ``i + 1`` (softmax of ``lm_head(norm(h_{i+1}))``): self-distillation on the target's
  own next-next-token beliefs, which is what verification will compare against;
- hidden loss: ``|g_i - h_{i+1}|^2 / |h_{i+1}|^2`` (relative, so the few huge activation
  channels of real models do not dominate): later draft positions feed on ``g`` as if it were
  ``h``.

The vocabulary of the softmax is, by default, the tokens present in the training data (the
target's own LM head rows, frozen): on a 150k-token vocabulary that cuts the dominant cost of a
step several-fold while keeping every token the data can teach. AdamW with linear warm-up and
cosine decay; validation measures acceptance with the real :class:`~specdec.proposers.MTPHead`
inside a :class:`~specdec.Generator` on held-out prompts, so the number reported is the one
inference sees. Checkpoints (head + optimizer, safetensors + JSON, never pickles) resume.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from specdec.config import positive_int
from specdec.models.heads import MTPHeadConfig, MTPHeadModel, save_draft_vocab, save_mtp_head
from specdec.models.llama import LlamaModel, rms_norm
from specdec.models.packed import linear_weights, pack_linears, should_pack
from specdec.training.features import FeatureStore

__all__ = [
    "MTPTrainConfig",
    "MTPTrainResult",
    "train_mtp",
    "train_loop",
    "split_indices",
    "lr_at",
    "export_head",
    "measure_acceptance",
]


def positive_float(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number, got {value!r}")


def non_negative_float(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class MTPTrainConfig:
    steps: int = attrs.field(default=1000, validator=positive_int)
    batch_size: int = attrs.field(default=8, validator=positive_int)  # chunks per step
    lr: float = attrs.field(default=1e-3, validator=positive_float)
    warmup_steps: int = attrs.field(default=50, validator=positive_int)
    min_lr_ratio: float = attrs.field(default=0.1, validator=non_negative_float)
    weight_decay: float = attrs.field(default=0.0, validator=non_negative_float)
    token_loss_weight: float = attrs.field(default=1.0, validator=non_negative_float)
    hidden_loss_weight: float = attrs.field(default=1.0, validator=non_negative_float)
    use_input_norms: bool = True
    init_from_last_layer: bool = True  # start the decoder layer from the target's last layer
    vocab: str = attrs.field(default="data", validator=attrs.validators.in_(("data", "full")))
    val_fraction: float = attrs.field(default=0.05, validator=non_negative_float)
    val_every: int = attrs.field(default=200, validator=positive_int)
    checkpoint_every: int = attrs.field(default=200, validator=positive_int)
    max_seconds: float | None = None  # stop early (and save) after this much training time
    seed: int = 0


@attrs.frozen
class MTPTrainResult:
    head: MTPHeadModel  # float32 training copy
    history: list[dict[str, float]]
    train_seconds: float
    steps: int


def train_mtp(
    target: LlamaModel,
    features: FeatureStore,
    config: MTPTrainConfig,
    out_dir: str | Path,
    *,
    validate: Callable[[MTPHeadModel], dict[str, float]] | None = None,
    resume: bool = True,
    stop_at: int | None = None,
    log: Callable[[str], None] | None = print,
) -> MTPTrainResult:
    """Train a head for ``target`` on ``features``; writes the head (``out_dir``), checkpoints
    (``out_dir/checkpoint``) and ``out_dir/train_log.json``. ``validate(head)`` (for example
    :func:`measure_acceptance` bound to prompts) runs every ``val_every`` steps and at the end.
    ``stop_at`` ends this call after that step with a checkpoint (a run split across jobs: the
    next call with the same config resumes and computes exactly what one call would have)."""
    if not isinstance(features, FeatureStore):
        raise TypeError(f"features must be a FeatureStore, got {type(features).__name__}")
    if features.hidden.shape[-1] != target.config.hidden_size:
        raise ValueError("features were computed with another target or layers (width differs from hidden_size)")
    out = Path(out_dir)
    device = target.device
    train_idx, val_idx = split_indices(len(features), config)
    head = new_head(target, config).to(device)
    vocab = (features.vocabulary() if config.vocab == "data" else torch.arange(target.config.vocab_size)).to(device)
    lm_weight = linear_weights(target.lm_head)[0].to(device)[vocab].float()  # [V', H] frozen
    norm_weight = target.norm.weight.detach().float()

    def losses(idx: torch.Tensor, noise: torch.Generator | None) -> dict[str, torch.Tensor]:
        tokens, hidden = features.batch(idx)
        tokens, hidden = tokens.to(device), hidden.to(device).float()
        g = head.forward_dense(hidden[:, :-1], tokens[:, 1:])  # [B, T-1, H]
        teacher = hidden[:, 1:]  # h_{i+1}
        rel = ((g - teacher) ** 2).sum(-1) / (teacher**2).sum(-1).clamp_min(1e-6)
        with torch.no_grad():
            target_logp = F.log_softmax(rms_norm(teacher, norm_weight, target.config.rms_norm_eps) @ lm_weight.T, -1)
        logq = F.log_softmax(head.norm(g) @ lm_weight.T, -1)  # [B, T-1, V']
        ce = -(target_logp.exp() * logq).sum(-1).mean()
        agree = (logq.argmax(-1) == target_logp.argmax(-1)).float().mean()
        loss = config.token_loss_weight * ce + config.hidden_loss_weight * rel.mean()
        return {"loss": loss, "token": ce, "hidden": rel.mean(), "top1": agree}

    step, history, train_seconds = train_loop(
        head, losses, config, out, train_idx=train_idx, val_idx=val_idx, validate=validate,
        resume=resume, stop_at=stop_at, log=log,
    )
    save_mtp_head(export_head(head, target), out)
    save_draft_vocab(out, features.tokens_by_frequency())
    (out / "train_log.json").write_text(json.dumps({"config": config_json(config), "history": history}, indent=1))
    return MTPTrainResult(head=head, history=history, train_seconds=train_seconds, steps=step)


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


def new_head(target: LlamaModel, config: MTPTrainConfig) -> MTPHeadModel:
    """A float32 head: final norm from the target's, decoder layer from the target's last layer
    (``init_from_last_layer``) or PyTorch's default init."""
    torch.manual_seed(config.seed)
    head = MTPHeadModel(target, MTPHeadConfig.for_target(target.config, use_input_norms=config.use_input_norms))
    head = head.float()
    with torch.no_grad():
        head.norm.weight.copy_(target.norm.weight.float())
        if config.init_from_last_layer:
            src = target.layers[-1]
            for name, module in head.layer.named_modules():
                if isinstance(module, torch.nn.Linear):
                    weight, bias = linear_weights(src.get_submodule(name))
                    module.weight.copy_(weight.float())
                    if module.bias is not None and bias is not None:
                        module.bias.copy_(bias.float())
            head.layer.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
            head.layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
    return head.train()


def export_head(head: MTPHeadModel, target: LlamaModel) -> MTPHeadModel:
    """An inference copy of ``head`` in the target's dtype (packed on bf16 CPUs)."""
    out = MTPHeadModel(target, head.config)
    out.load_state_dict({k: v.detach().to(target.dtype) for k, v in head.state_dict().items()})
    out = out.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return pack_linears(out) if should_pack(out) else out


def measure_acceptance(
    head: MTPHeadModel,
    target: LlamaModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    tokenizer: object | None = None,
    num_speculative_tokens: int = 1,
    max_new_tokens: int = 64,
) -> dict[str, object]:
    """Greedy acceptance of ``head`` through a real Generator with the MTPHead proposer, at a
    fixed k (the adaptive policy would change k from step to step and blur per-position rates)."""
    from specdec import FixedPolicy, Generator, SamplingParams
    from specdec.proposers import MTPHead

    proposer = MTPHead.from_model(export_head(head, target), num_speculative_tokens=num_speculative_tokens)
    gen = Generator.from_components(target, tokenizer, proposer=proposer, policy=FixedPolicy(num_speculative_tokens))
    gen.generate(list(prompts), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    m = gen.metrics
    return {
        "acceptance_rate": m.acceptance_rate,
        "mean_accepted_length": m.mean_accepted_length,
        "per_position_acceptance": m.per_position_acceptance,
    }


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
