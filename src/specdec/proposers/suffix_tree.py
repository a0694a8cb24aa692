"""A suffix trie of bounded depth with occurrence counts: the index suffix decoding drafts from.

Every suffix of every indexed token sequence, cut at ``max_depth`` tokens, is a path from the
root; a node's ``count`` is how many times its path occurs in what was indexed. So the children
of the node for a context's last ``m`` tokens are the tokens that followed those ``m`` tokens
before, with how often each did (Oliaro et al., "SuffixDecoding", NeurIPS 2025, index their
prompts and earlier outputs the same way, in a suffix tree).

Appending a token to an indexed sequence touches at most ``max_depth`` nodes: the *active*
nodes (those for the sequence's last 1 .. max_depth - 1 tokens) each step to their child for the
new token. A trie can be bounded: nodes carry the tick they were last used at, and
:meth:`SuffixTrie.prune` drops the least recently used ones (a node is always used no earlier
than its descendants, since paths are walked from the root, so whole subtrees go).

Example:
    >>> trie = SuffixTrie(max_depth=4)
    >>> trie.extend([1, 2, 3, 1, 2])           # a sequence, indexed as it grows
    >>> [(c, n.count) for c, n in trie.match([1, 2])[-1].children.items()]
    [(3, 1)]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

from specdec.config import check_arg, positive_int

__all__ = ["SuffixNode", "SuffixTrie", "DraftTree", "grow_tree"]


class SuffixNode:
    """One path of the trie: its depth, how often it occurred, what followed it."""

    __slots__ = ("children", "count", "depth", "last_used")

    def __init__(self, depth: int, tick: int = 0) -> None:
        self.children: dict[int, SuffixNode] = {}
        self.count = 0
        self.depth = depth
        self.last_used = tick


class SuffixTrie:
    """Bounded-depth suffix trie over one growing sequence (:meth:`extend`) and any number of
    finished ones (:meth:`add`)."""

    def __init__(self, max_depth: int = 24) -> None:
        check_arg(positive_int, "max_depth", max_depth)
        self.max_depth = max_depth
        self.root = SuffixNode(0)
        self.num_nodes = 1
        self.tick = 0  # the clock of last_used: one tick per indexed or matched sequence
        self._active: list[SuffixNode] = []  # nodes of the growing sequence's last tokens

    # ---- indexing ---------------------------------------------------------------------------

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to the growing sequence: every new suffix (up to ``max_depth``
        tokens) gains one occurrence."""
        self.tick += 1
        active = self._active
        for token in tokens:
            active = self._step(active, token)
        self._active = active

    def add(self, tokens: Sequence[int]) -> None:
        """Index a whole finished sequence (its suffixes), apart from the growing one."""
        self.tick += 1
        active: list[SuffixNode] = []
        for token in tokens:
            active = self._step(active, token)

    def _step(self, active: list[SuffixNode], token: int) -> list[SuffixNode]:
        """Each active node (and the root) goes to its child ``token``, counted once more."""
        tick = self.tick
        out = []
        for node in (self.root, *active):
            node.last_used = tick  # never older than its children (pruning drops subtrees)
            if node.depth >= self.max_depth:
                continue
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = SuffixNode(node.depth + 1, tick)
                self.num_nodes += 1
            child.count += 1
            child.last_used = tick
            out.append(child)
        return out

    # ---- lookup -----------------------------------------------------------------------------

    def match(self, context: Sequence[int]) -> list[SuffixNode]:
        """The nodes of ``context``'s suffixes that occur in the trie and have continuations,
        shortest first (``[-1]`` is the longest match); marks them used."""
        self.tick += 1
        tick = self.tick
        found = []
        for m in range(1, min(self.max_depth, len(context)) + 1):
            node = self.root
            for token in context[len(context) - m :]:
                node = node.children.get(token)
                if node is None:
                    break
                node.last_used = tick
            if node is None:
                break  # every suffix of an indexed text is indexed: no longer suffix occurs
            if node.children:
                found.append(node)
        self.root.last_used = tick
        return found

    def growing_matches(self) -> list[SuffixNode]:
        """The growing sequence's own matches (its active nodes with continuations seen
        earlier), shortest first: no walk, the trie keeps them."""
        return [node for node in self._active if node.children]

    # ---- bounding ---------------------------------------------------------------------------

    def prune(self, max_nodes: int) -> int:
        """Drop least recently used subtrees down to about ``max_nodes * 3 // 4`` nodes (a
        quarter of headroom, so pruning is rare; never more than ``max_nodes`` remain);
        returns the nodes dropped. For indexes of
        finished sequences (:meth:`add`): a growing sequence's active nodes would be cut off."""
        if self.num_nodes <= max_nodes:
            return 0
        target = max_nodes * 3 // 4
        ticks = sorted(_ticks(self.root))
        cutoff = ticks[max(0, len(ticks) - target)]  # keep nodes used at or after this tick
        dropped = _drop_older(self.root, cutoff)
        if self.num_nodes - dropped > max_nodes:  # ties at the cutoff: that tick goes too
            dropped += _drop_older(self.root, cutoff + 1)
        self.num_nodes -= dropped
        return dropped


def _ticks(root: SuffixNode) -> list[int]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node.last_used)
        stack.extend(node.children.values())
    return out


def _drop_older(root: SuffixNode, cutoff: int) -> int:
    """Remove every subtree whose top was last used before ``cutoff``; count removed nodes."""
    dropped, stack = 0, [root]
    while stack:
        node = stack.pop()
        for token in [t for t, c in node.children.items() if c.last_used < cutoff]:
            dropped += _size(node.children.pop(token))
        stack.extend(node.children.values())
    return dropped


def _size(node: SuffixNode) -> int:
    n, stack = 0, [node]
    while stack:
        top = stack.pop()
        n += 1
        stack.extend(top.children.values())
    return n


class DraftTree:
    """A speculation tree grown from one match: tokens, parents (before children; ``-1`` for
    the root's children) and its score, the expected number of accepted tokens (the sum of
    every node's path probability) under the trie's frequencies. ``probs``: each node's path
    probability (``None`` where unknown: a tree built by hand)."""

    __slots__ = ("tokens", "parents", "score", "match_len", "probs")

    def __init__(
        self,
        tokens: list[int],
        parents: list[int],
        score: float,
        match_len: int,
        probs: list[float] | None = None,
    ) -> None:
        self.tokens = tokens
        self.parents = parents
        self.score = score
        self.match_len = match_len
        self.probs = probs

    def prefix(self, n: int) -> DraftTree:
        """The tree of its first ``n`` nodes (parents come first, so a tree again) and their
        score: best first, so the best ``n``-node subtree of this one."""
        if n >= len(self.tokens):
            return self
        if self.probs is None:  # unknown per node: the score spread evenly
            score = self.score * n / len(self.tokens) if self.tokens else 0.0
            return DraftTree(self.tokens[:n], self.parents[:n], score, self.match_len)
        probs = self.probs[:n]
        return DraftTree(self.tokens[:n], self.parents[:n], math.fsum(probs), self.match_len, probs)


def grow_tree(match: SuffixNode, budget: int, min_prob: float, tick: int, tree: bool = True) -> DraftTree:
    """The ``budget`` most probable continuations of ``match`` as a tree, best first.

    A node's probability is the product, along its path, of each token's share of what
    followed its parent (``child.count / sum of the parent's children's counts``); nodes below
    ``min_prob`` are not drafted. Parents are always more probable than their children, so the
    best-first order puts parents first. ``tree=False`` follows the most probable child only
    (a chain).
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    score = 0.0
    heap: list[tuple[float, int, int, int, SuffixNode]] = []  # (-prob, order, parent, token, node)
    order = 0

    def push_children(node: SuffixNode, prob: float, index: int) -> None:
        nonlocal order
        total = sum(c.count for c in node.children.values())
        for token, child in node.children.items():
            p = prob * child.count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, index, token, child))
                order += 1

    push_children(match, 1.0, -1)
    while heap and len(tokens) < budget:
        neg, _, parent, token, node = heapq.heappop(heap)
        if not tree:
            heap.clear()  # a chain: only the chosen node's children go on
        node.last_used = tick
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg)
        score += -neg
        push_children(node, -neg, len(tokens) - 1)
    return DraftTree(tokens, parents, score, match.depth, probs)
