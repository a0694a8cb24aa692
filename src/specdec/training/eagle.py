"""Train an EAGLE head (EAGLE-1/2 or EAGLE-3) on cached target features.

Rows as in :mod:`specdec.models.eagle_head`: row ``p`` pairs the feature ``f_p`` with token
``t_{p+1}`` at RoPE position ``p`` and yields ``g_p``, which predicts ``t_{p+2}`` and, while
drafting, is the next row's feature. Training unrolls the drafting the proposer does
(the *training-time test*): for an anchor row ``a`` (a committed row), step 0 is the row the
proposer computes from the target's feature; step ``i`` sits at position ``a + i``, pairs the
head's own step ``i - 1`` output with ``t_{a+i+1}`` and attends to the committed rows ``<= a``
(step 0's keys) and to its own ancestors (steps ``1..i`` of anchor ``a``), as the tree mask does
at inference. Step ``i``'s output is compared with the target at position ``a + i + 1``:

- EAGLE-1/2: ``smooth_l1(g, f_{a+i+1}) + 0.1 * CE(softmax(lm_head(f_{a+i+1})), lm_head(g))``
  with ``f = norm(h_N)`` (the feature regression and the target's next-token distribution);
  ``ttt_steps = 1`` by default, the paper's objective;
- EAGLE-3: soft cross-entropy over the draft vocabulary against the target's distribution
  restricted to it (rows whose target argmax lies outside are skipped), ``ttt_steps = 7``.

Step ``i`` weighs ``step_weight ** i`` (0.8). Uniform noise of width ``noise`` on the step-0
features during training (EAGLE's robustness to feature error). The draft vocabulary of an
EAGLE-3 head is the ``draft_vocab_size`` most frequent tokens of the training data (``d2t``
saved with the head). The optimisation loop, checkpoints and resumption are every trainer's
(:func:`specdec.training.loop.fit_head`); validation runs the real
:class:`~specdec.proposers.EAGLETree` inside a :class:`~specdec.Generator`.

Example:
    >>> cfg = EagleTrainConfig(kind=EagleKind.EAGLE1, ttt_steps=5, steps=2000)
    >>> store = compute_features(target, chunks, "feats", layers=eagle_feature_layers(target, cfg))
    >>> result = train_eagle(target, store, cfg, "heads/eagle")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from specdec.config import (
    boolean,
    layer_indices,
    non_negative_float,
    optional,
    positive_int,
    sequence_to_tuple,
    unit_interval_open_closed,
)
from specdec.deprecation import moved_names
from specdec.models.eagle_checkpoints import save_eagle_head
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.models.head_module import copy_matching_layer, dense_qkv, inference_copy
from specdec.models.llama import LlamaModel, rms_norm
from specdec.models.packed import linear_weights
from specdec.training.features import FeatureStore
from specdec.training.loop import LoopConfig, TrainResult, fit_head

__all__ = [
    "EagleTrainConfig",
    "train_eagle",
    "eagle_feature_layers",
    "new_eagle_head",
    "export_eagle_head",
    "measure_eagle",
    "chain_tree",
]


FIRST_ANCHOR = 1  # anchors before this row of a chunk are left out of the loss (see train_eagle)


__getattr__ = moved_names(__name__, {"EagleTrainResult": "specdec.training.loop:TrainResult"})


@attrs.frozen(kw_only=True)
class EagleTrainConfig(LoopConfig):
    """Everything an EAGLE training run depends on (checkpoints refuse another config).

    ``target_layers``/``draft_vocab_size``/``ttt_steps`` default per kind: EAGLE-1 ``(N,)``, the
    whole vocabulary, 1 step; EAGLE-3 the reference's layers, ``min(vocab, 32000)``, 7 steps.

    Example:
        >>> EagleTrainConfig(kind=EagleKind.EAGLE3, target_layers=(1, 2, 4), ttt_steps=5)
    """

    kind: EagleKind = attrs.field(
        default=EagleKind.EAGLE1, validator=attrs.validators.instance_of(EagleKind)
    )
    target_layers: tuple[int, ...] | None = attrs.field(
        default=None, converter=sequence_to_tuple, validator=optional(layer_indices)
    )
    draft_vocab_size: int | None = attrs.field(default=None, validator=optional(positive_int))
    ttt_steps: int | None = attrs.field(default=None, validator=optional(positive_int))
    step_weight: float = attrs.field(default=0.8, validator=unit_interval_open_closed)
    hidden_loss_weight: float = attrs.field(default=1.0, validator=non_negative_float)  # EAGLE-1
    token_loss_weight: float = attrs.field(default=0.1, validator=non_negative_float)  # EAGLE-1
    noise: float = attrs.field(default=0.2, validator=non_negative_float)  # uniform width
    init_from_last_layer: bool = attrs.field(
        default=False, validator=boolean
    )  # slower to train on stories260K
    # EAGLE-3: keep the head's norm and LM head (the target's final norm and its rows of the
    # draft vocabulary) fixed, so a short run spends its steps on the layer, not on relearning
    # a projection the target already has.
    freeze_lm_head: bool = attrs.field(default=False, validator=boolean)

    def __attrs_post_init__(self) -> None:
        if self.kind is EagleKind.EAGLE1 and self.freeze_lm_head:
            raise ValueError("freeze_lm_head is for EAGLE-3 heads (an EAGLE-1 head uses the target's LM head)")
        if self.kind is EagleKind.EAGLE1 and self.draft_vocab_size is not None:
            raise ValueError(
                "draft_vocab_size is for EAGLE-3 heads (an EAGLE-1 head drafts over the whole vocabulary)"
            )

    @property
    def num_steps_unrolled(self) -> int:
        """The draft steps the loss unrolls (``ttt_steps`` or the kind's default)."""
        if self.ttt_steps is not None:
            return self.ttt_steps
        return 1 if self.kind is EagleKind.EAGLE1 else 7


def head_config(target: LlamaModel, config: EagleTrainConfig) -> EagleHeadConfig:
    """The head's :class:`EagleHeadConfig` for ``target`` under ``config``."""
    vocab = target.config.vocab_size
    draft = None
    if config.kind is EagleKind.EAGLE3:
        draft = min(vocab, 32000) if config.draft_vocab_size is None else config.draft_vocab_size
        if draft > vocab:
            raise ValueError(
                f"draft_vocab_size must be in 1..{vocab} (the target's vocabulary), got {draft}"
            )
    return EagleHeadConfig.for_target(
        target.config, config.kind, target_layers=config.target_layers, draft_vocab_size=draft
    )


def eagle_feature_layers(target: LlamaModel, config: EagleTrainConfig) -> tuple[int, ...]:
    """The target layers whose hidden states the feature cache must hold for this head: its
    ``target_layers``, then ``num_layers`` (the teacher's logits are ``lm_head(norm(h_N))``)
    unless that is already the last of them.

    >>> eagle_feature_layers(stories260K, EagleTrainConfig(kind=EagleKind.EAGLE3, target_layers=(1, 2, 3)))
    (1, 2, 3, 5)
    """
    layers = head_config(target, config).target_layers
    last = target.config.num_layers
    return layers if layers[-1] == last else (*layers, last)


def new_eagle_head(
    target: LlamaModel, config: EagleTrainConfig, draft_ids: torch.Tensor | None = None
) -> EagleHeadModel:
    """A float32 head. ``init_from_last_layer`` copies the target's last layer where shapes agree
    (EAGLE-1: the whole layer, and ``fc`` starts as the identity on the feature; EAGLE-3: o_proj,
    MLP, norms, the feature half of qkv_proj, and ``fc`` passing the top target layer through);
    an EAGLE-3 head's ``lm_head`` starts as the target's rows of ``draft_ids``
    (``[draft_vocab] int64`` sorted target ids; default the first ids) and its ``norm`` as the
    target's final norm (both kept fixed with ``freeze_lm_head``)."""
    torch.manual_seed(config.seed)
    head = EagleHeadModel(target, head_config(target, config)).float()
    hidden = target.config.hidden_size
    with torch.no_grad():
        if config.kind is EagleKind.EAGLE3:
            ids = (
                torch.arange(head.config.draft_vocab_size) if draft_ids is None else draft_ids.cpu()
            )
            head.d2t.copy_(ids - torch.arange(len(ids)))
            head.lm_head.weight.copy_(linear_weights(target.lm_head)[0].float().cpu()[ids])
            head.norm.weight.copy_(target.norm.weight.float())
            if config.freeze_lm_head:
                head.lm_head.requires_grad_(False)
                head.norm.requires_grad_(False)
        if config.init_from_last_layer:
            copy_matching_layer(head.layer, target.layers[-1])
            if config.kind is EagleKind.EAGLE1:
                head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
                if head.fc.bias is not None:
                    head.fc.bias.zero_()
            else:
                _init_eagle3_from_last_layer(head, target)
    return head.train()


def _init_eagle3_from_last_layer(head: EagleHeadModel, target: LlamaModel) -> None:
    """Start an EAGLE-3 head as "the target's last layer once more, on the top feature": ``fc``
    passes the highest of ``target_layers`` through (the others start at zero; they still get
    gradients) and the feature half of ``qkv_proj`` is the last layer's q/k/v. The token half
    keeps its random init, as an MTP head's projection does. With ``target_layers`` ending at
    ``num_layers`` the head's outputs then live in the space of the target's last hidden state,
    which is also what it feeds itself while drafting; a random ``fc`` and ``qkv_proj`` (the
    default) make a short run on a large target learn that space from scratch."""
    hidden = target.config.hidden_size
    layers = head.config.target_layers
    top = layers.index(max(layers))  # the slice of fc's input that holds the highest layer
    head.fc.weight.zero_()
    head.fc.weight[:, top * hidden : (top + 1) * hidden].copy_(torch.eye(hidden))
    qkv = head.layer.self_attn.qkv_proj.weight  # [q + 2 kv, 2H]: [embedding ; feature] columns
    qkv[:, hidden:].copy_(linear_weights(target.layers[-1].self_attn.qkv_proj)[0].float())


def draft_vocabulary(features: FeatureStore, size: int, vocab_size: int) -> torch.Tensor:
    """``[size] int64`` sorted target ids: the ``size`` most frequent tokens of the data, topped
    up with the lowest unseen ids if the data holds fewer."""
    ids = features.tokens_by_frequency()[:size]
    if len(ids) < size:
        seen = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        ids = torch.cat((ids, torch.nonzero(~seen).flatten()[: size - len(ids)]))
    return torch.sort(ids).values


def unrolled_outputs(
    head: EagleHeadModel,
    feature: torch.Tensor,  # [B, A, H] step-0 features of anchors 0..A-1
    tokens: torch.Tensor,  # [B, A + steps - 1] int64: t_1 .. (token of step i = tokens[:, i : i + A])
    steps: int,
) -> list[torch.Tensor]:  # steps x [B, A, H]: g of anchor a at step i (position a + i)
    """The head's outputs over ``steps`` draft steps with autograd, attention as the tree mask
    has it at inference: step ``i`` of anchor ``a`` sees step 0 of anchors ``<= a`` and steps
    ``1..i`` of anchor ``a``. Step 0 alone equals :meth:`EagleHeadModel.forward_dense`."""
    b, a, _ = feature.shape
    attn = head.layer.self_attn
    scale = attn.head_dim**-0.5
    causal = torch.ones(a, a, dtype=torch.bool, device=feature.device).tril()  # [A, A]
    keys, values, outputs = [], [], []
    for i in range(steps):
        attn_in, residual = head.layer_input(feature, tokens[:, i : i + a])
        cos, sin = head.rope(torch.arange(i, i + a, device=feature.device))  # [A, 1, D]
        q, k, v = dense_qkv(attn, attn_in, cos, sin)  # [B, h, A, D]
        keys.append(k)
        values.append(v)
        prefix = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(
            ~causal, float("-inf")
        )  # [B, h, A, A]
        own = [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # i x [B, h, A, 1]
        weights = torch.softmax(torch.cat((prefix, *own), dim=-1), dim=-1)
        out = weights[..., :a] @ values[0]
        for j, vj in enumerate(values[1:]):
            out = out + weights[..., a + j : a + j + 1] * vj
        h = residual + attn.o_proj(out.transpose(1, 2).reshape(b, a, attn.q_size))
        g = h + head.layer.mlp(head.layer.post_attention_layernorm(h))
        outputs.append(g)
        feature = g
    return outputs


def train_eagle(target: LlamaModel, features: FeatureStore, config: EagleTrainConfig, out_dir: str | Path, **run) -> TrainResult:
    """Train an EAGLE head for ``target`` on ``features`` (computed for
    :func:`eagle_feature_layers`); writes the head (``out_dir``: config.json +
    model.safetensors), checkpoints (``out_dir/checkpoint``) and ``out_dir/train_log.json``.
    ``run``: ``validate``, ``resume``, ``stop_at``, ``log``, as
    :func:`~specdec.training.loop.fit_head` takes them (``validate(head)``: e.g.
    :func:`measure_eagle` bound to prompts)."""
    if not isinstance(config, EagleTrainConfig):
        raise TypeError(f"config must be an EagleTrainConfig, got {type(config).__name__}")
    if not isinstance(features, FeatureStore):
        raise TypeError(f"features must be a FeatureStore, got {type(features).__name__}")
    layers = eagle_feature_layers(target, config)
    num_feature_layers = len(head_config(target, config).target_layers)
    if features.layers != layers:
        raise ValueError(
            f"features hold target layers {features.layers}, this head needs {layers}: compute_features(..., layers={layers})"
        )
    steps = config.num_steps_unrolled
    if features.chunk_len < steps + 2:
        raise ValueError(
            f"chunks of {features.chunk_len} tokens are too short for ttt_steps={steps} (need >= {steps + 2})"
        )
    device, cfg = target.device, target.config
    eagle3 = config.kind is EagleKind.EAGLE3
    draft_ids = (
        draft_vocabulary(features, head_config(target, config).draft_vocab_size, cfg.vocab_size)
        if eagle3
        else None
    )
    head = new_eagle_head(target, config, draft_ids).to(device)
    lm_weight = linear_weights(target.lm_head)[0].to(device).float()  # [V, H] frozen
    norm_weight = target.norm.weight.detach().to(device).float()
    in_draft = None
    if eagle3:
        in_draft = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device).index_fill_(
            0, draft_ids.to(device), True
        )
        draft_ids = draft_ids.to(device)

    def losses(idx: torch.Tensor, noise: torch.Generator | None) -> dict[str, torch.Tensor]:
        tokens, hidden = features.batch(idx)
        tokens, hidden = tokens.to(device), hidden.to(device).float()  # [B, T], [B, T, W]
        anchors = tokens.shape[1] - steps  # rows 0..A-1 have a target for every step
        with torch.no_grad():  # the last slice of the cache is h_N: the teacher's logits
            normed = rms_norm(
                hidden[..., -cfg.hidden_size :], norm_weight, cfg.rms_norm_eps
            )  # [B, T, H]
            logits = normed @ lm_weight.T  # [B, T, V]
            if eagle3:
                teacher_p = torch.softmax(logits[..., draft_ids], -1)  # [B, T, Vd]
                valid = in_draft[logits.argmax(-1)].float()  # [B, T]
            else:
                teacher_p = torch.softmax(logits, -1)  # [B, T, V]
        f = head.fc(hidden[..., : num_feature_layers * cfg.hidden_size]) if eagle3 else normed
        start = f[:, :anchors]
        if noise is not None and config.noise > 0:
            jitter = torch.rand(start.shape, generator=noise).to(device)
            start = start + (jitter - 0.5) * config.noise
        outputs = unrolled_outputs(head, start, tokens[:, 1:], steps)
        total, parts = 0.0, {}
        for i, g in enumerate(outputs):
            # Anchor 0 (each chunk's first row) is the target's attention sink: its hidden
            # states are outliers (RMS ~50x the other rows' on Qwen2.5), no prompt drafts from
            # there, and its gradients, clipped together with the rest, drowned everything else.
            g = g[:, FIRST_ANCHOR:]
            nxt = slice(FIRST_ANCHOR + i + 1, i + 1 + anchors)
            p = teacher_p[:, nxt]
            if eagle3:
                logq = F.log_softmax(head.lm_head(head.norm(g)), -1)  # [B, A - 1, Vd]
                mask = valid[:, nxt]
                ce = -((p * logq).sum(-1) * mask).sum() / mask.sum().clamp_min(1.0)
                step_loss = ce
            else:
                logq = F.log_softmax(g @ lm_weight.T, -1)  # [B, A - 1, V]
                ce = -(p * logq).sum(-1).mean()
                reg = F.smooth_l1_loss(g, f[:, nxt])
                step_loss = config.hidden_loss_weight * reg + config.token_loss_weight * ce
                if i == 0:
                    parts["hidden"] = reg.detach()
            total = total + config.step_weight**i * step_loss
            agree = (logq.argmax(-1) == p.argmax(-1)).float().mean()
            if i in (0, steps - 1):
                parts[f"ce{i}"] = ce.detach()
                parts[f"top1_{i}"] = agree
        return {"loss": total, **parts}

    def save(trained: EagleHeadModel, out: Path) -> None:
        save_eagle_head(export_eagle_head(trained, target), out)

    return fit_head(head, losses, config, out_dir, num_chunks=len(features), save=save, **run)


def export_eagle_head(head: EagleHeadModel, target: LlamaModel) -> EagleHeadModel:
    """An inference copy of ``head`` in the target's dtype (packed on bf16 CPUs)."""
    return inference_copy(head, target)


def chain_tree(k: int) -> list[list[int]]:
    """The static tree of one chain of ``k`` drafts (each the best child of the previous).

    >>> chain_tree(3)
    [[0], [0, 0], [0, 0, 0]]
    """
    return [[0] * i for i in range(1, k + 1)]


def measure_eagle(
    head: EagleHeadModel,
    target: LlamaModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    tokenizer: object | None = None,
    tree: Sequence[Sequence[int]] | None = None,
    top_k: int = 4,
    depth: int = 5,
    num_verify_tokens: int = 16,
    max_new_tokens: int = 64,
) -> dict[str, object]:
    """Greedy acceptance of ``head`` through a real Generator with the EAGLETree proposer,
    every tree node verified every step (``FixedPolicy``): mean accepted length = tokens emitted
    per verify step (accepted drafts + the target's own token), acceptance per depth."""
    from specdec import FixedPolicy, Generator, SamplingParams
    from specdec.proposers import EAGLETree

    proposer = EAGLETree.from_model(
        export_eagle_head(head, target),
        tree,
        top_k=top_k,
        depth=depth,
        num_verify_tokens=num_verify_tokens,
    )
    policy = FixedPolicy(proposer.num_speculative_tokens)
    gen = Generator.from_components(target, tokenizer, proposer=proposer, policy=policy)
    gen.generate(list(prompts), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    m = gen.metrics
    return {
        "mean_accepted_length": m.num_emitted_in_verify / max(1, m.num_verify_steps),
        "acceptance_rate": m.acceptance_rate,
        "per_position_acceptance": m.per_position_acceptance,
        "num_verify_steps": m.num_verify_steps,
    }
