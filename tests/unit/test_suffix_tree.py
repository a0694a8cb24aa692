"""The suffix trie suffix decoding drafts from: counts, matches, trees, bounds."""

from __future__ import annotations

import random

import pytest

from specdec.proposers.suffix_tree import SuffixTrie, grow_tree


def _brute_count(seqs: list[list[int]], pattern: list[int]) -> int:
    m = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - m + 1) if s[i : i + m] == pattern)


def test_counts_are_occurrences_of_every_substring_up_to_the_depth():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    trie = SuffixTrie(max_depth=5)
    trie.extend(seqs[0][:7])  # the growing sequence, in two pieces
    trie.extend(seqs[0][7:])
    for s in seqs[1:]:
        trie.add(s)
    for _ in range(300):
        pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        node = trie.root
        for t in pattern:
            node = node.children.get(t) if node else None
        assert (node.count if node else 0) == _brute_count(seqs, pattern), pattern


def test_matches_are_the_context_suffixes_with_continuations():
    trie = SuffixTrie(max_depth=4)
    trie.add([5, 1, 2, 3, 9])
    matches = trie.match([7, 1, 2])  # "2" and "1 2" occur, followed by 3; "7 1 2" does not
    assert [(n.depth, sorted(n.children)) for n in matches] == [(1, [3]), (2, [3])]
    assert trie.match([8]) == []
    grow = SuffixTrie(max_depth=4)
    grow.extend([1, 2, 3, 1, 2])
    assert [n.depth for n in grow.growing_matches()] == [1, 2]  # "2" and "1 2" were followed by 3


def test_trees_are_best_first_with_path_probabilities():
    trie = SuffixTrie(max_depth=6)
    for s in ([0, 1, 2], [0, 1, 2], [0, 1, 3], [0, 4, 5]):
        trie.add(s)
    root_match = trie.match([0])[-1]
    tree = grow_tree(root_match, budget=10, min_prob=0.0, tick=trie.tick)
    # After 0: 1 three times out of four, 4 once; after 0 1: 2 twice, 3 once.
    assert tree.tokens == [1, 2, 4, 3, 5] and tree.parents == [-1, 0, -1, 0, 2]
    assert tree.score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25 + 0.25)
    assert grow_tree(root_match, budget=2, min_prob=0.0, tick=0).tokens == [1, 2]
    assert grow_tree(root_match, budget=10, min_prob=0.3, tick=0).tokens == [1, 2]
    chain = grow_tree(root_match, budget=10, min_prob=0.0, tick=0, tree=False)
    assert chain.tokens == [1, 2] and chain.parents == [-1, 0]


def test_pruning_bounds_the_nodes_and_keeps_the_recently_used():
    trie = SuffixTrie(max_depth=4)
    for i in range(200):
        trie.add([1000 + i, 2000 + i, 3000 + i])
    recent = [1000 + 199, 2000 + 199]
    before = trie.num_nodes
    dropped = trie.prune(max_nodes=200)
    assert dropped > 0 and trie.num_nodes == before - dropped and 100 <= trie.num_nodes <= 160
    assert trie.match(recent)  # the newest sequence survived
    assert not trie.match([1000, 2000])  # the oldest did not
    assert trie.prune(max_nodes=10_000) == 0
    one = SuffixTrie(max_depth=4)
    one.add(list(range(100)))  # one sequence, one tick: all or nothing
    one.prune(max_nodes=50)
    assert one.num_nodes <= 50
