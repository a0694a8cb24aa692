"""A complete user-defined proposer: a sampled bigram draft that implements the Protocol directly.

    python examples/03_custom_proposer.py

``BigramDraft`` keeps per-sequence bigram counts of the committed text (never of drafts) and
drafts a chain by *sampling* from them under the request's own temperature/top-k/top-p, so it
must report the distribution each draft token was drawn from (``draft_probs``): the verifier's
rejection rule needs it to stay lossless. For deterministic drafts, subclassing
``specdec.proposers.TokenListProposer`` is shorter (see docs/custom_proposer.md).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from specdec import GenerationOutput, Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.interfaces import ProposeContext, Proposer, TargetStep
from specdec.sampling import SamplingTensors, processed_probs, sample_from_probs, shift_rows
from specdec.types import DraftProposal, ProposalKind


class BigramDraft:
    """Drafts from the bigram statistics of each sequence's own committed text."""

    kind = ProposalKind.CHAIN
    needs_target_hidden = False

    def __init__(self, vocab_size: int, num_speculative_tokens: int = 4, smoothing: float = 1e-3):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.smoothing = smoothing
        self._followers: dict[int, dict[int, Counter[int]]] = {}  # seq_id -> token -> next counts
        self._counted: dict[int, int] = {}  # seq_id -> history tokens already counted

    def kv_specs(self) -> tuple:
        return ()  # model-free: no KV pages

    def _logits(self, seq_id: int, token: int) -> torch.Tensor:  # [vocab] float32
        logits = torch.full((self.vocab_size,), math.log(self.smoothing))
        for nxt, count in self._followers[seq_id].get(token, {}).items():
            logits[nxt] = math.log(count + self.smoothing)
        return logits

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        k = ctx.num_speculative_tokens  # this step's width; may be below num_speculative_tokens
        st = SamplingTensors.from_params(ctx.params, "cpu")
        last = [tokens[-1] for tokens in ctx.token_ids]
        drafted, probs = [], []  # k x [batch] int64, k x [batch, vocab]
        for j in range(k):
            logits = torch.stack([self._logits(s, t) for s, t in zip(ctx.seq_ids, last)])
            # The request's processed distribution of the draft's logits (one-hot for greedy
            # requests), and a draw from exactly that distribution with the request's own
            # randomness (a seeded request's at the token position of draft j).
            step_probs = processed_probs(logits, st)  # [batch, vocab]
            tokens = sample_from_probs(step_probs, shift_rows(ctx.generators, j))  # [batch] int64
            drafted.append(tokens)
            probs.append(step_probs)
            last = tokens.tolist()
        return DraftProposal(
            kind=ProposalKind.CHAIN,
            draft_token_ids=torch.stack(drafted, dim=1),  # [batch, k] int64
            num_draft_tokens=(k,) * len(ctx.seq_ids),
            draft_probs=torch.stack(probs, dim=1),  # [batch, k, vocab]
        )

    def on_target_step(self, step: TargetStep) -> None:
        # Called after every target pass (prefill, plain decode, verification) with the
        # committed history: count its new bigrams. Drafts never enter the counts, so a
        # rejection needs no rollback here.
        for seq_id, tokens in zip(step.seq_ids, step.token_ids):
            followers = self._followers.setdefault(seq_id, {})
            start = max(self._counted.get(seq_id, 0), 1)
            for i in range(start, len(tokens)):
                followers.setdefault(tokens[i - 1], Counter())[tokens[i]] += 1
            self._counted[seq_id] = len(tokens)

    def release(self, seq_id: int) -> None:
        self._followers.pop(seq_id, None)
        self._counted.pop(seq_id, None)


def show(label: str, out: GenerationOutput) -> None:
    m = out.metrics
    print(f"{label}: {out.text!r}")
    print(
        f"  acceptance rate {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}"
    )


def main() -> None:
    plain = Generator.from_pretrained(bundled_model_path(), dtype="float32")
    proposer = BigramDraft(plain.target.config.vocab_size, num_speculative_tokens=3)
    assert isinstance(proposer, Proposer)  # the Protocol is structural: no base class needed
    gen = Generator.from_components(
        plain.target, plain.tokenizer, proposer=proposer, eos_token_ids=plain.eos_token_ids
    )
    # A prompt that repeats itself gives bigrams something to find.
    prompt = "Tom had a red ball. Tom had a red hat. Tom had a red"

    greedy = SamplingParams(max_new_tokens=48, temperature=0.0)
    spec_out = gen.generate(prompt, greedy)
    assert spec_out.token_ids == plain.generate(prompt, greedy).token_ids  # lossless: identical
    show("greedy", spec_out)

    sampled = SamplingParams(max_new_tokens=48, temperature=0.5, top_k=40, seed=0)
    out = gen.generate(prompt, sampled)
    assert out.token_ids == gen.generate(prompt, sampled).token_ids  # a seed reproduces it ...
    assert out.token_ids == plain.generate(prompt, sampled).token_ids  # ... plain decoding's output
    show("sampled", out)

    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]  # every page back after the runs


if __name__ == "__main__":
    main()
