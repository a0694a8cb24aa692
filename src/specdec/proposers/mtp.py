"""MTP-head proposer: a one-layer head over the target's hidden states drafts a chain of k tokens.

Per sequence the proposer keeps ``g``: the head's output at the last committed position, which
predicts the token after the last emitted one (draft 1). Each step:

- ``propose``: draft 1 comes from ``g``'s logits; drafts 2..k each take one head forward that
  feeds the head's own previous output in place of the target's hidden state (unknown yet),
  written to the head's KV at the slots the target will verify next.
- ``on_target_step`` (after every target pass: prefill, plain decode, verify): re-run the head
  over the rows the target kept, pairing the target's hidden state at row ``r`` with the
  committed token after it. This overwrites the draft-time KV with states computed from the
  target's (more accurate) hidden states, and yields the new ``g``.

With ``confidence_threshold`` a sequence's chain ends after the first draft the head gives less
than that probability, as the draft model's does (:mod:`specdec.proposers.confidence`): k is
then a ceiling. Verification and sampling are the chain verifier's and the sampler's. The head's KV pages come
from the generator's shared allocator (same page ids as the target, its own one-layer pool).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from specdec.config import speculative_tokens, unit_interval_closed_open
from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.paged import KVSpec
from specdec.models.heads import MTPHeadConfig, MTPHeadModel, load_draft_vocab, load_mtp_head
from specdec.models.llama import LlamaModel
from specdec.models.quantized import check_quantization, quantize_linears
from specdec.models.sub_vocab import SubVocabHead
from specdec.proposers.confidence import chains_end
from specdec.sampling import processed_probs, sample_from_probs, shift_rows
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind

__all__ = ["MTPHead", "MTPHeadProposerConfig"]


@attrs.frozen(kw_only=True)
class MTPHeadProposerConfig:
    num_speculative_tokens: int = attrs.field(default=1, validator=speculative_tokens)
    confidence_threshold: float = attrs.field(default=0.0, validator=unit_interval_closed_open)


class MTPHead:
    """Speculation with a trained MTP head (see :mod:`specdec.models.heads`).

    Example:
        >>> mtp = MTPHead.from_pretrained("heads/qwen-0.5b-mtp", num_speculative_tokens=2)
        >>> gen = Generator.from_pretrained("qwen2.5-coder-0.5b-instruct", proposer=mtp)

    ``from_pretrained`` reads and checks the head's files at once; the weights are placed on
    the target when a Generator attaches the proposer (the head borrows the target's embedding
    and LM head, so it cannot exist before the target does).
    """

    kind = ProposalKind.CHAIN
    needs_target_hidden = True

    def __init__(
        self,
        config: MTPHeadProposerConfig,
        *,
        head: MTPHeadModel | None = None,
        path: Path | None = None,
        draft_vocab: torch.Tensor | None = None,
        quantization: str | None = None,
    ) -> None:
        self.config = config
        self.head = head
        self._path = path
        self._quantization = quantization  # of the head's linears and its draft-vocabulary head
        self._g: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] head output at the last committed slot
        # Drafting from a subset of the vocabulary (the tokens most frequent in training) cuts
        # the LM-head product, the largest cost of a draft on a small target. Still lossless:
        # the draft distribution is simply zero outside the subset, and verification uses it.
        self._draft_vocab = draft_vocab  # [n] int64 token ids, or None for the whole vocabulary
        self._sub_head: torch.nn.Module | None = None  # lm_head rows of _draft_vocab
        if head is not None:
            self._build_sub_head()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        num_speculative_tokens: int = 1,
        draft_vocab_size: int | None = None,
        quantization: str | None = None,
        confidence_threshold: float = 0.0,
    ) -> MTPHead:
        """``draft_vocab_size``: draft only from this many of the tokens most frequent in the
        head's training data (``draft_vocab.safetensors`` beside the head); ``None``: all.
        ``quantization``: ``"int8"`` or ``"q4"`` stores the head's linear layers (and its
        draft-vocabulary rows of the LM head) in that format on a CPU: cheaper drafts, the same
        output. ``confidence_threshold`` in [0, 1): end a chain after a draft the head gives less
        than this probability (0: always k drafts)."""
        config = MTPHeadProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )  # validated first
        check_quantization(quantization, "cpu")  # the value; the device is checked on loading
        path = Path(path).expanduser()
        for name in ("config.json", "model.safetensors"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"MTP head path {str(path)!r} has no {name}")
        try:
            MTPHeadConfig.from_json(json.loads((path / "config.json").read_text()))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{str(path / 'config.json')!r} is not an MTP head config: {err}") from err
        vocab = None if draft_vocab_size is None else load_draft_vocab(path, draft_vocab_size)
        return cls(config, path=path, draft_vocab=vocab, quantization=quantization)

    @classmethod
    def from_model(
        cls,
        head: MTPHeadModel,
        *,
        num_speculative_tokens: int = 1,
        draft_vocab: torch.Tensor | None = None,
        confidence_threshold: float = 0.0,
    ) -> MTPHead:
        config = MTPHeadProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )
        return cls(config, head=head, draft_vocab=draft_vocab)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def attach(self, target: LlamaModel) -> None:
        """Bind to the generator's target: load the weights (from_pretrained) or check the fit."""
        if self.head is None:
            self.head = load_mtp_head(self._path, target, quantization=self._quantization)
            self._build_sub_head()
        elif self.head.target is not target:
            self.head.config.check_target(target.config)
            if self.head.target.embed_tokens.weight is not target.embed_tokens.weight:
                raise ValueError("this MTP head was built on another target model instance; load it with from_pretrained")

    def kv_specs(self) -> tuple[KVSpec, ...]:
        if self.head is None:
            raise RuntimeError("MTPHead is not attached to a target yet (a Generator does that)")
        return (self.head.kv_spec("mtp"),)

    def _build_sub_head(self) -> None:
        if self._draft_vocab is not None:
            target = self.head.target
            self._sub_head = SubVocabHead(target.lm_head, self._draft_vocab, target.config.vocab_size)
            if self._quantization is not None:  # rows already int8 / 4-bit keep their codes
                quantize_linears(self._sub_head, self._quantization)

    def _draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """``[rows, hidden] -> [rows, vocab]`` float; ``-inf`` outside the draft vocabulary."""
        if self._sub_head is None:
            return self.head.logits(g)
        return self._sub_head(self.head.norm(g).to(self.head.target.dtype)).float()

    # --------------------------------------------------------------- drafting
    def propose(self, ctx: ProposeContext) -> DraftProposal:
        k = ctx.num_speculative_tokens
        batch = len(ctx.seq_ids)
        live = [i for i, s in enumerate(ctx.seq_ids) if s in self._g]  # all of them, normally
        all_greedy = all(p.is_greedy for p in ctx.params)
        probs_out = None if all_greedy else torch.zeros(batch, k, self.head.target_config.vocab_size, device=ctx.device)
        # The drafts stay on the device: each step's layout takes the previous step's tokens as
        # they are, so drafting reads nothing back (the engine reads the whole proposal once).
        draft_ids = torch.full((batch, k), PAD_TOKEN_ID, dtype=torch.int64, device=ctx.device)
        num_draft = [0] * batch
        if live:
            seq_ids = [ctx.seq_ids[i] for i in live]
            gens = [ctx.generators[i] for i in live]
            st = None if all_greedy else ctx.sampling_tensors(self.head.device).select_rows(live)
            g = torch.stack([self._g[s] for s in seq_ids])  # [live, hidden]
            slots = [len(ctx.token_ids[i]) - 1 for i in live]  # the next verify pass's first slot
            spec = self.head.target_config.attention_spec
            tokens = torch.empty(0, dtype=torch.int64)  # [live] the previous position's drafts
            columns: list[torch.Tensor] = []  # steps x [live] int64
            threshold = self.config.confidence_threshold
            ends = [k] * len(live)  # where each live chain ends
            for j in range(k):
                if j > 0:  # feed the head its own output and the draft just made
                    placeholder = [[0]] * len(seq_ids)  # token ids come from the device below
                    layout = ctx.kv.layout(seq_ids, placeholder, [s + j - 1 for s in slots], device=self.head.device)
                    # A row with no distribution drafted -1 (PAD): it ends there, the embedding
                    # just needs a valid id.
                    layout = attrs.evolve(layout, token_ids=tokens.clamp_min(0))
                    plan = ctx.backend.plan(layout, spec)
                    g = self.head(g, layout.token_ids, layout.positions, ctx.kv, ctx.backend, plan)
                logits = self._draft_logits(g)  # [live, vocab]
                if all_greedy:
                    tokens = logits.argmax(dim=-1)
                else:
                    step_probs = processed_probs(logits, st)
                    tokens = sample_from_probs(step_probs, shift_rows(gens, j))
                    probs_out[live, j] = step_probs.to(probs_out.dtype)
                columns.append(tokens)
                # The column drafted is the token itself: the logits span the whole vocabulary.
                # (The rule reads each step's confidences back: the one host read drafting makes,
                # and only with a threshold.)
                if threshold > 0 and chains_end(logits, tokens, threshold, j, ends):
                    break
            # The proposal is as wide as the steps taken (the policy prices drafting by them).
            steps = len(columns)
            draft_ids = draft_ids[:, :steps].contiguous()
            probs_out = None if probs_out is None else probs_out[:, :steps].contiguous()
            rows = torch.tensor(live, dtype=torch.int64, device=ctx.device)
            drafted = torch.stack(columns, dim=1)  # [live, steps]
            ended = torch.arange(steps).unsqueeze(0) >= torch.tensor(ends).unsqueeze(1)  # [live, steps]
            draft_ids[rows] = drafted.masked_fill(ended.to(drafted.device), PAD_TOKEN_ID).to(ctx.device)
            for i, n in zip(live, ends):
                num_draft[i] = n
        return DraftProposal(
            kind=ProposalKind.CHAIN,
            draft_token_ids=draft_ids,
            num_draft_tokens=tuple(num_draft),
            draft_probs=probs_out,
        )

    def on_target_step(self, step: TargetStep) -> None:
        hidden, next_tokens = step.kept_pairs()  # [kept rows, hidden]
        layout = step.kv.layout(step.seq_ids, next_tokens, step.start_slots, device=self.head.device)
        plan = step.backend.plan(layout, self.head.target_config.attention_spec)
        g = self.head(hidden, layout.token_ids, layout.positions, step.kv, step.backend, plan)
        last = g[layout.last_row_indices]  # [batch, hidden]
        for i, seq_id in enumerate(step.seq_ids):
            self._g[seq_id] = last[i]

    def release(self, seq_id: int) -> None:
        self._g.pop(seq_id, None)
