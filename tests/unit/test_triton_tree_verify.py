"""The device verification kernels (``kernels/triton/tree_verify.py``) against their torch
references in ``specdec.verify``, on the CPU under ``TRITON_INTERPRET=1``.

The references' own exactness is proven in ``test_tree_verify.py`` (exact propagation over
every branch); here the kernels must take the same decisions as the references, given the
same uniforms (the counter-based stream of ``stream_uniforms``), on random chains and trees
with duplicate siblings, forbidden tokens and vocabularies wider than one block. A chi-square
test of the kernel's own draws, with a negative control (recovering from ``p`` instead of the
residual), closes the loop.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import chi_square_pvalue, skip_device_call_repatching

pytestmark = pytest.mark.triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from test_tree_verify import SHAPES, _case, _draw_tree, _target_joint, _tree_batch  # noqa: E402

from specdec.config import SamplingParams  # noqa: E402
from specdec.kernels.triton.tree_verify import (  # noqa: E402
    as_int64_bits,
    chain_parents,
    match_paths,
    rejection_paths,
    row_choices,
    stream_uniforms,
)
from specdec.noise import SeededNoise, race_sample  # noqa: E402
from specdec.sampling import SamplingTensors, processed_probs  # noqa: E402
from specdec.types import PAD_TOKEN_ID  # noqa: E402
from specdec.verify.chain import match_verify  # noqa: E402
from specdec.verify.tree import tree_match_verify, tree_rejection_path  # noqa: E402
from specdec.verify.tree_layout import tree_depths  # noqa: E402

PAD = PAD_TOKEN_ID


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        skip_device_call_repatching(monkeypatch)


def _random_parents(rng: random.Random, n: int) -> list[int]:
    """A random tree of n nodes, parents before children."""
    return [rng.randrange(-1, j) for j in range(n)]


def _random_batch(rng: random.Random, batch: int, width: int):
    """Parents [batch, width] (chain or random tree, -1 padded) and counts [batch]."""
    parents = torch.full((batch, width), -1, dtype=torch.int64)
    counts = []
    for i in range(batch):
        n = rng.randrange(0, width + 1)
        tree = list(range(-1, n - 1)) if rng.random() < 0.3 else _random_parents(rng, n)
        parents[i, :n] = torch.tensor(tree, dtype=torch.int64)
        counts.append(n)
    return parents, counts


def _probs(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[rows, vocab] float32 processed probabilities with zeros past the top k."""
    st = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_k=top_k)], "cpu")
    return processed_probs(logits, st.repeat_rows(logits.shape[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_choices_greedy_is_the_argmax(dtype):
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    batch, width, vocab = 6, 5, 2500
    logits = torch.randn(batch, width + 1, vocab, generator=g).to(dtype)
    logits[0, 0, [7, 1500, 2499]] = 50.0  # a tie spread over three blocks: the lowest id
    logits[1, 0, [1024, 1025]] = 60.0  # a tie at a block boundary
    parents, counts = _random_batch(rng, batch, width)
    counts[0] = counts[1] = width
    chosen = row_choices(logits, parents, torch.tensor(counts))
    want = logits.float().argmax(dim=-1)
    for i, n in enumerate(counts):
        assert chosen[i, : n + 1].tolist() == want[i, : n + 1].tolist()
        assert chosen[i, n + 1 :].eq(-1).all()  # rows past the tree are not chosen
    assert chosen[0, 0] == 7 and chosen[1, 0] == 1024


def test_row_choices_seeded_equals_race_sample_at_each_depth():
    """Row r of a tree draws with the noise at position + depth(r), as tree_coupled_verify;
    seeds of any sign and size; rows that are no distribution choose -1."""
    g, rng = torch.Generator().manual_seed(1), random.Random(1)
    batch, width, vocab = 7, 6, 1300
    probs = _probs(torch.randn(batch * (width + 1), vocab, generator=g), top_k=40)
    probs = probs.view(batch, width + 1, vocab)
    probs[2, 0] = 0.0  # no distribution
    probs[3, 0, 5] = float("nan")
    parents, counts = _random_batch(rng, batch, width)
    counts[2] = counts[3] = 2
    seeds = [rng.randrange(-(2**63), 2**64) for _ in range(batch)]
    positions = [rng.randrange(0, 5000) for _ in range(batch)]
    chosen = row_choices(probs, parents, torch.tensor(counts), as_int64_bits(seeds, "cpu"),
                         torch.tensor(positions))  # fmt: skip
    for i, n in enumerate(counts):
        depths = tree_depths(parents[i, :n].tolist(), n)
        noises = [SeededNoise(seed=seeds[i], position=positions[i] + d) for d in depths]
        want = race_sample(probs[i, : n + 1], noises)
        assert chosen[i, : n + 1].tolist() == want.tolist(), i
        assert chosen[i, n + 1 :].eq(-1).all()
    assert chosen[2, 0] == -1 and chosen[3, 0] == -1


@pytest.mark.parametrize("seed", range(3))
def test_match_paths_equals_tree_match_verify(seed):
    """Random trees and chains over a small vocabulary (many matches, duplicate siblings),
    rows that choose nothing (-1): the same kept path, emitted tokens and rows."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    batch, width, vocab = 12, 9, 3
    parents, counts = _random_batch(rng, batch, width)
    drafts = torch.randint(0, vocab, (batch, width), generator=g)
    chosen = torch.randint(-1, vocab, (batch, width + 1), generator=g)
    for i, n in enumerate(counts):
        drafts[i, n:] = PAD
    got = match_paths(chosen, drafts, parents, torch.tensor(counts))
    want = tree_match_verify(chosen, drafts, parents, counts)
    for g_t, w_t in zip(got, want):
        assert torch.equal(g_t, w_t)
    chain = chain_parents(batch, width, "cpu")
    got = match_paths(chosen, drafts, chain, torch.tensor(counts))
    want_accepted, want_emitted = match_verify(chosen.clamp_min(-(2**40)), drafts, counts)
    assert torch.equal(got[0], want_accepted) and torch.equal(got[1], want_emitted)


def _reference_paths(probs, draft_probs, drafts, parents, counts, seeds, offsets):
    """tree_rejection_path per sequence with the kernel's uniforms, packed like the kernel."""
    batch, width = drafts.shape
    accepted = torch.zeros(batch, dtype=torch.int64)
    emitted = torch.full((batch, width + 1), PAD, dtype=torch.int64)
    rows = torch.full((batch, width + 1), PAD, dtype=torch.int64)
    for i, n in enumerate(counts):
        uniforms = torch.tensor(stream_uniforms(seeds[i], offsets[i], n + 1), dtype=torch.float64)
        q = None if draft_probs is None else draft_probs[i, :n]
        tokens, tree = drafts[i, :n].tolist(), parents[i, :n].tolist()
        path, final = tree_rejection_path(probs[i, : n + 1], q, tokens, tree, uniforms)
        accepted[i] = len(path)
        emitted[i, : len(path) + 1] = torch.tensor([tokens[j] for j in path] + [final])
        rows[i, : len(path) + 1] = torch.tensor([0] + [j + 1 for j in path])
    return accepted, emitted, rows


@pytest.mark.parametrize("rule", ["A", "B"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rejection_paths_take_the_references_branches(shape, rule):
    """The conformance cases of test_tree_verify (duplicate siblings under rule A, groups
    drawn without replacement under rule B, top-k zeros), 16 seeds each: every sequence keeps
    the path and draws the final token tree_rejection_path takes with the same uniforms; the
    kernel recovering from p instead of the residual does not."""
    target, draft, parents, tokens = _case(shape, rule, seed=7)
    rng = random.Random(7)
    runs = 16
    trees = [
        (parents, tokens if rule == "A" else _draw_tree(draft, parents, rng)) for _ in range(runs)
    ]
    logits, proposal = _tree_batch(target, draft, trees, width=len(parents))
    probs = processed_probs(
        logits.flatten(0, 1), SamplingTensors.from_params([target.params], "cpu").repeat_rows(
            logits.shape[0] * logits.shape[1])
    ).view_as(logits)  # fmt: skip
    seeds = [rng.randrange(0, 2**64) for _ in range(runs)]
    offsets = [rng.randrange(0, 10**6) for _ in range(runs)]
    counts = list(proposal.num_draft_tokens)
    args = (probs, proposal.draft_probs, proposal.draft_token_ids, proposal.parents)
    got = rejection_paths(*args, torch.tensor(counts), as_int64_bits(seeds, "cpu"),
                          torch.tensor(offsets))  # fmt: skip
    want = _reference_paths(*args, counts, seeds, offsets)
    for g_t, w_t in zip(got, want):
        assert torch.equal(g_t, w_t)
    assert 0 < int(got[0].sum()) < runs * len(parents)  # both acceptances and rejections
    broken = rejection_paths(*args, torch.tensor(counts), as_int64_bits(seeds, "cpu"),
                             torch.tensor(offsets), residual=False)  # fmt: skip
    assert not torch.equal(broken[1], want[1])


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_paths_on_wide_vocabularies_and_random_trees(with_q):
    """float32 rows of 2100 tokens (three blocks), random trees and chains, zero-count
    sequences, draft tokens the target forbids: the reference's decisions."""
    g, rng = torch.Generator().manual_seed(3), random.Random(3)
    batch, width, vocab = 10, 6, 2100
    probs = _probs(3 * torch.randn(batch * (width + 1), vocab, generator=g), top_k=6)
    probs = probs.view(batch, width + 1, vocab)
    draft_probs = None
    if with_q:
        draft_probs = _probs(3 * torch.randn(batch * width, vocab, generator=g), top_k=8)
        draft_probs = draft_probs.view(batch, width, vocab)
    parents, counts = _random_batch(rng, batch, width)
    counts[0] = 0
    drafts = torch.full((batch, width), PAD, dtype=torch.int64)
    for i, n in enumerate(counts):
        for j in range(n):  # mostly the parent row's likely tokens, sometimes a forbidden one
            row = probs[i, int(parents[i, j]) + 1]
            likely = row.topk(3).indices.tolist() + [int(row.argmin())]
            drafts[i, j] = rng.choice(likely)
    seeds = [rng.randrange(0, 2**64) for _ in range(batch)]
    offsets = list(range(batch))
    args = (probs, draft_probs, drafts, parents)
    got = rejection_paths(*args, torch.tensor(counts), as_int64_bits(seeds, "cpu"),
                          torch.tensor(offsets))  # fmt: skip
    want = _reference_paths(*args, counts, seeds, offsets)
    for g_t, w_t in zip(got, want):
        assert torch.equal(g_t, w_t)


def _first_two(target, draft, parents, runs: int, *, residual: bool) -> float:
    """p-value of the kernel's first two emitted tokens against the target's joint."""
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    trees = [(parents, _draw_tree(draft, parents, rng)) for _ in range(runs)]
    logits, proposal = _tree_batch(target, draft, trees, width=len(parents))
    st = SamplingTensors.from_params([target.params], "cpu")
    probs = processed_probs(logits.flatten(0, 1), st.repeat_rows(runs * logits.shape[1]))
    seeds = as_int64_bits([rng.randrange(0, 2**64) for _ in range(runs)], "cpu")
    _, emitted, _ = rejection_paths(
        probs.view_as(logits), proposal.draft_probs, proposal.draft_token_ids, proposal.parents,
        torch.tensor(proposal.num_draft_tokens), seeds, torch.zeros(runs, dtype=torch.int64),
        residual=residual,
    )  # fmt: skip
    first, second = emitted[:, 0], emitted[:, 1].clone()
    for i in (second == PAD).nonzero().flatten().tolist():  # the next step's token
        second[i] = torch.multinomial(target.probs((int(first[i]),)), 1, generator=gen)
    counts = torch.bincount(first * target.vocab + second, minlength=target.vocab**2)
    return chi_square_pvalue(counts, _target_joint(target, (), 2, {}).flatten())


def test_rejection_paths_are_lossless_and_a_broken_residual_is_caught():
    """The kernel's own draws (counter-based uniforms, two siblings drawn without replacement
    afresh for every run, one of them with a child) follow the target's joint of two tokens;
    the same kernel recovering from p instead of the residual (a plausible bug) fails the same
    test. (600 runs: the interpreter runs a program in about 20 ms.)"""
    target, draft, _, _ = _case("pairs", "B", seed=5)
    parents = [-1, -1, 0]
    assert _first_two(target, draft, parents, 600, residual=True) > 1e-4
    assert _first_two(target, draft, parents, 600, residual=False) < 1e-6


# --- the verifiers' device path (kernels="triton"), here under the interpreter ------------------


def _mixed_batch(kind: str, seed: int):
    """A batch mixing greedy, seeded and streamed sequences, as chain or tree proposals."""
    from specdec.types import DraftProposal, ProposalKind

    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    batch, width, vocab = 9, 5, 300
    logits = 2 * torch.randn(batch, width + 1, vocab, generator=g)
    parents, counts = _random_batch(rng, batch, width)
    if kind == "chain":
        parents = None
    best = logits.argmax(dim=-1)
    drafts = torch.full((batch, width), PAD, dtype=torch.int64)
    for i, n in enumerate(counts):
        for j in range(n):  # the parent row's argmax, sometimes not
            row = j if parents is None else int(parents[i, j]) + 1
            drafts[i, j] = best[i, row] if rng.random() < 0.7 else rng.randrange(vocab)
    proposal = DraftProposal(
        kind=ProposalKind.CHAIN if kind == "chain" else ProposalKind.TREE,
        draft_token_ids=drafts,
        num_draft_tokens=tuple(counts),
        parents=parents,
    )
    params, generators = [], []
    for i in range(batch):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0))
            generators.append(None)
        else:
            params.append(SamplingParams(temperature=0.9, top_k=50))
            generators.append(SeededNoise(seed=1000 + i, position=7 * i) if i % 3 == 1 else None)
    return logits, proposal, params, generators


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_device_path_gives_greedy_and_seeded_rows_the_references_tokens(kind):
    """Greedy and seeded sequences take exactly the torch verifier's path through the kernels
    (sharing a batch with streamed ones, whose draws differ but stay well formed)."""
    from specdec.verify import ChainVerifier, TreeVerifier

    cls = ChainVerifier if kind == "chain" else TreeVerifier
    for seed in range(2):
        logits, proposal, params, generators = _mixed_batch(kind, seed)
        want = cls(kernels="torch").verify(logits, proposal, params, generators)
        got = cls(kernels="triton").verify(logits, proposal, params, generators)
        exact = [i for i, p in enumerate(params) if p.is_greedy or generators[i] is not None]
        for i in exact:
            assert got.num_accepted[i] == want.num_accepted[i], (seed, i)
            assert torch.equal(got.emitted_token_ids[i], want.emitted_token_ids[i]), (seed, i)
            assert torch.equal(got.accepted_rows[i], want.accepted_rows[i]), (seed, i)
        for i, n in enumerate(got.num_accepted):  # streamed: a real token after the path
            assert 0 <= n <= proposal.num_draft_tokens[i]
            assert got.emitted_token_ids[i, n] >= 0 and got.emitted_token_ids[i, n + 1 :].eq(PAD).all()


def test_device_path_draws_stream_seeds_from_each_rows_generator():
    """Streamed sequences use one seed per sequence drawn from their own generator: the
    verifier's result equals rejection_paths given the seeds a clone of it draws."""
    from specdec.verify import TreeVerifier
    from specdec.verify.kernel_choice import stream_seeds

    logits, proposal, params, _ = _mixed_batch("tree", 3)
    batch = len(params)
    params = [SamplingParams(temperature=0.9, top_k=50)] * batch
    gens = [torch.Generator().manual_seed(40 + i // 2) for i in range(0, batch, 2) for _ in (0, 1)]
    gens = gens[:batch]
    clones = {}
    for gen in gens:
        clones.setdefault(id(gen), torch.Generator().set_state(gen.get_state()))
    got = TreeVerifier(kernels="triton").verify(logits, proposal, params, gens)
    seeds = stream_seeds([clones[id(gen)] for gen in gens], torch.device("cpu"))
    st = SamplingTensors.from_params(params, "cpu").repeat_rows(logits.shape[1])
    probs = processed_probs(logits.flatten(0, 1), st).view_as(logits)
    want = rejection_paths(probs, None, proposal.draft_token_ids, proposal.parents,
                           torch.tensor(proposal.num_draft_tokens), seeds,
                           torch.zeros(batch, dtype=torch.int64))  # fmt: skip
    assert list(got.num_accepted) == want[0].tolist()
    assert torch.equal(got.emitted_token_ids, want[1])
    assert torch.equal(got.accepted_rows, want[2])


def test_kernel_choice_is_checked(monkeypatch):
    from specdec.verify import ChainVerifier, TreeVerifier
    from specdec.verify import kernel_choice as device

    with pytest.raises(ValueError, match="kernels must be one of"):
        TreeVerifier(kernels="cuda")
    monkeypatch.setattr(device, "_triton_installed", lambda: False)
    assert not device.use_triton("auto", torch.device("cuda"))
    logits, proposal, params, generators = _mixed_batch("chain", 0)
    with pytest.raises(ImportError, match="kernels='triton' needs Triton"):
        ChainVerifier(kernels="triton").verify(logits, proposal, params, generators)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_generator_with_device_verifiers_equals_plain(stories_path, mode, monkeypatch):
    """stories260K through the real Generator with an EAGLE tree and a draft model verified by
    the kernels: greedy and seeded output equal plain decoding, token for token."""
    from specdec import Generator
    from specdec.kernels.triton import tree_verify, verify
    from specdec.proposers import DraftModel, EAGLETree
    from specdec.verify import ChainVerifier, TreeVerifier

    launches = []
    for module, name in ((tree_verify, "match_paths"), (verify, "greedy_chain_verify")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real: launches.append(1) or real(*a))

    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    if mode == "seeded":
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=11)
    plain = gen.generate(["Once upon a time", "The cat"], params)
    eagle = EAGLETree.from_pretrained(stories_path.parent / "stories260K-eagle")
    draft = DraftModel.from_pretrained(stories_path, dtype="float32")
    for proposer, verifier in ((eagle, TreeVerifier("triton")), (draft, ChainVerifier("triton"))):
        spec = Generator.from_components(
            gen.target, gen.tokenizer, proposer=proposer, verifier=verifier, policy=3
        )
        out = spec.generate(["Once upon a time", "The cat"], params)
        assert [o.token_ids for o in out] == [p.token_ids for p in plain]
        assert launches  # the kernels did the verifying
        launches.clear()
