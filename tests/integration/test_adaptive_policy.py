"""The speculation policy through the whole engine: whatever k it picks per request and step
(0 included), greedy output is plain greedy output; its choices show in the metrics; the fixed
policy keeps the old behaviour; bad policy arguments fail before any work."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import ScriptedPolicy, random_prompts

import specdec.generator
from specdec import (
    AdaptivePolicy,
    AdaptivePolicyConfig,
    CacheConfig,
    FixedPolicy,
    Generator,
    SamplingParams,
)
from specdec.proposers import DraftModel, PromptLookup

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
K = 4


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    return random_prompts(vocab, n, seed)


@pytest.fixture(scope="module")
def prompts(tiny_pair):
    base = _prompts(tiny_pair[0].config.vocab_size, 5, seed=3)
    # Repeated halves give prompt lookup something to find.
    return [p + p for p in base]


@pytest.fixture(scope="module")
def plain(tiny_pair, prompts):
    return [o.token_ids for o in Generator.from_components(tiny_pair[0]).generate(prompts, GREEDY)]


def _proposer(kind: str, draft):
    if kind == "draft":
        return DraftModel.from_model(draft, num_speculative_tokens=K)
    return PromptLookup(num_speculative_tokens=K)


def assert_clean(gen: Generator) -> None:
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert gen.engine._seen == {}
    if isinstance(gen.policy, AdaptivePolicy):
        assert gen.policy._requests == {}  # per-request policy state released


@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_adaptive_policy_greedy_is_exact(tiny_pair, prompts, plain, kind):
    target, draft = tiny_pair
    gen = Generator.from_components(target, proposer=_proposer(kind, draft))
    assert isinstance(gen.policy, AdaptivePolicy)  # the default
    for _ in range(2):  # the second run starts from what the first one learned
        outs = gen.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == plain
    for out in outs:
        # Every step after the (shared) prefill was a decode step with a chosen k.
        assert sum(out.metrics.k_histogram.values()) == out.metrics.num_target_forwards - 1
    assert gen.policy.target_cost.measured
    assert gen.metrics.num_drafted > 0  # the policy did speculate: the check above means something
    assert_clean(gen)


@pytest.mark.parametrize("kind", ["draft", "lookup"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_k_per_request_and_step_is_exact(tiny_pair, prompts, plain, kind, seed):
    target, draft = tiny_pair
    policy = ScriptedPolicy(seed, K)
    gen = Generator.from_components(target, proposer=_proposer(kind, draft), policy=policy)
    outs = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert 0 in policy.chosen and K in policy.chosen  # both extremes were exercised
    # The metrics count exactly the choices made, per generator and summed over requests.
    assert gen.metrics.k_histogram == dict(policy.chosen)
    total = Counter()
    for out in outs:
        total.update(out.metrics.k_histogram)
    assert total == policy.chosen
    if kind == "draft":
        assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted
    assert_clean(gen)


def test_unseen_counts_what_the_proposer_has_not_been_shown(tiny_pair, prompts):
    target, draft = tiny_pair
    policy = ScriptedPolicy(2, K)
    gen = Generator.from_components(target, proposer=_proposer("draft", draft), policy=policy)
    gen.generate(prompts, GREEDY)
    first, _ = policy.contexts[0]
    assert first.unseen == tuple(len(p) + 1 for p in prompts)  # prompt + the prefill's token
    for (ctx, ks), (after, _) in zip(policy.contexts, policy.contexts[1:]):
        if ctx.seq_ids == after.seq_ids:
            for i, k in enumerate(ks):
                if k > 0:
                    assert after.unseen[i] == 0  # drafted last step: nothing to catch up on
                else:
                    assert after.unseen[i] > ctx.unseen[i]


def test_fixed_policy_drafts_k_every_step(tiny_pair):
    target, _ = tiny_pair
    k = 3
    # An identical draft is always accepted, so every step emits k + 1 tokens.
    params = SamplingParams(max_new_tokens=1 + 5 * (k + 1), ignore_eos=True)
    prompts = _prompts(target.config.vocab_size, 3, seed=4)
    for policy in (FixedPolicy(k), k):
        gen = Generator.from_components(
            target, proposer=DraftModel.from_model(target, num_speculative_tokens=5), policy=policy
        )
        outs = gen.generate(prompts, params)
        assert isinstance(gen.policy, FixedPolicy) and gen.policy.k == k
        assert gen.metrics.k_histogram == {k: 5 * len(prompts)}
        assert gen.metrics.mean_accepted_length == k + 1
        assert all(o.metrics.k_histogram == {k: 5} for o in outs)


def test_fixed_policy_zero_is_plain_decoding(tiny_pair, prompts, plain):
    target, draft = tiny_pair
    gen = Generator.from_components(target, proposer=_proposer("draft", draft), policy=0)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == plain
    assert gen.metrics.num_drafted == 0
    assert set(gen.metrics.k_histogram) == {0}


def test_seeded_sampling_reproduces_under_the_default_policy(tiny_pair, prompts):
    target, draft = tiny_pair
    gen = Generator.from_components(target, proposer=_proposer("draft", draft))
    params = [
        SamplingParams(max_new_tokens=30, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = Generator.from_components(target).generate(prompts, params)
    # The policy learns in between and adapts k freely; a seed still pins the output, and it
    # is plain decoding's output for that seed.
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]
    assert set(gen.metrics.k_histogram) <= set(range(K + 1))
    assert gen.metrics.num_drafted > 0


def test_adaptive_policy_config_reaches_the_engine(tiny_pair, prompts, plain):
    target, draft = tiny_pair
    config = AdaptivePolicyConfig(decay=0.5, min_probe_interval=2)
    gen = Generator.from_components(
        target, proposer=_proposer("lookup", draft), policy=AdaptivePolicy(config)
    )
    assert gen.policy.config is config
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == plain


class OverreachingPolicy(FixedPolicy):
    def choose(self, ctx):
        return tuple(cap + 1 for cap in ctx.caps)


def test_a_misbehaving_policy_fails_its_batch_and_leaves_nothing_behind(tiny_pair, prompts, plain):
    target, draft = tiny_pair
    gen = Generator.from_components(
        target, proposer=_proposer("draft", draft), policy=OverreachingPolicy(K)
    )
    with pytest.raises(ValueError, match="policy chose k"):
        gen.generate(prompts, GREEDY)
    assert_clean(gen)
    assert gen.proposer._computed == {}


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("fast", TypeError, "policy must be a SpeculationPolicy.*got str"),
        (True, TypeError, "policy must be a SpeculationPolicy.*got bool"),
        (2.0, TypeError, "policy must be a SpeculationPolicy.*got float"),
        (-1, ValueError, "policy as an int is a fixed k and must be >= 0"),
        (FixedPolicy(K + 1), ValueError, r"policy FixedPolicy\(5\) drafts more than"),
        (K + 1, ValueError, r"policy FixedPolicy\(5\) drafts more than"),
    ],
)
def test_bad_policy_raises_before_work(
    tiny_pair, tiny_checkpoint, monkeypatch, policy, error, match
):
    target, draft = tiny_pair
    proposer = _proposer("lookup", draft)
    with pytest.raises(error, match=match):
        Generator.from_components(target, proposer=proposer, policy=policy)
    plain_gen = Generator.from_components(target)
    with pytest.raises(error, match=match):
        plain_gen.with_proposer(proposer, policy=policy)

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad policy was rejected")

    monkeypatch.setattr(specdec.generator, "load_model", forbidden)
    with pytest.raises(error, match=match):
        Generator.from_pretrained(tiny_checkpoint("qwen2"), proposer=proposer, policy=policy)


def test_policy_without_a_proposer_is_rejected(tiny_pair):
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="policy=FixedPolicy\\(2\\) needs a proposer"):
        Generator.from_components(target, policy=FixedPolicy(2))
    assert Generator.from_components(target).policy is None


def test_each_generator_gets_its_own_default_policy(tiny_pair):
    target, draft = tiny_pair
    a = Generator.from_components(target, proposer=_proposer("lookup", draft))
    b = a.with_proposer(_proposer("lookup", draft), cache_config=CacheConfig(page_size=8))
    assert isinstance(b.policy, AdaptivePolicy) and b.policy is not a.policy


def _slow_target(model, seconds):
    """``model`` with a sleep of ``seconds(rows)`` after every forward, large enough to dominate
    the tiny model's own time: a stand-in for a real target's cost by row count."""
    import copy
    import time

    slow = copy.deepcopy(model)
    forward = slow.forward

    def timed_forward(layout, *args, **kwargs):
        out = forward(layout, *args, **kwargs)
        time.sleep(seconds(layout.num_tokens))
        return out

    slow.forward = timed_forward
    return slow


def test_a_fresh_generator_speculates_when_it_pays(tiny_pair):
    """Cold start on a convex (flat-then-linear) cost: verify passes of up to 8 rows cost what
    a decode step costs, a 30-row prefill costs 23x. A draft identical to the target (always
    accepted, and not slowed) makes speculation pay from the first request; the policy must
    find that out in that request, not assume the chord from 1 to 30 rows."""
    target, _ = tiny_pair
    # 20 ms up to 8 rows, then 20 ms a row: the flat-then-linear shape of a pass on this CPU
    slow = _slow_target(target, lambda rows: 0.020 + 0.020 * max(0, rows - 8))
    prompt = random_prompts(target.config.vocab_size, 1, seed=9, max_len=31)[0]
    prompt = (prompt * 30)[:30]
    gen = Generator.from_components(slow, proposer=DraftModel.from_model(target, num_speculative_tokens=K))
    out = gen.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    plain = Generator.from_components(target).generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == plain.token_ids
    assert out.metrics.num_drafted > 0, out.metrics.k_histogram
    assert out.metrics.num_target_forwards < 12  # most steps speculated (plain: 24)


def test_a_fresh_generator_stops_where_speculation_cannot_pay(tiny_pair):
    """Every row costs its full price (20 ms a row, compute-bound) and a draft token 60 ms: even
    a perfect draft cannot pay (k = 1 costs 100 ms for 2 tokens, 2.5x a plain token), so after
    trying each untried row count once the policy decodes plainly. The margin is wide on
    purpose: the costs are measured sleeps, and a loaded machine (parallel test workers) can
    add a few ms to any of them; at 10 ms a row and draft token (1.5x) one slow plain step was
    enough to make speculation look worth retrying."""
    target, _ = tiny_pair
    slow = _slow_target(target, lambda rows: 0.020 * rows)
    perfect_draft = _slow_target(target, lambda rows: 0.060)
    prompt = random_prompts(target.config.vocab_size, 1, seed=9, max_len=31)[0]
    gen = Generator.from_components(slow, proposer=DraftModel.from_model(perfect_draft, num_speculative_tokens=K))
    out = gen.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    plain = Generator.from_components(target).generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert out.token_ids == plain.token_ids
    speculative_steps = sum(n for k, n in out.metrics.k_histogram.items() if k > 0)
    assert 1 <= speculative_steps <= 4, out.metrics.k_histogram

