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

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from specdec.config import boolean, non_negative_float
from specdec.deprecation import moved_names
from specdec.models.head_module import copy_matching_layer, inference_copy
from specdec.models.llama import LlamaModel, rms_norm
from specdec.models.mtp_head import MTPModule, MTPModuleConfig, save_draft_vocab, save_mtp_head
from specdec.models.packed import linear_weights
from specdec.training.features import FeatureStore
from specdec.training.loop import LoopConfig, TrainResult, fit_head

__all__ = [
    "MTPTrainConfig",
    "train_mtp",
    "new_head",
    "export_head",
    "measure_acceptance",
]

_LOOP = "specdec.training.loop"
__getattr__ = moved_names(
    __name__,
    {
        "MTPTrainResult": f"{_LOOP}:TrainResult",  # one result record for every trainer
        "train_loop": f"{_LOOP}:train_loop",
        "split_indices": f"{_LOOP}:split_indices",
        "lr_at": f"{_LOOP}:lr_at",
        "config_json": f"{_LOOP}:config_json",
        "positive_float": "specdec.config:positive_float",
        "non_negative_float": "specdec.config:non_negative_float",
    },
)


@attrs.frozen(kw_only=True)
class MTPTrainConfig(LoopConfig):
    """Everything an MTP training run depends on (checkpoints refuse another config)."""

    token_loss_weight: float = attrs.field(default=1.0, validator=non_negative_float)
    hidden_loss_weight: float = attrs.field(default=1.0, validator=non_negative_float)
    use_input_norms: bool = attrs.field(default=True, validator=boolean)
    # start the decoder layer from the target's last layer
    init_from_last_layer: bool = attrs.field(default=True, validator=boolean)
    vocab: str = attrs.field(default="data", validator=attrs.validators.in_(("data", "full")))


def train_mtp(target: LlamaModel, features: FeatureStore, config: MTPTrainConfig, out_dir: str | Path, **run) -> TrainResult:
    """Train a head for ``target`` on ``features``; writes the head (``out_dir``, with the
    training tokens by frequency beside it), checkpoints (``out_dir/checkpoint``) and
    ``out_dir/train_log.json``. ``run``: ``validate``, ``resume``, ``stop_at``, ``log``, as
    :func:`~specdec.training.loop.fit_head` takes them (``validate(head)``: for example
    :func:`measure_acceptance` bound to prompts)."""
    if not isinstance(features, FeatureStore):
        raise TypeError(f"features must be a FeatureStore, got {type(features).__name__}")
    if features.hidden.shape[-1] != target.config.hidden_size:
        raise ValueError("features were computed with another target or layers (width differs from hidden_size)")
    device = target.device
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

    def save(trained: MTPModule, out: Path) -> None:
        save_mtp_head(export_head(trained, target), out)
        save_draft_vocab(out, features.tokens_by_frequency())

    return fit_head(head, losses, config, out_dir, num_chunks=len(features), save=save, **run)


def new_head(target: LlamaModel, config: MTPTrainConfig) -> MTPModule:
    """A float32 head: final norm from the target's, decoder layer from the target's last layer
    (``init_from_last_layer``) or PyTorch's default init."""
    torch.manual_seed(config.seed)
    head = MTPModule(target, MTPModuleConfig.for_target(target.config, use_input_norms=config.use_input_norms))
    head = head.float()
    with torch.no_grad():
        head.norm.weight.copy_(target.norm.weight.float())
    if config.init_from_last_layer:
        copy_matching_layer(head.layer, target.layers[-1])
    return head.train()


def export_head(head: MTPModule, target: LlamaModel) -> MTPModule:
    """An inference copy of ``head`` in the target's dtype (packed on bf16 CPUs)."""
    return inference_copy(head, target)


def measure_acceptance(
    head: MTPModule,
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
