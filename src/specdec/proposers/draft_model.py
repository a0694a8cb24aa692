"""Draft-model proposer: a small LLM of the same tokenizer drafts a chain of k tokens.

The draft keeps its own KV pages (same page ids as the target, its own pool) and catches up
lazily: each ``propose`` first runs the draft over every token it has not seen yet (the whole
prompt on a sequence's first step, then the last step's bonus or recovered token, plus the
k-th draft when all drafts were accepted), which yields the logits for draft token 1, and then
takes k - 1 single-token steps. That is k draft forwards per step, the minimum, with the prefill
folded into the first of them. Rollback is bookkeeping: after the target's step the draft's
valid length is cut to the target's committed length, and stale slots are simply overwritten.

With ``confidence_threshold`` a sequence's chain ends at the first draft token the draft itself
gives less than that probability (the token is still proposed), and drafting stops when every
sequence's chain has ended: k is then a ceiling (the rule and why it stays exact:
:mod:`specdec.proposers.confidence`).

With ``draft_vocab`` (token ids, e.g. the most frequent ones of a corpus:
:func:`specdec.models.sub_vocab.frequent_token_ids`) the draft's LM head computes those tokens'
logits only (:class:`~specdec.models.sub_vocab.SubVocabHead`): a cheaper draft forward, drafts
from that subset only, the same output.

The draft's embedding table may differ from the target's by padding rows past the tokenizer's
length (Qwen2.5 0.5B drafting for 7B: 151,936 rows against 152,064). The target's tokenizer
reaches the check from the Generator (``set_target_tokenizer``, before ``attach``); the draft's
own is read from its directory (``from_pretrained``) or given (``from_model(tokenizer=...)``).
Both must be the same tokenizer, covered by both tables; the draft's logits are then fitted to
the target's rows (:mod:`specdec.models.padded_vocab`).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from specdec.codec import load_tokenizer
from specdec.deprecation import moved_names
from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.paged import KVSpec
from specdec.models.hf_adapter import TransformersAdapter
from specdec.models.llama import LlamaModel
from specdec.models.loading import check_model_impl, load_model
from specdec.models.padded_vocab import check_padded_vocab, draft_input_ids, fit_logits
from specdec.models.quantized import check_quantization
from specdec.models.sub_vocab import SubVocabHead, check_token_ids
from specdec.proposers.chain_drafting import ChainProposerConfig, draft_chain
from specdec.types import DraftProposal, ProposalKind

__all__ = ["DraftModel"]

# The settings of every chain proposer are one config now.
__getattr__ = moved_names(__name__, {"DraftModelConfig": "specdec.proposers.chain_drafting:ChainProposerConfig"})


class DraftModel:
    """Speculation with a smaller model of the same tokenizer.

    Example:
        >>> draft = DraftModel.from_pretrained("path/to/draft", num_speculative_tokens=4)
        >>> gen = Generator.from_pretrained("path/to/target", proposer=draft)
    """

    kind = ProposalKind.CHAIN
    needs_target_hidden = False
    kv_lookahead = 0  # prefix caching (SharesCachedPrefix): a draft's KV at p sees tokens <= p
    # ... and it runs what it has not seen when it next drafts: a cached page final in the
    # target's pool only is reusable (the draft catches up over it).
    catches_up_from_tokens = True

    def __init__(
        self, model: LlamaModel, config: ChainProposerConfig, *, draft_vocab: object = None, tokenizer: object = None
    ) -> None:
        if not isinstance(model, (LlamaModel, TransformersAdapter)):
            raise TypeError(f"model must be a specdec LlamaModel or TransformersAdapter, got {type(model).__name__}")
        if draft_vocab is not None and isinstance(model, TransformersAdapter):
            raise ValueError("draft_vocab needs a natively supported draft family (it replaces the LM head); "
                             f"{model.config.architecture} runs on the transformers adapter")  # fmt: skip
        self.model = model
        self.config = config
        self.tokenizer = tokenizer  # the draft's own (None: unknown), compared with the target's
        self._target_tokenizer: object | None = None
        # The target's vocabulary, which draft distributions span (set by attach).
        self.vocab_size = model.config.vocab_size
        # The LM head drafts come from: the model's own (None) or a draft vocabulary's.
        self.head = None if draft_vocab is None else SubVocabHead(model.lm_head, draft_vocab, model.config.vocab_size)
        self._computed: dict[int, int] = {}  # seq_id -> slots of this sequence in the draft's KV

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | torch.nn.Module,
        *,
        num_speculative_tokens: int = 4,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantization: str | None = None,
        confidence_threshold: float = 0.0,
        draft_vocab: object = None,
        tokenizer: object = None,
        model_impl: str = "auto",
    ) -> DraftModel:
        """Load a draft model. ``quantization="int8"`` or ``"q4"`` stores its linear layers as
        weight-only int8 or 4-bit (CPU): less time per draft token at batch 1, slightly
        different proposals, the same output (the verifier uses the draft's own probabilities).
        ``confidence_threshold`` in [0, 1): end a chain after a token the draft gives less than
        that probability (module docstring); 0 always drafts k tokens. ``draft_vocab``: token
        ids to draft from (module docstring); ``None``: the whole vocabulary. ``path`` may also
        be a transformers model in memory (its weights copied, see
        :mod:`specdec.models.from_transformers`); ``tokenizer``: the draft's tokenizer instead
        of the one beside its checkpoint (needed only when its embedding rows differ from the
        target's). ``dtype=None``: bfloat16 (a model object on the adapter: its own);
        ``model_impl``: as :meth:`Generator.from_pretrained <specdec.Generator.from_pretrained>`'s
        (a draft of no native family runs on the transformers adapter)."""
        config = ChainProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )  # validate first
        check_quantization(quantization, device)
        if draft_vocab is not None:  # its type and shape before the load; its range after
            check_token_ids(draft_vocab, None)
        check_model_impl(model_impl)
        model, _, model_dir = load_model(
            path, dtype=dtype, device=device, quantization=quantization, model_impl=model_impl
        )
        tokenizer = load_tokenizer(model_dir) if tokenizer is None else tokenizer
        return cls(model, config, draft_vocab=draft_vocab, tokenizer=tokenizer)

    @classmethod
    def from_model(
        cls,
        model: LlamaModel | TransformersAdapter,
        *,
        num_speculative_tokens: int = 4,
        confidence_threshold: float = 0.0,
        draft_vocab: object = None,
        tokenizer: object = None,
    ) -> DraftModel:
        """A draft of a model in memory; ``tokenizer``: its tokenizer, needed only when its
        embedding rows differ from the target's (module docstring)."""
        config = ChainProposerConfig(
            num_speculative_tokens=num_speculative_tokens, confidence_threshold=confidence_threshold
        )
        return cls(model, config, draft_vocab=draft_vocab, tokenizer=tokenizer)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def set_target_tokenizer(self, tokenizer: object | None) -> None:
        """The target's tokenizer, which ``attach`` compares with the draft's
        (:class:`~specdec.interfaces.UsesTargetTokenizer`)."""
        self._target_tokenizer = tokenizer

    def attach(self, target: LlamaModel) -> None:
        """Check that this draft can speak for ``target``: one vocabulary (draft ids index the
        target's embedding, and draft distributions are compared with the target's), up to
        padding rows past one shared tokenizer (module docstring)."""
        target_vocab = target.config.vocab_size
        check_padded_vocab(self.model.config.vocab_size, target_vocab, self.tokenizer, self._target_tokenizer)
        if self.head is not None and int(self.head.token_ids.max()) >= target_vocab:
            raise ValueError(
                f"draft_vocab must hold token ids of the target's vocabulary [0, {target_vocab}), "
                f"got up to {int(self.head.token_ids.max())}"
            )
        self.vocab_size = target_vocab

    def graph_model(self) -> tuple[LlamaModel, SubVocabHead | None]:
        """Graph capture (:class:`~specdec.interfaces.CapturesGraphs`): the draft's own passes,
        through its draft-vocabulary head when it has one."""
        return self.model, self.head

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return (self.model.config.kv_spec("draft", self.model.dtype),)

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        greedy = all(p.is_greedy for p in ctx.params)
        device = self.model.device
        starts = [self._computed.get(s, 0) for s in ctx.seq_ids]
        # Step 0 runs every token the draft has not seen yet; each later step one row per
        # sequence, its previous draft (fed from the device: nothing is read back).
        firsts = [self._input_ids(tokens[start:]) for tokens, start in zip(ctx.token_ids, starts)]
        after_first = [s + len(r) for s, r in zip(starts, firsts)]  # slot of step 1's row

        def next_logits(step: int, previous: torch.Tensor | None):
            if previous is None:
                layout = ctx.kv.layout(ctx.seq_ids, firsts, starts, device=device)
            else:  # a -1 only ends its chain: any valid id may stand in
                slots = [s + step - 1 for s in after_first]
                layout = ctx.kv.layout(ctx.seq_ids, [[0]] * len(slots), slots, device=device)
                layout = attrs.evolve(layout, token_ids=previous.clamp(0, self.model.config.vocab_size - 1))
            return self._logits(layout, ctx, greedy=greedy)  # [batch, columns]

        chain = draft_chain(
            next_logits, ctx.num_speculative_tokens, greedy=greedy,
            sampling=None if greedy else ctx.sampling_tensors(device), generators=ctx.generators,
            confidence_threshold=self.config.confidence_threshold,
            transforms=ctx.logits_transforms,
        )  # fmt: skip
        steps = chain.token_ids.shape[1]
        for seq_id, slot in zip(ctx.seq_ids, after_first):
            self._computed[seq_id] = slot + steps - 1
        return DraftProposal(
            kind=ProposalKind.CHAIN,
            draft_token_ids=chain.token_ids,  # [batch, steps]
            num_draft_tokens=chain.num_draft_tokens,
            draft_probs=chain.probs,  # [batch, steps, vocab]
        )

    def _logits(self, layout, ctx: ProposeContext, *, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's next-token logits after each sequence's last row, ``[batch, columns]``,
        and the token ids of the columns (``None``: the whole vocabulary, in id order): a graph
        replay when the generator gave it graphs and the pass is uniform (every draft step
        after the first), else eagerly. A greedy batch with a draft vocabulary gets that
        vocabulary's columns only: argmax and confidence over its n tokens, not a full row
        of -inf (on a CPU ~2 ms a step for Qwen's 152k tokens; the same drafts, as its ids
        ascend)."""
        graphs = ctx.graphs
        if graphs is not None and graphs.applies(layout):
            logits = graphs.run(layout)  # [num_tokens, draft rows]
            logits = logits if layout.q_lens[0] == 1 else logits[layout.last_row_indices]
            return fit_logits(logits, self.vocab_size), None
        plan = ctx.backend.plan(layout, self.model.config.attention_spec)
        sub = greedy and self.head is not None
        out = self.model(
            layout, ctx.kv, ctx.backend, plan, logits_indices=layout.last_row_indices,
            head=self.head.sub_logits if sub else self.head,
        )  # fmt: skip
        if sub:  # columns are token ids, all in the target's vocabulary (attach)
            return out.logits, self.head.token_ids
        return fit_logits(out.logits, self.vocab_size), None  # [batch, target vocab]

    def _input_ids(self, token_ids) -> list[int]:
        """The target's tokens as this draft embeds them (ids past a shorter table: its last
        row, see :func:`~specdec.models.padded_vocab.draft_input_ids`)."""
        rows = self.model.config.vocab_size
        return list(token_ids) if rows >= self.vocab_size else draft_input_ids(list(token_ids), rows)

    def on_target_step(self, step: TargetStep) -> None:
        # The draft's KV is valid up to the first slot that differs from the committed history:
        # everything before the newly emitted last token.
        for seq_id, tokens in zip(step.seq_ids, step.token_ids):
            if seq_id in self._computed:
                self._computed[seq_id] = min(self._computed[seq_id], len(tokens) - 1)

    def lag(self, seq_id: int, num_tokens: int) -> int:
        """Tokens of a ``num_tokens``-token history the draft has not run, beyond the one or
        two every drafting step runs (:class:`~specdec.interfaces.ReportsLag`)."""
        return max(0, num_tokens - 2 - self._computed.get(seq_id, 0))

    def kv_valid_slots(self, seq_id: int, num_computed: int) -> int:
        """The slots the draft has run over (it catches up lazily, when it next drafts)."""
        return min(self._computed.get(seq_id, 0), num_computed)

    def adopt_prefix(self, seq_id: int, num_slots: int) -> None:
        self._computed[seq_id] = num_slots

    def release(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)

