"""MTP-head proposer: a one-layer head over the target's hidden states drafts a chain of k tokens.

Per sequence the proposer keeps ``g``: the head's output at the last committed position, which
predicts the token after the last emitted one (draft 1). Each step:

- ``propose``: draft 1 comes from ``g``'s logits; drafts 2..k each take one head forward that
  feeds the head's own previous output in place of the target's hidden state (unknown yet),
  written to the head's KV at the slots the target will verify next.
- ``on_target_step`` (after every target pass: prefill, plain decode, verify): re-run the head
  over the rows the target kept, pairing the target's hidden state at row ``r`` with the
  committed token after it (:mod:`specdec.proposers.head_state`), which yields the new ``g``.

The drafting loop (sampling, ``confidence_threshold``) is the draft model's
(:mod:`specdec.proposers.chain_drafting`). Verification and sampling are the chain verifier's and
the sampler's. The head's KV pages come from the generator's shared allocator (same page ids as
the target, its own one-layer pool).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from specdec.config import speculative_tokens
from specdec.deprecation import moved_names
from specdec.interfaces import ProposeContext
from specdec.models.llama import LlamaModel
from specdec.models.mtp_head import MTPModule, load_draft_vocab, load_mtp_head, read_mtp_config
from specdec.models.quantized import check_quantization, quantize_linears
from specdec.models.sub_vocab import SubVocabHead
from specdec.proposers.chain_drafting import ChainProposerConfig, draft_chain
from specdec.proposers.head_proposer import HeadProposer
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind

__all__ = ["MTPHead"]

# The settings of every chain proposer are one config now (ChainProposerConfig); the old
# name keeps its own default of one draft per step, as MTPHead.from_* does.
__getattr__ = moved_names(
    __name__,
    {"MTPHeadProposerConfig": "specdec.proposers.mtp:_MTPHeadProposerConfig"},
    use={"MTPHeadProposerConfig": "specdec.proposers.chain_drafting.ChainProposerConfig"},
)


@attrs.frozen(kw_only=True)
class _MTPHeadProposerConfig(ChainProposerConfig):
    """The deprecated ``MTPHeadProposerConfig``: a ChainProposerConfig whose k defaults to 1."""

    num_speculative_tokens: int = attrs.field(default=1, validator=speculative_tokens)


class MTPHead(HeadProposer):
    """Speculation with a trained MTP head (its network: :mod:`specdec.models.mtp_head`).

    Example:
        >>> mtp = MTPHead.from_pretrained("heads/qwen-0.5b-mtp", num_speculative_tokens=2)
        >>> gen = Generator.from_pretrained("qwen2.5-coder-0.5b-instruct", proposer=mtp)

    ``from_pretrained`` reads and checks the head's files at once; the weights are placed on
    the target when a Generator attaches the proposer (the head borrows the target's embedding
    and LM head, so it cannot exist before the target does).
    """

    kind = ProposalKind.CHAIN
    head_name = "MTP head"

    def __init__(self, config: ChainProposerConfig, *, head: MTPModule | None = None, path: Path | None = None,
                 draft_vocab: torch.Tensor | None = None, quantization: str | None = None) -> None:  # fmt: skip
        super().__init__(head=head, path=path, quantization=quantization)  # also the sub head's
        self.config = config
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
        config = ChainProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )  # validated first
        check_quantization(quantization, "cpu")  # the value; the device is checked on loading
        path = Path(path).expanduser()
        read_mtp_config(path)  # both files there, and the config one of an MTP head
        vocab = None if draft_vocab_size is None else load_draft_vocab(path, draft_vocab_size)
        return cls(config, path=path, draft_vocab=vocab, quantization=quantization)

    @classmethod
    def from_model(
        cls,
        head: MTPModule,
        *,
        num_speculative_tokens: int = 1,
        draft_vocab: torch.Tensor | None = None,
        confidence_threshold: float = 0.0,
    ) -> MTPHead:
        config = ChainProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )
        return cls(config, head=head, draft_vocab=draft_vocab)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def attach(self, target: LlamaModel) -> None:
        loaded = self.head is None
        super().attach(target)
        if loaded:  # the draft vocabulary's rows of the LM head it now borrows
            self._build_sub_head()

    def _load(self, target: LlamaModel) -> MTPModule:
        return load_mtp_head(self._path, target, quantization=self._quantization)

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
        k, batch = ctx.num_speculative_tokens, len(ctx.seq_ids)
        live = self._live_rows(ctx.seq_ids)
        greedy = all(p.is_greedy for p in ctx.params)
        vocab = self.head.target_config.vocab_size
        if not live:
            return _chain_proposal(
                torch.full((batch, k), PAD_TOKEN_ID, dtype=torch.int64, device=ctx.device), [0] * batch,
                None if greedy else torch.zeros(batch, k, vocab, device=ctx.device),
            )  # fmt: skip
        chain = self._draft(ctx, live, greedy)
        # The proposal is as wide as the steps taken (the policy prices drafting by them).
        steps = chain.token_ids.shape[1]
        rows = torch.tensor(live, dtype=torch.int64, device=ctx.device)
        draft_ids = torch.full((batch, steps), PAD_TOKEN_ID, dtype=torch.int64, device=ctx.device)
        draft_ids[rows] = chain.token_ids.to(ctx.device)
        probs = None
        if chain.probs is not None:  # float32 on the target's device, as the verifier takes them
            probs = torch.zeros(batch, steps, vocab, device=ctx.device)
            probs[rows] = chain.probs.to(probs.dtype)
        num_draft = [0] * batch
        for i, n in zip(live, chain.num_draft_tokens):
            num_draft[i] = n
        return _chain_proposal(draft_ids, num_draft, probs)

    def _draft(self, ctx: ProposeContext, live: list[int], greedy: bool):
        """The chains of the ``live`` rows: draft 1 from ``g``'s logits, each later one from a
        head forward that feeds the head its own output and the draft just made, written to the
        head's KV at the slots the target verifies next."""
        head = self.head
        seq_ids = [ctx.seq_ids[i] for i in live]
        slots = [len(ctx.token_ids[i]) - 1 for i in live]  # the next verify pass's first slot
        g = self._outputs(seq_ids)  # [live, hidden]

        def next_logits(step: int, previous: torch.Tensor | None):
            nonlocal g
            if previous is not None:  # token ids come from the device below
                positions = [s + step - 1 for s in slots]
                layout = ctx.kv.layout(seq_ids, [[0]] * len(seq_ids), positions, device=head.device)
                # A row with no distribution drafted -1 (PAD): it ends there, the embedding
                # just needs a valid id.
                layout = attrs.evolve(layout, token_ids=previous.clamp_min(0))
                plan = ctx.backend.plan(layout, head.attention_spec)
                g = head(g, layout.token_ids, layout.positions, ctx.kv, ctx.backend, plan)
            return self._draft_logits(g), None  # [live, vocab]: the columns are the token ids

        return draft_chain(
            next_logits, ctx.num_speculative_tokens, greedy=greedy,
            sampling=None if greedy else ctx.sampling_tensors(head.device).select_rows(live),
            generators=[ctx.generators[i] for i in live],
            confidence_threshold=self.config.confidence_threshold,
            transforms=[ctx.logits_transforms[i] for i in live] if ctx.logits_transforms else (),
        )  # fmt: skip


def _chain_proposal(draft_ids: torch.Tensor, num_draft: list[int], probs: torch.Tensor | None) -> DraftProposal:
    return DraftProposal(
        kind=ProposalKind.CHAIN,
        draft_token_ids=draft_ids,  # [batch, steps] int64
        num_draft_tokens=tuple(num_draft),
        draft_probs=probs,  # [batch, steps, vocab] float32, or None when all greedy
    )
