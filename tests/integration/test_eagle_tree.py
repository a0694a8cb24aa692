"""EAGLETree through the real Generator: greedy output equals plain decoding, token for token.

Tiny random float64 targets (12-token vocabulary, so a random head's top-4 holds the target's
choice about a third of the time and paths several nodes deep get accepted) with random
EAGLE-1 and EAGLE-3 heads; every tree shape the proposer takes (a chain, a static top-4 x
depth-2 tree, the dynamic tree, one node); ragged batches; preemption; greedy requests inside
sampled batches; logprobs and stop strings on stories260K. A scripted oracle tree proposer
(the right path hidden among decoys) drives the engine's tree commit deep, and after every
step every pool's K/V of the committed tokens is checked against a recomputation.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import make_hf_model

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.kv.allocator import PageAllocator
from specdec.kv.paged import KVCacheManager
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.models.llama import ModelConfig
from specdec.models.loading import load_model, model_from_state_dict
from specdec.proposers import EAGLETree
from specdec.proposers.tree_shape import best_first
from specdec.types import DraftProposal, ProposalKind, pad_rows

F64 = torch.float64
VOCAB = 12
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
TREES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "static-top4x2": [[i] for i in range(4)] + [[i, j] for i in range(4) for j in range(4)],
    "dynamic": None,  # top_k 4, depth 5, 16 nodes
    "one-node": [[0]],
}


def _target(kind: str, seed: int = 0):
    hf = make_hf_model(kind, seed, vocab_size=VOCAB, max_position_embeddings=256)
    cfg = ModelConfig.from_hf_config(hf.config)
    return model_from_state_dict(cfg, iter(hf.state_dict().items()), dtype=F64, device=torch.device("cpu"))


def random_eagle_head(target, kind: EagleKind, seed: int = 1) -> EagleHeadModel:
    """A random head; EAGLE-3 feeds on the inputs of layers 0 and 1 and the last output."""
    layers = None if kind is EagleKind.EAGLE1 else (0, 1, target.config.num_layers)
    torch.manual_seed(seed)
    cfg = EagleHeadConfig.for_target(target.config, kind, target_layers=layers)
    head = EagleHeadModel(target, cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def targets():
    return {"llama": _target("llama"), "qwen2": _target("qwen2")}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def _eagle_gen(target, head, tree, **kwargs) -> Generator:
    eagle = EAGLETree.from_model(head, tree)
    return Generator.from_components(
        target, proposer=eagle, policy=FixedPolicy(eagle.num_speculative_tokens), **kwargs
    )


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kind", [EagleKind.EAGLE1, EagleKind.EAGLE3], ids=["eagle1", "eagle3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_equals_plain(targets, arch, kind, tree):
    target = targets[arch]
    prompts = _prompts(6, seed=len(tree or "d") + (kind is EagleKind.EAGLE3))
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = _eagle_gen(target, random_eagle_head(target, kind), TREES[tree])
    out = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    m = gen.metrics
    assert m.num_verify_steps > 0 and m.num_accepted > 0
    if tree in ("dynamic", "static-top4x2"):
        assert len(m.accepted_per_position) >= 2 and m.accepted_per_position[1] > 0  # depth 2 kept
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_dynamic_tree_under_a_smaller_fixed_policy_verifies_the_best_nodes(targets):
    target = targets["llama"]
    prompts = _prompts(4, seed=3)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    eagle = EAGLETree.from_model(random_eagle_head(target, EagleKind.EAGLE1), None)
    widths = []
    real = eagle.propose

    def recording(ctx):
        out = real(ctx)
        widths.extend(out.num_draft_tokens)
        return out

    eagle.propose = recording
    gen = Generator.from_components(target, proposer=eagle, policy=FixedPolicy(5))
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert max(widths) == 5


@pytest.mark.parametrize("kind", [EagleKind.EAGLE1, EagleKind.EAGLE3], ids=["eagle1", "eagle3"])
def test_trees_sized_by_min_path_prob_keep_greedy_output(targets, kind):
    """Each sequence's tree holds only the nodes whose path probability reaches the floor (the
    best node always): trees of several sizes within one batch and across steps, the same
    output as plain decoding, every verified node at or above the floor, no page left."""
    target = targets["qwen2"]
    prompts = _prompts(6, seed=17)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    eagle = EAGLETree.from_model(random_eagle_head(target, kind, seed=2), None, min_path_prob=0.15)
    sizes = []
    real_grow = eagle._grow

    def recording(*args, **kwargs):
        trees = real_grow(*args, **kwargs)
        for nodes in trees:
            kept, _ = best_first(nodes, 8, eagle.shape.min_score)
            assert all(math.exp(nodes[i].score) >= 0.15 for i in kept[1:])
            sizes.append(len(kept))
        return trees

    eagle._grow = recording
    gen = Generator.from_components(target, proposer=eagle, policy=FixedPolicy(8))
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert min(sizes) == 1 and len(set(sizes)) > 2, sizes
    drafted = gen.metrics.num_drafted / gen.metrics.num_verify_steps
    assert drafted < 8  # the floor cut trees that FixedPolicy(8) alone would keep whole
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_min_path_prob_is_checked_before_files_are_read():
    with pytest.raises(ValueError, match=r"min_path_prob must be in \[0, 1\), got 1.5"):
        EAGLETree.from_pretrained("no-such-head", min_path_prob=1.5)


def test_ragged_batch_with_preemption(targets):
    target = targets["qwen2"]
    prompts = _prompts(8, seed=11)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    head = random_eagle_head(target, EagleKind.EAGLE3, seed=4)
    # 2-slot pages, too few for all eight requests with 16-node trees in flight.
    cache = CacheConfig(max_batch_size=8, max_model_len=48, page_size=2, num_pages=90)
    gen = _eagle_gen(target, head, None, cache_config=cache)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert gen.scheduler.num_preemptions > 0
    assert gen.metrics.num_accepted > 0


def test_greedy_and_seeded_requests_inside_a_sampled_batch(targets):
    target = targets["llama"]
    prompts = _prompts(6, seed=5)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=8, top_p=0.9, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, seed=9, ignore_eos=True)
    params = [GREEDY, sampled, seeded, GREEDY, sampled, seeded]
    plain = Generator.from_components(target)
    want_greedy = plain.generate([prompts[0], prompts[3]], GREEDY)
    want_seeded = plain.generate([prompts[2], prompts[5]], seeded)
    gen = _eagle_gen(target, random_eagle_head(target, EagleKind.EAGLE1), None)
    out = gen.generate(prompts, params)
    assert [out[0].token_ids, out[3].token_ids] == [o.token_ids for o in want_greedy]
    # A seed pins the tokens: the coupled rule emits the plain seeded output.
    assert [out[2].token_ids, out[5].token_ids] == [o.token_ids for o in want_seeded]
    assert all(len(o.token_ids) == 24 for o in out)


@pytest.fixture(scope="module")
def stories(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    return target, Generator.from_pretrained(stories_path, dtype="float32")


@pytest.mark.parametrize("tree", ["dynamic", "static-top4x2"])
def test_stories_float32_greedy_logprobs_and_stop_strings(stories, tree):
    target, plain_gen = stories
    head = random_eagle_head(target, EagleKind.EAGLE1, seed=6)
    gen = Generator.from_components(
        target,
        plain_gen.tokenizer,
        proposer=EAGLETree.from_model(head, TREES[tree]),
        policy=FixedPolicy(16 if tree == "dynamic" else 20),
    )
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, logprobs=2)
    plain = plain_gen.generate(prompts, params)
    spec = gen.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
        torch.testing.assert_close(
            torch.tensor([t.logprob for t in a.logprobs]), torch.tensor([t.logprob for t in b.logprobs])
        )
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]
    # A stop string ends the text exactly where plain decoding ends it.
    stop = plain_gen.decode(plain[0].token_ids[5:8]).strip() or "."
    stopped = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert [o.text for o in gen.generate(prompts, stopped)] == [
        o.text for o in plain_gen.generate(prompts, stopped)
    ]


# --------------------------------------------------------------------------- oracle trees


class OracleTree:
    """A scripted tree proposer that knows the plain greedy continuation of its prompts.

    Each step it hides the right path (a random depth 0..4) at a random sibling position among
    random decoys, sometimes with a wrong node in the middle, so the engine keeps paths of every
    depth and shape; it also keeps a one-layer "head" pool, written at draft time with garbage
    and at commit time with values that depend only on (slot, token), to check that the engine
    compacts every pool and tells the proposer the kept rows in path order.
    """

    kind = ProposalKind.TREE
    needs_target_hidden = True

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], seed: int, width: int = 12) -> None:
        self.continuations = continuations
        self.rng = random.Random(seed)
        self.num_speculative_tokens = width
        self.told: list[tuple[list[int], list[int]]] = []  # (committed tokens, input ids told)

    def kv_specs(self):
        from specdec.kv.paged import KVSpec

        return (KVSpec(name="oracle", num_layers=1, num_kv_heads=1, head_dim=2, dtype=F64),)

    def _truth(self, history) -> list[int]:
        for prompt, cont in self.continuations.items():
            done = len(history) - len(prompt)
            if 0 <= done <= len(cont) and list(history) == [*prompt, *cont[:done]]:
                return cont[done:]
        raise AssertionError("unknown prompt")

    def propose(self, ctx):
        rows_t, rows_p = [], []
        for history in ctx.token_ids:
            truth = self._truth(history)
            tokens, parents = [], []
            parent = -1
            for d in range(self.rng.randint(0, min(4, len(truth)))):
                decoys = self.rng.randint(0, 2)
                right = self.rng.randint(0, decoys)
                here = None
                for s in range(decoys + 1):
                    tok = truth[d] if s == right else self.rng.choice([t for t in range(VOCAB) if t != truth[d]])
                    tokens.append(tok)
                    parents.append(parent)
                    if s == right:
                        here = len(tokens) - 1
                parent = here
            tokens, parents = tokens[: ctx.num_speculative_tokens], parents[: ctx.num_speculative_tokens]
            rows_t.append(tokens)
            rows_p.append(parents)
            # Draft-time garbage in the head pool at the verify slots.
            start = len(history) - 1
            slots = ctx.kv.manager.slot_ids(self.seq(ctx, len(rows_t) - 1), range(start, start + len(tokens) + 1))
            ctx.kv.pool.cache.view(2, -1, 2)[:, slots] = -7.0  # [K/V, flat slots, D]
        width = ctx.num_speculative_tokens
        parents = torch.full((len(rows_p), width), -1, dtype=torch.int64)
        for i, p in enumerate(rows_p):
            parents[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        return DraftProposal(
            kind=ProposalKind.TREE,
            draft_token_ids=pad_rows(rows_t, width),
            num_draft_tokens=tuple(len(t) for t in rows_t),
            parents=parents,
        )

    @staticmethod
    def seq(ctx, i):
        return ctx.seq_ids[i]

    def on_target_step(self, step):
        for i, seq_id in enumerate(step.seq_ids):
            start, kept = step.start_slots[i], step.kept_rows[i]
            rows = step.input_token_ids[step.qo_indptr[i] : step.qo_indptr[i] + kept].tolist()
            # The kept rows, in path order, are the committed tokens at those slots.
            assert rows == list(step.token_ids[i][start : start + kept]), (rows, step.token_ids[i])
            slots = step.kv.manager.slot_ids(seq_id, range(start, start + kept))
            values = torch.tensor([[float(start + r), float(t)] for r, t in enumerate(rows)], dtype=F64)
            step.kv.pool.cache.view(2, -1, 2)[:, slots] = values  # [K/V, flat slots, D]

    def release(self, seq_id):
        pass


def _recomputed_kv(target, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, len(tokens), Hkv, D] K and V of ``tokens`` computed from scratch."""
    cfg = target.config
    manager = KVCacheManager(PageAllocator(64), 4)
    kv = manager.add_pool(cfg.kv_spec("fresh", target.dtype))
    manager.add_sequence(0)
    manager.reserve(0, len(tokens))
    layout = kv.layout([0], [tokens], [0])
    backend = TorchAttentionBackend()
    target(layout, kv, backend, backend.plan(layout, cfg.attention_spec))
    slots = manager.slot_ids(0, range(len(tokens)))
    cache = kv.pool.cache.view(cfg.num_layers, 2, -1, cfg.num_kv_heads, cfg.head_dim)
    return cache[:, 0, slots], cache[:, 1, slots]


def _check_committed_kv(gen, target, oracle_pool_check: bool) -> int:
    """Every running request's committed K/V (target pool, and the oracle's pool) is what a
    recomputation gives; returns how many requests were checked."""
    cfg = target.config
    manager = gen.kv
    target_cache = gen.engine.target_kv.pool.cache.view(cfg.num_layers, 2, -1, cfg.num_kv_heads, cfg.head_dim)
    checked = 0
    for req in gen.scheduler.running:
        n = req.num_computed
        if n == 0:
            continue
        slots = manager.slot_ids(req.seq_id, range(n))
        k, v = _recomputed_kv(target, list(req.token_ids[:n]))
        torch.testing.assert_close(target_cache[:, 0, slots], k, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(target_cache[:, 1, slots], v, rtol=1e-9, atol=1e-9)
        if oracle_pool_check:
            pool = gen.engine.proposer_kv.pool.cache.view(2, -1, 2)  # [K/V, flat slots, D]
            want = torch.tensor([[float(s), float(t)] for s, t in enumerate(req.token_ids[:n])], dtype=F64)
            torch.testing.assert_close(pool[:, slots], want.expand(2, -1, -1))
        checked += 1
    return checked


def test_oracle_trees_commit_deep_paths_and_every_pool_holds_the_committed_kv(targets):
    target = targets["llama"]
    prompts = _prompts(5, seed=21)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    continuations = {tuple(p): list(o.token_ids) for p, o in zip(prompts, plain)}
    oracle = OracleTree(continuations, seed=3)
    gen = Generator.from_components(target, proposer=oracle, policy=FixedPolicy(12))
    handles = [gen.submit(p, params) for p in prompts]
    checked = 0
    while not all(h.done for h in handles):
        gen.step()
        checked += _check_committed_kv(gen, target, oracle_pool_check=True)
    assert [h.result().token_ids for h in handles] == [o.token_ids for o in plain]
    m = gen.metrics
    assert m.num_emitted_in_verify / m.num_verify_steps > 2.0  # deep paths were kept
    assert len(m.accepted_per_position) >= 4 and m.accepted_per_position[3] > 0
    assert checked > 20


def test_eagle_head_pool_holds_the_recomputed_committed_kv(targets):
    """After every step of a random-acceptance EAGLE run, the head's committed K/V equals the
    head run from scratch over the target's features of the committed tokens."""
    target = targets["llama"]
    head = random_eagle_head(target, EagleKind.EAGLE1, seed=8)
    gen = _eagle_gen(target, head, None)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    handles = [gen.submit(p, params) for p in _prompts(3, seed=2)]
    cfg, checked = target.config, 0
    while not all(h.done for h in handles):
        gen.step()
        for req in gen.scheduler.running:
            n = req.num_computed
            tokens = list(req.token_ids[: n + 1])
            manager = KVCacheManager(PageAllocator(64), 4)
            t_kv = manager.add_pool(cfg.kv_spec("t", F64))
            h_kv = manager.add_pool(head.kv_spec("h"))
            manager.add_sequence(0)
            manager.reserve(0, n)
            backend = TorchAttentionBackend()
            layout = t_kv.layout([0], [tokens[:n]], [0])
            out = target(layout, t_kv, backend, backend.plan(layout, cfg.attention_spec), hidden_layers=head.config.target_layers)
            hl = h_kv.layout([0], [tokens[1 : n + 1]], [0])
            head(head.target_feature(out.hidden_states), hl.token_ids, hl.positions, h_kv, backend, backend.plan(hl, head.attention_spec))
            slots = gen.kv.slot_ids(req.seq_id, range(n))
            mine = gen.engine.proposer_kv.pool.cache[0][:, :, :, :].flatten(1, 2)[:, slots]
            fresh = h_kv.pool.cache[0].flatten(1, 2)[:, manager.slot_ids(0, range(n))]
            torch.testing.assert_close(mine, fresh, rtol=1e-9, atol=1e-9)
            checked += 1
        _check_committed_kv(gen, target, oracle_pool_check=False)  # and the target's pool
    assert checked > 10
    assert gen.metrics.num_accepted > 0


def test_the_default_adaptive_policy_sizes_trees_and_keeps_greedy_output(targets):
    from specdec import AdaptivePolicy

    target = targets["qwen2"]
    prompts = _prompts(4, seed=17)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = Generator.from_components(
        target, proposer=EAGLETree.from_model(random_eagle_head(target, EagleKind.EAGLE3), None)
    )
    assert isinstance(gen.policy, AdaptivePolicy)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    sizes = gen.metrics.k_histogram
    assert any(k > 0 for k in sizes), sizes  # a fresh generator tried trees
    assert set(sizes) <= {0, 1, 2, 4, 8, 16}, sizes  # the sizer's candidate node counts
