"""Oracle proposers of controlled acceptance, for measuring what speculation can reach.

They replay the target's own greedy continuation (computed beforehand by plain decoding) and
corrupt each drafted token with probability ``1 - alpha``, so greedy verification accepts each
draft with probability ``alpha`` exactly, independently of the model: the step cost of the
engine is measured apart from any proposer's quality or cost.

- :class:`OracleChain`: ``k`` tokens; expected tokens emitted per step ``sum_{i<=k} alpha^i``.
- :class:`OracleTree`: ``levels`` pairs of siblings (16 nodes for 8 levels). Each level's first
  node continues the path (correct with probability ``alpha``); its sibling, a leaf, holds the
  right token with probability ``alpha`` when the first node is wrong (a wrong one otherwise).

Example:
    >>> refs = greedy_references(gen, prompts, max_new_tokens + 16)
    >>> spec = Generator.from_components(gen.target, proposer=OracleChain(refs, 0.8, 5, vocab))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec import SamplingParams
from specdec.interfaces import ProposeContext, TargetStep
from specdec.proposers.base import TokenListProposer
from specdec.types import DraftProposal, ProposalKind, pad_rows

__all__ = ["OracleChain", "OracleTree", "expected_emitted", "greedy_references"]


def greedy_references(gen, prompts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
    """Each prompt followed by ``tokens`` tokens of the target's plain greedy output."""
    outs = gen.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    return [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)]


def expected_emitted(alpha: float, k: int, tree_levels: int | None = None) -> float:
    """Expected tokens per verify step (accepted drafts + the target's own) of a chain of ``k``
    or, with ``tree_levels``, of :class:`OracleTree`."""
    if tree_levels is None:
        return sum(alpha**i for i in range(k + 1))
    main = sum(alpha**d for d in range(1, tree_levels + 1))  # accepted first nodes
    return 1 + main + alpha * (1 - alpha**tree_levels)  # + a sibling after a miss


class _Truth:
    """The reference continuation of a history and seeded corruption."""

    def __init__(self, references: Sequence[Sequence[int]], alpha: float, vocab: int, seed: int):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        self.references = [list(r) for r in references]
        self.alpha, self.vocab = alpha, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def next_tokens(self, history: Sequence[int], count: int) -> list[int]:
        """The target's next ``count`` greedy tokens after ``history`` (0 past the reference)."""
        n = len(history)
        for ref in self.references:
            if len(ref) >= n and ref[:n] == list(history):
                return (ref[n : n + count] + [0] * count)[:count]
        raise ValueError("history matches no reference: was the output not greedy?")

    def hit(self) -> bool:
        return bool(torch.rand((), generator=self.gen) < self.alpha)

    def wrong(self, token: int, avoid: int = -1) -> int:
        """A token other than ``token`` (and ``avoid``)."""
        while True:
            other = (token + 1 + int(torch.randint(self.vocab - 1, (), generator=self.gen))) % self.vocab
            if other != avoid:
                return other


class OracleChain(TokenListProposer):
    """``k`` drafts, each the target's greedy token with probability ``alpha``."""

    def __init__(self, references, alpha: float, k: int, vocab: int, seed: int = 0):
        super().__init__(k)
        self.truth = _Truth(references, alpha, vocab, seed)

    def draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        truth = self.truth
        return [t if truth.hit() else truth.wrong(t) for t in truth.next_tokens(token_ids, k)]


class OracleTree:
    """``levels`` levels of (path node, leaf sibling): ``2 * levels`` nodes."""

    kind = ProposalKind.TREE
    needs_target_hidden = False

    def __init__(self, references, alpha: float, levels: int, vocab: int, seed: int = 0):
        self.truth = _Truth(references, alpha, vocab, seed)
        self.levels = levels
        self.num_speculative_tokens = 2 * levels

    def kv_specs(self):
        return ()

    def _tree(self, history: Sequence[int], levels: int) -> tuple[list[int], list[int]]:
        truth, tokens, parents = self.truth, [], []
        for d, right in enumerate(truth.next_tokens(history, levels)):
            first = right if truth.hit() else truth.wrong(right)
            second = right if first != right and truth.hit() else truth.wrong(right, avoid=first)
            parent = 2 * (d - 1) if d else -1
            tokens += [first, second]
            parents += [parent, parent]
        return tokens, parents

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        width = ctx.num_speculative_tokens
        levels = min(self.levels, width // 2)
        trees = [self._tree(h, levels) for h in ctx.token_ids]
        return DraftProposal(
            kind=ProposalKind.TREE,
            draft_token_ids=pad_rows([t for t, _ in trees], width, ctx.device),
            num_draft_tokens=tuple(len(t) for t, _ in trees),
            parents=pad_rows([p for _, p in trees], width, ctx.device),  # -1 past each tree
        )

    def on_target_step(self, step: TargetStep) -> None:
        """Stateless."""

    def release(self, seq_id: int) -> None:
        """Stateless."""
