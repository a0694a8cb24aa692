"""Tests of specdec.verify.tree: exactness of the multi-draft rule, greedy and seeded walks.

The exactness test needs no sampling. A random "language model" maps each prefix to logits
(float64, small vocabulary); for a tree of drafts the exact distribution of the first
``K`` emitted tokens is propagated over every accept/reject branch with the same sibling
step functions the verifier uses (tokens a step does not emit are drawn from the target, as
the next step would), enumerating every without-replacement draw of the siblings under rule
B. It must equal the target's own joint to 1e-9. That the verifier takes exactly those
branches is checked separately: for a concrete tree, uniforms built to hit every branch
(whose probabilities sum to 1) are injected into ``TreeVerifier.verify``. Three wrong
sibling rules (negative controls) must fail the exactness check.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import chi_square_pvalue

from specdec.config import SamplingParams
from specdec.interfaces import Verifier
from specdec.noise import SeededNoise, race_sample
from specdec.sampling import SamplingTensors, make_generator, processed_probs
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind
from specdec.verify import tree
from specdec.verify.chain import (
    ChainVerifier,
    greedy_verify,
    rejection_verify,
    residual_distribution,
)
from specdec.verify.tree import (
    TreeVerifier,
    children_of,
    sibling_step_deterministic,
    sibling_step_without_replacement,
    tree_coupled_verify,
    tree_greedy_verify,
    tree_rejection_verify,
)

F64 = torch.float64
PAD = PAD_TOKEN_ID
K = 3  # emitted positions whose joint distribution is checked

# Tree shapes (parents lists): a 4-child root with depth 3; two levels of pairs; children
# interleaved out of breadth-first order.
SHAPES = {
    "fan4-depth3": [-1, -1, -1, -1, 0, 0, 2, 4],
    "pairs": [-1, -1, 0, 0, 1, 2, 2],
    "interleaved": [-1, 0, 1, -1, 3, 0, -1],
}


class PrefixModel:
    """A random language model: logits of the next token fixed by (seed, prefix); ``probs``
    is their processed distribution under ``params`` (top-k/top-p leave zeros)."""

    def __init__(self, seed: int, vocab: int, params: SamplingParams, scale: float = 1.5):
        self.seed, self.vocab, self.scale, self.params = seed, vocab, scale, params
        self._st = SamplingTensors.from_params([params], "cpu")
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._probs: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab] float64
        if prefix not in self._logits:
            gen = torch.Generator().manual_seed(hash((self.seed, *prefix)) % 2**62)
            self._logits[prefix] = torch.randn(self.vocab, generator=gen, dtype=F64) * self.scale
        return self._logits[prefix]

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab] float64
        if prefix not in self._probs:
            self._probs[prefix] = processed_probs(self.logits(prefix)[None], self._st)[0]
        return self._probs[prefix]


def _row_prefixes(parents: list[int], tokens: list[int]) -> list[tuple[int, ...]]:
    """[n + 1] the tokens on the path root .. each row."""
    prefixes = [()]
    for j, parent in enumerate(parents):
        prefixes.append(prefixes[parent + 1] + (tokens[j],))
    return prefixes


def _tree_batch(
    target: PrefixModel,
    draft: PrefixModel | None,
    trees: list[tuple[list[int], list[int]]],  # (parents, tokens) per sequence
    width: int,
) -> tuple[torch.Tensor, DraftProposal]:
    """Target logits [batch, width + 1, vocab] and the TREE proposal for concrete trees."""
    vocab = target.vocab
    logits = torch.zeros(len(trees), width + 1, vocab, dtype=F64)
    ids = torch.full((len(trees), width), PAD, dtype=torch.int64)
    parents = torch.full((len(trees), width), -1, dtype=torch.int64)
    draft_probs = None if draft is None else torch.zeros(len(trees), width, vocab, dtype=F64)
    for i, (par, tok) in enumerate(trees):
        prefixes = _row_prefixes(par, tok)
        logits[i, : len(prefixes)] = torch.stack([target.logits(p) for p in prefixes])
        ids[i, : len(tok)] = torch.tensor(tok)
        parents[i, : len(par)] = torch.tensor(par)
        if draft is not None:
            for j, parent in enumerate(par):  # node j's group was drawn at its parent
                draft_probs[i, j] = draft.probs(prefixes[parent + 1])
    proposal = DraftProposal(
        kind=ProposalKind.TREE,
        draft_token_ids=ids,
        num_draft_tokens=tuple(len(tok) for _, tok in trees),
        draft_probs=draft_probs,
        parents=parents,
    )
    return logits, proposal


# --- exact propagation -----------------------------------------------------------------------


def _rule_a(p, q, tokens):
    return sibling_step_deterministic(p, tokens)


def _rule_b(p, q, tokens):
    return sibling_step_without_replacement(p, q, tokens)


def _target_joint(target: PrefixModel, prefix: tuple[int, ...], k: int, memo: dict) -> torch.Tensor:
    """[vocab] * k: the next k tokens drawn from the target alone."""
    if k == 0:
        return torch.tensor(1.0, dtype=F64)
    if (prefix, k) not in memo:
        p = target.probs(prefix)
        memo[prefix, k] = torch.stack(
            [p[x] * _target_joint(target, prefix + (x,), k - 1, memo) for x in range(target.vocab)]
        )
    return memo[prefix, k]


def _without_replacement_draws(q: torch.Tensor, m: int):
    """Every ordered draw of m distinct tokens from q, with its probability."""
    weights = q.tolist()
    for draw in itertools.permutations(range(len(weights)), m):
        prob, left = 1.0, 1.0
        for x in draw:
            prob *= weights[x] / left
            left -= weights[x]
        if prob > 0:
            yield draw, prob


def exact_joint(target, draft, parents, tokens=None, *, step, k=K) -> torch.Tensor:
    """[vocab] * k: exact distribution of the first k tokens emitted by verifying the tree.

    Rule A (``draft is None``): the tree's ``tokens`` are fixed. Rule B: each sibling group is
    drawn without replacement from ``draft`` at its parent's prefix, every draw enumerated.
    """
    children = children_of(parents, len(parents))
    memo, target_memo = {}, {}

    def dist(row: int, prefix: tuple[int, ...], k: int) -> torch.Tensor:
        if k == 0:
            return torch.tensor(1.0, dtype=F64)
        if (row, prefix, k) in memo:
            return memo[row, prefix, k]
        kids = children[row]
        p = target.probs(prefix)
        if draft is None:
            draws = [(tuple(tokens[c] for c in kids), 1.0)]
        else:
            draws = _without_replacement_draws(draft.probs(prefix), len(kids))
        out = torch.zeros([target.vocab] * k, dtype=F64)
        for sibling_tokens, weight in draws:
            accept, residuals = step(
                p, None if draft is None else draft.probs(prefix), sibling_tokens
            )
            reach = weight
            for c, x, a in zip(kids, sibling_tokens, accept.tolist()):
                if a > 0:
                    out[x] += reach * a * dist(c + 1, prefix + (x,), k - 1)
                reach *= 1 - a
            final = residuals[-1] / residuals[-1].sum()  # inverse_cdf renormalises too
            for y in final.nonzero().flatten().tolist():
                out[y] += (
                    reach * final[y] * _target_joint(target, prefix + (y,), k - 1, target_memo)
                )
        memo[row, prefix, k] = out
        return out

    return dist(0, (), k)


def _total_variation(target, draft, parents, tokens, step) -> float:
    joint = exact_joint(target, draft, parents, tokens, step=step)
    expected = _target_joint(target, (), K, {})
    assert abs(float(joint.sum()) - 1.0) < 1e-12
    return 0.5 * float((joint - expected).abs().sum())


def _case(shape: str, rule: str, seed: int):
    """Target, draft (None under rule A), parents and fixed tokens (rule A) of one case."""
    parents = SHAPES[shape]
    rng = random.Random(seed)
    if rule == "A":
        vocab = 7
        target = PrefixModel(
            seed, vocab, SamplingParams(temperature=0.9, top_k=5, top_p=0.95), scale=1.0
        )
        # Siblings are likely target tokens, as a draft's top-k would be, but may be ones the
        # target forbids; once chosen they are fixed (rule A never sees the chooser).
        chooser = PrefixModel(seed, vocab, SamplingParams(temperature=2.0), scale=1.0)
        tokens = _draw_tree(chooser, parents, rng)
        for group in children_of(parents, len(parents)):
            if len(group) >= 2:  # a duplicate sibling in every group that can hold one
                tokens[group[1]] = tokens[group[0]]
        return target, None, parents, tokens
    vocab = 6
    target = PrefixModel(seed, vocab, SamplingParams(temperature=1.0, top_k=vocab - 1))
    draft = PrefixModel(seed + 1000, vocab, SamplingParams(temperature=1.2))
    return target, draft, parents, None


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rule", ["A", "B"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_rule_is_exact(shape, rule, seed):
    target, draft, parents, tokens = _case(shape, rule, seed)
    step = _rule_a if rule == "A" else _rule_b
    joint = exact_joint(target, draft, parents, tokens, step=step)
    expected = _target_joint(target, (), K, {})
    torch.testing.assert_close(joint, expected, rtol=0, atol=1e-9)


# --- the verifier takes exactly the propagated branches ----------------------------------------


def _branches(target, draft, parents, tokens, step=_rule_b):
    """Every outcome of verifying one concrete tree with positive probability, as
    (probability, uniforms by index, accepted nodes, final token)."""
    n = len(tokens)
    children = children_of(parents, n)
    out = []

    def walk(row, prefix, fixed, nodes, reach):
        kids = children[row]
        q = None if draft is None or not kids else draft.probs(prefix)
        accept, residuals = step(target.probs(prefix), q, [tokens[c] for c in kids])
        for c, a in zip(kids, accept.tolist()):
            if a > 0:  # u = a / 2 < a accepts; (1 + a) / 2 >= a rejects
                walk(c + 1, prefix + (tokens[c],), {**fixed, c: a / 2}, nodes + [c], reach * a)
            if a >= 1:
                return
            fixed, reach = {**fixed, c: (1 + a) / 2}, reach * (1 - a)
        cdf = torch.cumsum(residuals[-1], 0).tolist()
        for y, (lo, hi) in enumerate(zip([0.0] + cdf, cdf)):
            if hi > lo:  # the middle of y's step of the CDF
                out.append(
                    (reach * (hi - lo) / cdf[-1], {**fixed, n: (lo + hi) / 2 / cdf[-1]}, nodes, y)
                )

    walk(0, (), {}, [], 1.0)
    return out


def _draw_tree(draft: PrefixModel, parents: list[int], rng: random.Random) -> list[int]:
    """Tokens for a tree whose sibling groups are drawn without replacement from the draft."""
    tokens = [0] * len(parents)
    prefixes = {0: ()}
    for row, kids in enumerate(children_of(parents, len(parents))):
        weights = draft.probs(prefixes[row]).tolist()
        for c in kids:
            tokens[c] = rng.choices(range(len(weights)), weights)[0]
            weights[tokens[c]] = 0.0
            prefixes[c + 1] = prefixes[row] + (tokens[c],)
    return tokens


@pytest.mark.parametrize("rule", ["A", "B"])
@pytest.mark.parametrize("shape", ["fan4-depth3", "interleaved"])
def test_verifier_follows_every_branch(monkeypatch, shape, rule):
    target, draft, parents, tokens = _case(shape, rule, seed=3)
    if rule == "B":
        tokens = _draw_tree(draft, parents, random.Random(3))
    branches = _branches(target, draft, parents, tokens, _rule_a if rule == "A" else _rule_b)
    assert abs(sum(b[0] for b in branches) - 1.0) < 1e-12  # the branches cover every outcome
    n, batch = len(tokens), len(branches)
    gen = torch.Generator().manual_seed(0)
    uniforms = torch.rand(batch, n + 1, generator=gen, dtype=F64)  # unread ones stay random
    for i, (_, fixed, _, _) in enumerate(branches):
        for index, u in fixed.items():
            uniforms[i, index] = u

    def injected(generators, counts, device):
        assert list(counts) == [n + 1] * batch
        return uniforms.flatten()

    monkeypatch.setattr(tree, "draw_uniforms", injected)
    logits, proposal = _tree_batch(target, draft, [(parents, tokens)] * batch, width=n)
    result = TreeVerifier().verify(logits, proposal, [target.params] * batch, [None] * batch)
    for i, (_, _, nodes, final) in enumerate(branches):
        expected = [tokens[j] for j in nodes] + [final]
        assert result.num_accepted[i] == len(nodes)
        assert result.emitted_token_ids[i, : len(expected)].tolist() == expected
        assert result.accepted_rows[i, : len(nodes) + 1].tolist() == [0] + [j + 1 for j in nodes]
        assert result.emitted_token_ids[i, len(expected) :].eq(PAD).all()
        assert result.accepted_rows[i, len(nodes) + 1 :].eq(PAD).all()


def test_verifier_is_lossless_with_real_generators():
    # End to end with a seeded generator, the uniform layout of draw_uniforms, and siblings
    # drawn afresh for every run: the first two emitted tokens follow the target's joint.
    target, draft, parents, _ = _case("pairs", "B", seed=5)
    runs, rng, gen = 1500, random.Random(5), make_generator(5, "cpu")
    trees = [(parents, _draw_tree(draft, parents, rng)) for _ in range(runs)]
    logits, proposal = _tree_batch(target, draft, trees, width=len(parents))
    result = TreeVerifier().verify(logits, proposal, [target.params] * runs, [gen] * runs)
    first = result.emitted_token_ids[:, 0]
    second = result.emitted_token_ids[:, 1].clone()
    for i in (second == PAD).nonzero().flatten().tolist():  # the next step's token
        second[i] = torch.multinomial(target.probs((int(first[i]),)), 1, generator=gen)
    counts = torch.bincount(first * target.vocab + second, minlength=target.vocab**2)
    expected = _target_joint(target, (), 2, {}).flatten()
    assert chi_square_pvalue(counts, expected) > 1e-4


# --- negative controls ------------------------------------------------------------------------


def _stacked(p, accept, residuals):
    """A step's (accept [m], residuals [m + 1, vocab]); m may be 0 (a leaf)."""
    return (torch.stack(accept) if accept else p.new_zeros(0)), torch.stack(residuals)


def _unnormalised(p, q, tokens):
    """Bug (a), rule A: r_{j+1} = r_j with x_j zeroed but not renormalised."""
    accept, residuals = [], [p]
    for x in tokens:
        r = residuals[-1]
        accept.append(r[x])
        kept = r.index_fill(0, torch.tensor([x]), 0.0)
        residuals.append(kept if kept.sum() > 0 else p)  # still a distribution to draw from
    return _stacked(p, accept, residuals)


def _iid_residual(p, q, tokens):
    """Bug (b), rule B: the i.i.d. siblings' rule, q never updated after a rejection."""
    accept, residuals = [], [p]
    for x in tokens:
        r = residuals[-1]
        accept.append((r[x] / q[x]).clamp(max=1.0))
        residuals.append(residual_distribution(r[None], q[None])[0])
    return _stacked(p, accept, residuals)


def _independent(p, q, tokens):
    """Bug (c): every sibling tested against r_1 = p, the first accepted wins (the residuals
    are the correct ones)."""
    _, residuals = _rule_a(p, q, tokens) if q is None else _rule_b(p, q, tokens)
    if q is None:
        return p[list(tokens)], residuals
    return (p[list(tokens)] / q[list(tokens)]).clamp(max=1.0), residuals


@pytest.mark.parametrize(
    ("bug", "rule", "shape"),
    [
        (_unnormalised, "A", "fan4-depth3"),
        (_iid_residual, "B", "fan4-depth3"),
        (_iid_residual, "B", "pairs"),
        (_independent, "A", "fan4-depth3"),
        (_independent, "B", "pairs"),
    ],
)
def test_exactness_check_detects_wrong_rules(bug, rule, shape):
    target, draft, parents, tokens = _case(shape, rule, seed=0)
    # The same case passes with the correct rule (test_tree_rule_is_exact, seed 0).
    assert _total_variation(target, draft, parents, tokens, bug) > 1e-3


def test_sibling_steps_crafted():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=F64)
    # Rule A: the second sibling is offered p without the first; a duplicate gets nothing.
    accept, residuals = sibling_step_deterministic(p, [0, 0, 1])
    assert accept.tolist() == [0.5, 0.0, 0.5]
    assert residuals.tolist() == [p.tolist(), [0, 0.5, 0.5, 0], [0, 0.5, 0.5, 0], [0, 0, 1, 0]]
    # A leaf: its bonus token is drawn from p itself.
    accept, residuals = sibling_step_deterministic(p, [])
    assert accept.shape == (0,) and torch.equal(residuals, p[None])

    # Rule B: min(1, r/q), then the residual and q without the rejected token.
    p = torch.tensor([0.3, 0.3, 0.4], dtype=F64)
    q = torch.tensor([0.1, 0.8, 0.1], dtype=F64)
    accept, residuals = sibling_step_without_replacement(p, q, [1, 1])
    torch.testing.assert_close(accept, torch.tensor([0.375, 0.0], dtype=F64))  # a duplicate: 0
    torch.testing.assert_close(residuals[1], torch.tensor([0.4, 0.0, 0.6], dtype=F64))
    accept, residuals = sibling_step_without_replacement(p, q, [1, 0])
    # q_2 = [0.5, 0, 0.5]; r_2(0) = 0.4 < 0.5 -> 0.8; r_3 = normalize(max(r_2 - q_2, 0)).
    torch.testing.assert_close(accept, torch.tensor([0.375, 0.8], dtype=F64))
    torch.testing.assert_close(residuals[2], torch.tensor([0.0, 0.0, 1.0], dtype=F64))


def test_sibling_step_without_replacement_degenerate_cases():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=F64)
    # q one-hot: once its token is drawn nothing is left, so the next sibling is judged as a
    # fixed choice (accepted with r(x), residual r without x).
    accept, residuals = sibling_step_without_replacement(
        p, torch.tensor([0.0, 0, 1, 0], dtype=F64), [2, 0]
    )
    assert accept.tolist() == [0.0, 0.5]
    assert residuals[-1].tolist() == [0.0, 1.0, 0.0, 0.0]
    # q all zero: every sibling is a fixed choice, the same as rule A.
    zero = torch.zeros(4, dtype=F64)
    got = sibling_step_without_replacement(p, zero, [1, 0])
    want = sibling_step_deterministic(p, [1, 0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # q(x) == 0: accepted when the target allows x, as the chain rule does.
    accept, _ = sibling_step_without_replacement(
        p, torch.tensor([0.0, 0, 0.5, 0.5], dtype=F64), [1]
    )
    assert accept.tolist() == [1.0]
    # Target equal to q: a (round-off) rejection leaves no residual; fall back to r.
    accept, residuals = sibling_step_without_replacement(p, p.clone(), [0])
    assert accept.tolist() == [1.0] and torch.equal(residuals[-1], p)


# --- chains: the tree rule reduces to the chain rule ------------------------------------------


def _chain_batch(seed: int, batch: int = 300, width: int = 4, vocab: int = 10):
    """Random logits, draft distributions, drafts drawn from them, and counts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, width + 1, vocab, generator=gen, dtype=F64) * 1.5
    draft_probs = torch.softmax(
        logits[:, :width] + torch.randn(batch, width, vocab, generator=gen, dtype=F64), -1
    )
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(
        batch, width
    )
    counts = torch.randint(0, width + 1, (batch,), generator=gen)
    drafts = torch.where(torch.arange(width) < counts[:, None], drafts, PAD)
    return logits, draft_probs, drafts, tuple(counts.tolist())


def _chain_parents(batch: int, width: int) -> torch.Tensor:
    return (torch.arange(width) - 1).expand(batch, width).clone()  # [-1, 0, 1, ...]


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_chain_shaped_tree_equals_rejection_verify(with_draft_probs):
    logits, draft_probs, drafts, counts = _chain_batch(seed=11)
    batch, width = drafts.shape
    draft_probs = draft_probs if with_draft_probs else None
    params = [SamplingParams(temperature=0.9, top_k=8, top_p=0.95)] * batch
    tree_proposal = DraftProposal(
        kind=ProposalKind.TREE,
        draft_token_ids=drafts,
        num_draft_tokens=counts,
        draft_probs=draft_probs,
        parents=_chain_parents(batch, width),
    )
    chain_proposal = DraftProposal(
        kind=ProposalKind.CHAIN,
        draft_token_ids=drafts,
        num_draft_tokens=counts,
        draft_probs=draft_probs,
    )
    got = TreeVerifier().verify(logits, tree_proposal, params, [make_generator(3, "cpu")] * batch)
    want = ChainVerifier().verify(
        logits, chain_proposal, params, [make_generator(3, "cpu")] * batch
    )
    assert got.num_accepted == want.num_accepted
    assert torch.equal(got.emitted_token_ids, want.emitted_token_ids)
    assert torch.equal(got.accepted_rows, want.accepted_rows)
    assert 0 < sum(got.num_accepted) < sum(counts)  # both outcomes occur

    # The pure functions agree too, for per-sequence generators.
    probs = processed_probs(
        logits.reshape(-1, 10),
        SamplingTensors.from_params(params[:1], "cpu").repeat_rows(batch * (width + 1)),
    ).reshape(logits.shape)
    gens = lambda: [make_generator(s, "cpu") for s in range(batch)]  # noqa: E731
    num_accepted, emitted, _ = tree_rejection_verify(
        probs, draft_probs, drafts, _chain_parents(batch, width), counts, gens()
    )
    chain_accepted, chain_emitted = rejection_verify(probs, draft_probs, drafts, counts, gens())
    assert torch.equal(num_accepted, chain_accepted) and torch.equal(emitted, chain_emitted)


def test_same_seed_same_step_and_seeds_matter():
    target, draft, parents, _ = _case("pairs", "B", seed=8)
    rng = random.Random(8)
    trees = [(parents, _draw_tree(draft, parents, rng)) for _ in range(20)]
    logits, proposal = _tree_batch(target, draft, trees, width=len(parents))

    def run(seed):
        gens = [make_generator(seed + i, "cpu") for i in range(20)]
        return TreeVerifier().verify(logits, proposal, [target.params] * 20, gens).emitted_token_ids

    assert torch.equal(run(1), run(1))
    assert any(not torch.equal(run(s), run(1)) for s in range(2, 8))


# --- greedy and seeded --------------------------------------------------------------------------


def _random_shapes(seed: int, batch: int, width: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Random parents [batch, width] (-1 past each count) and counts in 0 .. width."""
    rng = random.Random(seed)
    parents = torch.full((batch, width), -1, dtype=torch.int64)
    counts = tuple(rng.randrange(width + 1) for _ in range(batch))
    for i, n in enumerate(counts):
        for j in range(n):
            parents[i, j] = rng.randrange(-1, j)
    return parents, counts


def _random_tokens(seed: int, chosen: torch.Tensor, parents: torch.Tensor, counts, vocab: int):
    """[batch, width] tokens equal to the parent row's ``chosen`` token 60% of the time, else
    random (so duplicate siblings occur); PAD past each count."""
    rng = random.Random(seed)
    ids = torch.full(parents.shape, PAD, dtype=torch.int64)
    for i, n in enumerate(counts):
        for j in range(n):
            match = int(chosen[i, int(parents[i, j]) + 1])
            ids[i, j] = match if rng.random() < 0.6 else rng.randrange(vocab)
    return ids


def _brute_force(chosen: list[int], ids: list[int], parents: list[int], n: int):
    """The longest path whose every node equals its parent row's chosen token (the smallest
    node indices among equals), by enumerating every node's root path."""
    best = []
    for j in range(n):
        path, node = [], j
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        if all(ids[c] == chosen[parents[c] + 1] for c in path):
            if len(path) > len(best) or (len(path) == len(best) and path < best):
                best = path
    final = chosen[best[-1] + 1 if best else 0]
    return best, [ids[c] for c in best] + [final]


def _check_walks(result, chosen, ids, parents, counts):
    num_accepted, emitted, rows = result
    for i, n in enumerate(counts):
        path, tokens = _brute_force(chosen[i].tolist(), ids[i].tolist(), parents[i].tolist(), n)
        assert num_accepted[i] == len(path)
        assert emitted[i].tolist() == tokens + [PAD] * (ids.shape[1] + 1 - len(tokens))
        assert rows[i].tolist() == [0] + [c + 1 for c in path] + [PAD] * (ids.shape[1] - len(path))


def test_tree_greedy_verify_random_trees():
    batch, width, vocab = 200, 10, 6
    logits = torch.randn(batch, width + 1, vocab, generator=torch.Generator().manual_seed(0))
    chosen = logits.argmax(-1)
    parents, counts = _random_shapes(0, batch, width)
    ids = _random_tokens(0, chosen, parents, counts, vocab)
    result = tree_greedy_verify(logits, ids, parents, counts)
    _check_walks(result, chosen, ids, parents, counts)
    assert max(result[0].tolist()) >= 3  # deep paths were exercised
    # TreeVerifier gives the same and consumes no randomness on greedy rows.
    gen = make_generator(0, "cpu")
    state = gen.get_state()
    proposal = DraftProposal(
        kind=ProposalKind.TREE, draft_token_ids=ids, num_draft_tokens=counts, parents=parents
    )
    verified = TreeVerifier().verify(logits, proposal, [SamplingParams()] * batch, [gen] * batch)
    assert isinstance(TreeVerifier(), Verifier)
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(verified.emitted_token_ids, result[1])
    assert torch.equal(verified.accepted_rows, result[2])


def test_chain_shaped_tree_equals_greedy_verify():
    logits, _, _, counts = _chain_batch(seed=4)
    batch, width = logits.shape[0], logits.shape[1] - 1
    # Drafts that follow the argmax for a while, then diverge.
    drafts = logits[:, :width].argmax(-1)
    drafts[torch.rand(batch, width, generator=torch.Generator().manual_seed(1)) < 0.25] = 0
    drafts = torch.where(torch.arange(width) < torch.tensor(counts)[:, None], drafts, PAD)
    num_accepted, emitted, rows = tree_greedy_verify(
        logits, drafts, _chain_parents(batch, width), counts
    )
    chain_accepted, chain_emitted = greedy_verify(logits, drafts, counts)
    assert torch.equal(num_accepted, chain_accepted) and torch.equal(emitted, chain_emitted)
    expected_rows = torch.where(
        torch.arange(width + 1) <= num_accepted[:, None], torch.arange(width + 1), PAD
    )
    assert torch.equal(rows, expected_rows)


def _crafted_logits(argmax_rows: list[int], vocab: int = 6) -> torch.Tensor:
    """[1, rows, vocab] float64: +100 at each row's chosen token, -100 elsewhere."""
    logits = torch.full((1, len(argmax_rows), vocab), -100.0, dtype=F64)
    logits[0, torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 100.0
    return logits


@pytest.mark.parametrize("longer_first", [False, True])
def test_greedy_duplicate_siblings_take_the_longest_path(longer_first):
    # Root chooses 3; two children carry 3; only one of them has a matching child (token 5).
    if longer_first:
        ids, parents, argmax = [[3, 3, 5]], [[-1, -1, 0]], [3, 5, 1, 2]
        path_rows = [0, 1, 3]
    else:
        ids, parents, argmax = [[3, 3, 5]], [[-1, -1, 1]], [3, 1, 5, 2]
        path_rows = [0, 2, 3]
    num_accepted, emitted, rows = tree_greedy_verify(
        _crafted_logits(argmax), torch.tensor(ids), torch.tensor(parents), (3,)
    )
    assert num_accepted.tolist() == [2]
    assert emitted.tolist() == [[3, 5, 2, PAD]]
    assert rows.tolist() == [path_rows + [PAD]]


def _seeded_chosen(probs, parents, counts, noises):
    """[batch, width + 1] each real row's race_sample draw at position + its depth."""
    chosen = torch.full(probs.shape[:2], -1, dtype=torch.int64)
    for i, n in enumerate(counts):
        depth = [0]
        for j in range(n):
            depth.append(depth[int(parents[i, j]) + 1] + 1)
            chosen[i, j + 1] = race_sample(probs[i, j + 1][None], [noises[i].shifted(depth[-1])])[0]
        chosen[i, 0] = race_sample(probs[i, 0][None], [noises[i]])[0]
    return chosen


def test_seeded_rows_follow_the_plain_seeded_tokens():
    batch, width, vocab = 60, 8, 5
    logits = torch.randn(
        batch, width + 1, vocab, generator=torch.Generator().manual_seed(2), dtype=F64
    )
    params = [SamplingParams(temperature=0.8, top_k=4)] * batch
    probs = processed_probs(
        logits.reshape(-1, vocab), SamplingTensors.from_params(params, "cpu").repeat_rows(width + 1)
    ).reshape(logits.shape)
    noises = [SeededNoise(seed=s, position=10 + s) for s in range(batch)]
    # Drafts follow their parent row's seeded draw 60% of the time. Rows at one depth share a
    # position, so whatever path is kept, token k is the plain seeded draw at position + k.
    parents, counts = _random_shapes(2, batch, width)
    chosen = _seeded_chosen(probs, parents, counts, noises)
    ids = _random_tokens(2, chosen, parents, counts, vocab)
    result = tree_coupled_verify(probs, ids, parents, counts, noises)
    _check_walks(result, chosen, ids, parents, counts)
    assert max(result[0].tolist()) >= 2
    proposal = DraftProposal(
        kind=ProposalKind.TREE, draft_token_ids=ids, num_draft_tokens=counts, parents=parents
    )
    verified = TreeVerifier().verify(logits, proposal, params, noises)
    assert torch.equal(verified.emitted_token_ids, result[1])
    assert torch.equal(verified.accepted_rows, result[2])

    # Chain-shaped trees give exactly what ChainVerifier's coupled rule gives.
    chain_ids = torch.stack(
        [race_sample(probs[:, r], [n.shifted(r) for n in noises]) for r in range(width)], 1
    )
    chain_ids[torch.rand(batch, width, generator=torch.Generator().manual_seed(3)) < 0.3] = 0
    chain_ids = torch.where(torch.arange(width) < torch.tensor(counts)[:, None], chain_ids, PAD)
    tree_chain = DraftProposal(
        kind=ProposalKind.TREE,
        draft_token_ids=chain_ids,
        num_draft_tokens=counts,
        parents=_chain_parents(batch, width),
    )
    chain = DraftProposal(
        kind=ProposalKind.CHAIN, draft_token_ids=chain_ids, num_draft_tokens=counts
    )
    got = TreeVerifier().verify(logits, tree_chain, params, noises)
    want = ChainVerifier().verify(logits, chain, params, noises)
    assert got.num_accepted == want.num_accepted and max(got.num_accepted) >= 2
    assert torch.equal(got.emitted_token_ids, want.emitted_token_ids)
    assert torch.equal(got.accepted_rows, want.accepted_rows)


def test_tree_verifier_mixed_batch():
    vocab, width = 6, 3
    logits = torch.randn(4, width + 1, vocab, generator=torch.Generator().manual_seed(9), dtype=F64)
    ids = torch.tensor([[1, 2, 3], [0, 4, 1], [PAD, PAD, PAD], [2, 3, PAD]])
    parents = torch.tensor([[-1, -1, 0], [-1, 0, -1], [-1, -1, -1], [-1, 0, -1]])
    counts = (3, 3, 0, 2)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=4),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0),
    ]
    gens = [
        make_generator(1, "cpu"),
        make_generator(2, "cpu"),
        make_generator(3, "cpu"),
        SeededNoise(4, 7),
    ]
    proposal = DraftProposal(
        kind=ProposalKind.TREE, draft_token_ids=ids, num_draft_tokens=counts, parents=parents
    )
    result = TreeVerifier().verify(logits, proposal, params, gens)
    assert result.num_emitted[2] == 1 and result.accepted_rows[2].tolist() == [0, PAD, PAD, PAD]

    greedy = tree_greedy_verify(logits[:1], ids[:1], parents[:1], counts[:1])
    probs = [
        processed_probs(logits[i], SamplingTensors.from_params([params[i]] * (width + 1), "cpu"))[
            None
        ]
        for i in range(4)
    ]
    streamed = tree_rejection_verify(
        torch.cat(probs[1:3]),
        None,
        ids[1:3],
        parents[1:3],
        counts[1:3],
        [make_generator(2, "cpu"), make_generator(3, "cpu")],
    )
    seeded = tree_coupled_verify(probs[3], ids[3:], parents[3:], counts[3:], [SeededNoise(4, 7)])
    for rows, expected in ((slice(0, 1), greedy), (slice(1, 3), streamed), (slice(3, 4), seeded)):
        assert list(result.num_accepted[rows]) == expected[0].tolist()
        assert torch.equal(result.emitted_token_ids[rows], expected[1])
        assert torch.equal(result.accepted_rows[rows], expected[2])
    # Sampling tensors built once by the caller give the same step.
    gens = [
        make_generator(1, "cpu"),
        make_generator(2, "cpu"),
        make_generator(3, "cpu"),
        SeededNoise(4, 7),
    ]
    sampling = SamplingTensors.from_params(params, "cpu")
    again = TreeVerifier().verify(logits, proposal, params, gens, sampling=sampling)
    assert torch.equal(again.emitted_token_ids, result.emitted_token_ids)


# --- bad input ------------------------------------------------------------------------------------


def _proposal(**changes) -> DraftProposal:
    fields = dict(
        kind=ProposalKind.TREE,
        draft_token_ids=torch.tensor([[1, 2, 3]]),
        num_draft_tokens=(3,),
        parents=torch.tensor([[-1, -1, 0]]),
    )
    return DraftProposal(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(kind=ProposalKind.CHAIN), "TREE"),
        (dict(parents=None), "parents"),
        (dict(parents=torch.tensor([[-1, 1, 0]])), "parents"),  # node 1 is its own parent
        (dict(parents=torch.tensor([[-1, 2, -1]])), "parents"),  # a child before its parent
        (dict(parents=torch.tensor([[-2, -1, 0]])), "parents"),
        (dict(parents=torch.tensor([[-1, -1]])), "parents"),
        (dict(draft_token_ids=torch.tensor([[1, 2]]), num_draft_tokens=(2,)), "draft_token_ids"),
        (dict(draft_token_ids=torch.tensor([[1, 9, 3]])), "draft_token_ids"),
        (dict(num_draft_tokens=(4,)), "num_draft_tokens"),
        (dict(draft_probs=torch.zeros(1, 3, 4)), "draft_probs"),
    ],
)
def test_tree_verifier_rejects_bad_input(changes, match):
    gen = make_generator(0, "cpu")
    state = gen.get_state()
    with pytest.raises(ValueError, match=match):
        TreeVerifier().verify(
            torch.zeros(1, 4, 5), _proposal(**changes), [SamplingParams(temperature=1.0)], [gen]
        )
    assert torch.equal(gen.get_state(), state)  # nothing drawn before the error


def test_bad_input_to_the_pure_functions():
    with pytest.raises(ValueError, match="params|generator"):
        TreeVerifier().verify(torch.zeros(1, 4, 5), _proposal(), [], [None])
    with pytest.raises(ValueError, match="uniforms"):
        tree.tree_rejection_path(torch.full((2, 3), 1 / 3), None, [0], [-1], torch.zeros(3))
    with pytest.raises(ValueError, match="parents"):
        children_of([-1, 0, 0, 3], 4)
    # Parents past a sequence's nodes are padding and never read.
    assert children_of([-1, 0, 7, -9], 2) == [[0], [1], []]
