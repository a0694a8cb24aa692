"""Suffix decoding: model-free speculation trees from what this request and earlier ones said.

Agentic and editing workloads repeat themselves (tool calls, rewritten files, the same request
retried). Suffix decoding (Oliaro et al., NeurIPS 2025) drafts from two suffix indexes instead
of a model, so a draft costs no forward pass:

- a per-request :class:`~specdec.proposers.suffix_tree.SuffixTrie` over the prompt and the
  output so far, extended as tokens are committed and freed when the request ends;
- a global trie over earlier requests' outputs (each with the last ``max_depth`` tokens of its
  prompt, so its first tokens are reachable), shared by every request of the generator,
  bounded to ``max_global_nodes`` nodes with least-recently-used pruning, behind a lock.

Each step, every suffix of the context (up to ``max_depth`` tokens) found in either index is a
candidate. A candidate matched on ``m`` tokens grows a tree of at most
``min(k, spec_factor * m + spec_offset)`` nodes, best first by empirical probability (how often
each continuation followed, multiplied along the path; nodes under ``min_token_prob`` are not
drafted). The tree with the largest expected number of accepted tokens is proposed, so the
speculation grows with the match length and with how consistently the text continued there.
With no match a request drafts nothing and takes a plain step inside the verify pass.

The drafts are deterministic, so the tree verifier treats them as one-hot proposals: lossless
at any temperature, with or without seeds, like prompt lookup.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import attrs

from specdec.config import (
    boolean,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    speculative_tokens,
    unit_interval_closed_open,
)
from specdec.interfaces import ProposeContext, TargetStep
from specdec.kv.paged import KVSpec
from specdec.proposers.suffix_tree import DraftTree, SuffixTrie, grow_tree
from specdec.types import DraftProposal, ProposalKind, RequestEnd, pad_rows

__all__ = ["SuffixConfig", "SuffixDecoding"]


@attrs.frozen(kw_only=True)
class SuffixConfig:
    """The settings of :class:`SuffixDecoding` (defaults: the paper's and ArcticInference's)."""

    num_speculative_tokens: int = attrs.field(default=16, validator=speculative_tokens)  # nodes
    max_depth: int = attrs.field(default=24, validator=positive_int)  # longest suffix matched
    spec_factor: float = attrs.field(default=1.0, validator=positive_float)  # nodes per matched token
    spec_offset: float = attrs.field(default=0.0, validator=non_negative_float)
    min_token_prob: float = attrs.field(default=0.1, validator=unit_interval_closed_open)
    max_global_nodes: int = attrs.field(default=1_000_000, validator=non_negative_int)  # 0: off
    tree: bool = attrs.field(default=True, validator=boolean)  # False: the most probable path only


@attrs.define
class _RequestIndex:
    """One request's trie and the tokens it has indexed (prompt first)."""

    trie: SuffixTrie
    tokens: list[int]
    prompt_len: int


class SuffixDecoding:
    """Suffix decoding (module docstring).

    Example:
        >>> gen = Generator.from_pretrained(path, proposer=SuffixDecoding(num_speculative_tokens=16))
        >>> gen.generate(prompt)          # earlier outputs of ``gen`` now help later requests
    """

    kind = ProposalKind.TREE
    needs_target_hidden = False

    def __init__(self, num_speculative_tokens: int = 16, **settings: object) -> None:
        self.config = SuffixConfig(num_speculative_tokens=num_speculative_tokens, **settings)
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.global_trie = SuffixTrie(self.config.max_depth)
        self._global_lock = threading.Lock()  # one proposer may serve several generators
        self._requests: dict[int, _RequestIndex] = {}

    def kv_specs(self) -> tuple[KVSpec, ...]:
        return ()

    # ---- requests ---------------------------------------------------------------------------

    def on_request_start(self, seq_id: int, prompt_ids: Sequence[int]) -> None:
        trie = SuffixTrie(self.config.max_depth)
        trie.extend(prompt_ids)
        self._requests[seq_id] = _RequestIndex(trie=trie, tokens=list(prompt_ids), prompt_len=len(prompt_ids))

    def on_request_end(self, seq_id: int, reason: RequestEnd) -> None:
        """A finished request's output (with its prompt's last tokens) joins the global index."""
        index = self._requests.get(seq_id)
        if index is None or reason is not RequestEnd.FINISHED or self.config.max_global_nodes == 0:
            return
        start = max(0, index.prompt_len - self.config.max_depth)
        with self._global_lock:
            self.global_trie.add(index.tokens[start:])
            self.global_trie.prune(self.config.max_global_nodes)

    def release(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)

    def _index(self, seq_id: int, token_ids: Sequence[int]) -> _RequestIndex:
        """``seq_id``'s index, brought up to ``token_ids`` (built now if it was never started:
        a proposer used without request tracking)."""
        index = self._requests.get(seq_id)
        if index is None:
            self.on_request_start(seq_id, token_ids)
            return self._requests[seq_id]
        if len(token_ids) > len(index.tokens):
            new = token_ids[len(index.tokens) :]
            index.trie.extend(new)
            index.tokens.extend(new)
        return index

    def on_target_step(self, step: TargetStep) -> None:
        for seq_id, tokens in zip(step.seq_ids, step.token_ids):
            if seq_id in self._requests:
                self._index(seq_id, tokens)

    # ---- drafting ---------------------------------------------------------------------------

    def propose(self, ctx: ProposeContext) -> DraftProposal:
        k = ctx.num_speculative_tokens
        tokens, parents = [], []
        transforms = ctx.logits_transforms or (None,) * len(ctx.seq_ids)
        for seq_id, history, transform in zip(ctx.seq_ids, ctx.token_ids, transforms):
            tree = self.tree_for(seq_id, history, k)
            row, links = tree.tokens, tree.parents
            if transform is not None:  # drafts a request's masks forbid could never be kept
                row, links = transform.allowed(row, links)
            tokens.append(row)
            parents.append(links)
        return DraftProposal(
            kind=ProposalKind.TREE,
            draft_token_ids=pad_rows(tokens, k, ctx.device),
            num_draft_tokens=tuple(len(t) for t in tokens),
            draft_probs=None,  # deterministic drafts: one-hot to the verifier
            parents=pad_rows(parents, k, ctx.device),  # padded with -1 like the drafts
        )

    def tree_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> DraftTree:
        """The tree request ``seq_id`` would draft after ``token_ids`` with at most ``k``
        nodes (its index brought up to them first): tokens, parents, expected accepted
        tokens (``score``), match length."""
        return self.draft_tree(self._index(seq_id, token_ids), k)

    def draft_tree(self, index: _RequestIndex, k: int) -> DraftTree:
        """The best tree of every candidate match in the request's and the global index."""
        best = DraftTree([], [], 0.0, 0)
        for node in index.trie.growing_matches():
            best = self._better(best, grow_tree(node, self._budget(node.depth, k), *self._growth(index.trie)))
        if self.config.max_global_nodes:
            context = index.tokens[-self.config.max_depth :]
            with self._global_lock:
                trie = self.global_trie
                for node in trie.match(context):
                    best = self._better(best, grow_tree(node, self._budget(node.depth, k), *self._growth(trie)))
        return best

    def _budget(self, match_len: int, k: int) -> int:
        """Nodes a match of ``match_len`` tokens may draft: more for longer matches."""
        return min(k, math.floor(self.config.spec_factor * match_len + self.config.spec_offset))

    def _growth(self, trie: SuffixTrie) -> tuple[float, int, bool]:
        return self.config.min_token_prob, trie.tick, self.config.tree

    @staticmethod
    def _better(a: DraftTree, b: DraftTree) -> DraftTree:
        """The tree expected to be accepted further; on a tie the longer match."""
        return b if (b.score, b.match_len) > (a.score, a.match_len) else a

