"""SuffixHybrid through the real Generator: suffix trees where the text repeats, the draft
model elsewhere, per request and step, and the output of plain decoding throughout.

Greedy and seeded outputs equal plain decoding at batch > 1, in rounds that repeat earlier
requests (so both sides draft, in the same batches), under preemption, and with a rule that
chooses at random. The cost rule's arithmetic is checked on its own. (Its distribution at
T > 0: tests/integration/test_lossless_engine.py, the ``hybrid`` cases and their negative
control.)
"""

from __future__ import annotations

import pytest
from helpers import coin_rule, perturbed

from specdec import AdaptivePolicy, CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.codec import load_tokenizer
from specdec.models.loading import load_model
from specdec.proposers import DraftModel, SuffixDecoding, SuffixHybrid
from specdec.proposers.hybrid import CostRule, chain_expectation
from specdec.proposers.suffix_tree import DraftTree

PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play",
    "Tom had a big red ball. He liked to play with it every day. One day",
    "The sun was hot.",
    "Sue and her mom went to the park. They saw a big dog. The dog",
]
GREEDY = SamplingParams(max_new_tokens=48)
SEEDED = SamplingParams(max_new_tokens=48, temperature=0.8, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def stories(stories_path):
    target, _, _ = load_model(stories_path, dtype="float64")
    return target, perturbed(target, 0.2, seed=4), load_tokenizer(stories_path)


def _pair(stories, cache=None, rule=None):
    target, draft, tok = stories
    plain = Generator.from_components(target, tok, cache_config=cache)
    hybrid = SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=4),
                          SuffixDecoding(num_speculative_tokens=8), rule=rule)  # fmt: skip
    gen = Generator.from_components(target, tok, proposer=hybrid, cache_config=cache, policy=FixedPolicy(8))
    return plain, gen, hybrid


@pytest.mark.parametrize("rule", ["cost", "random"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_plain_decoding(stories, params, rule):
    plain, gen, hybrid = _pair(stories, rule=coin_rule(0) if rule == "random" else None)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    for _ in range(3):  # later rounds repeat earlier ones: the suffix trees find them
        assert [o.token_ids for o in gen.generate(PROMPTS, params)] == expected
    assert hybrid.num_suffix_steps > 0 and hybrid.num_model_steps > 0, (hybrid.num_suffix_steps,
                                                                         hybrid.num_model_steps)  # fmt: skip
    assert hybrid.suffix._requests == {} and hybrid.rule._requests == {} and hybrid._steps == {}


@pytest.mark.parametrize("rule", ["cost", "random"])
def test_the_controller_drafts_what_the_forecast_said(stories, rule):
    """Under the adaptive policy the engine hands the policy the hybrid's forecasts; each
    step then drafts, per request, from the side forecast for the size chosen, the suffix
    tree's nodes exactly and the model's at most; outputs stay plain decoding's, request by
    request (forecasts size a lone request), over rounds that repeat earlier requests."""
    target, draft, tok = stories
    plain = Generator.from_components(target, tok)
    hybrid = SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=4),
                          SuffixDecoding(num_speculative_tokens=8),
                          rule=coin_rule(1) if rule == "random" else None)  # fmt: skip
    policy = AdaptivePolicy()
    gen = Generator.from_components(target, tok, proposer=hybrid, policy=policy)
    told: dict[int, tuple[int, bool]] = {}
    checked = []
    choose, propose = policy.choose, hybrid.propose

    def choose_and_remember(ctx):
        ks = choose(ctx)
        assert ctx.forecast is not None
        if any(ks):
            for s, f in zip(ctx.seq_ids, ctx.forecast(max(ks))):
                told[s] = (f.nodes, f.model)
        return ks

    def propose_and_compare(ctx):
        out = propose(ctx)
        for s, drafted in zip(ctx.seq_ids, out.num_draft_tokens):
            used_suffix, _, _ = hybrid._steps[s]
            nodes, model = told.pop(s)
            assert used_suffix != model
            assert drafted == nodes if used_suffix else drafted <= nodes
            checked.append(used_suffix)
        return out

    policy.choose, hybrid.propose = choose_and_remember, propose_and_compare
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for _ in range(3):
        assert [gen.generate(p, GREEDY).token_ids for p in PROMPTS] == expected
    assert any(checked) and not all(checked), checked  # both sides drafted


def test_repeats_go_to_the_suffix_trees_and_fresh_text_to_the_model(stories):
    _, gen, hybrid = _pair(stories)
    gen.generate(PROMPTS[:2], GREEDY)
    first = (hybrid.num_suffix_steps, hybrid.num_model_steps)
    assert first[1] > first[0]  # fresh text: mostly the draft model
    gen.generate(PROMPTS[:2], GREEDY)
    suffix, model = hybrid.num_suffix_steps - first[0], hybrid.num_model_steps - first[1]
    assert suffix > model, (suffix, model)  # the same requests again: mostly the suffix trees
    assert hybrid.rule.draft_cost > 0  # measured


def test_preemption_keeps_outputs(stories):
    cache = CacheConfig(page_size=4, num_pages=48, max_batch_size=4)
    plain, gen, hybrid = _pair(stories, cache, rule=coin_rule(1))
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for _ in range(2):
        assert [o.token_ids for o in gen.generate(PROMPTS, GREEDY)] == expected
    assert gen.scheduler.num_preemptions > 0
    stats = gen.kv_stats()
    assert stats["num_used_pages"] == 0


class _Recording(FixedPolicy):
    """FixedPolicy that keeps the catch-up each ``propose`` call is reported to have done."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.caught_up: list[int] = []

    def observe_propose(self, batch: int, width: int, seconds: float, unseen: int) -> None:
        self.caught_up.append(unseen)


def test_the_policy_is_told_the_catch_up_the_draft_model_did(stories):
    """Only the model catches up: a step whose drafts all came from suffix trees ran nothing,
    and a request's first model step runs its whole prompt. The engine alone (every request
    in a ``propose`` call caught up) reported a repeated prompt's first, suffix-drafted step
    as a whole prompt of catch-up, and priced a draft model's catch-up at a fraction of it."""
    target, draft, tok = stories
    policy = _Recording(8)
    hybrid = SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=4),
                          SuffixDecoding(num_speculative_tokens=8))  # fmt: skip
    gen = Generator.from_components(target, tok, proposer=hybrid, policy=policy)
    model_called: list[bool] = []
    propose = hybrid.propose

    def tracking(ctx):
        before = hybrid.num_model_steps
        out = propose(ctx)
        model_called.append(hybrid.num_model_steps > before)
        return out

    hybrid.propose = tracking
    prompt = tok.encode(PROMPTS[0])
    gen.generate([PROMPTS[0]], GREEDY)  # fresh: the model drafts from the first step
    assert model_called[0] and policy.caught_up[0] >= len(prompt) - 2
    first = len(model_called)
    gen.generate([PROMPTS[0]], GREEDY)  # the same again: the suffix tree has it all
    suffix_only = [u for u, m in zip(policy.caught_up[first:], model_called[first:]) if not m]
    assert suffix_only and not any(suffix_only), suffix_only
    assert len(policy.caught_up) == len(model_called)


def test_cost_rule():
    assert chain_expectation(0.0, 4) == 0.0
    assert chain_expectation(1.0, 4) == pytest.approx(4 * 0.999, rel=1e-2)
    rule = CostRule()
    tree = DraftTree([5, 6, 7], [-1, 0, 1], score=2.5, match_len=6)
    assert rule.prefer_suffix(1, tree, 4)  # 3.5 >= 1 + 0.6 + 0.36 + ... = 2.3
    assert not rule.prefer_suffix(1, DraftTree([], [], 0.0, 0), 4)  # nothing to draft
    weak = DraftTree([5], [-1], score=0.3, match_len=1)
    assert not rule.prefer_suffix(1, weak, 4)
    rule.observe_times(draft_s=0.5, target_s=0.25)  # drafting costs twice the target pass...
    rule.observe_times(draft_s=0.5, target_s=0.25)
    rule.observe_times(draft_s=0.5, target_s=0.25)
    assert rule.prefer_suffix(1, weak, 4)  # ... so a weak free tree beats it
    rule.observe(2, used_suffix=True, predicted=2.0, drafted=3, accepted=0)  # over-confident tree
    assert rule.value(2, tree, 4)[0] < rule.value(1, tree, 4)[0]
    rule.release(2)
    assert 2 not in rule._requests


def test_cost_rule_prices_a_chain_from_its_per_position_acceptance():
    """A 4-chain accepted with 0.8 per position accepts 0, 1, 2, 3 or 4 drafts; the rule must
    recover 0.8 (accepted / (accepted + rejections)), not accepted / drafted (0.58 here, which
    prices the model's step at 1 + 1.2 tokens instead of 1 + 2.3 and hands steps to weaker
    suffix trees)."""
    rule = CostRule()
    pattern = (4, 4, 0, 1, 2, 4, 3, 4, 0, 1, 4, 4, 2)  # 33 accepted, 7 rejections in 13 steps
    tree = DraftTree([5], [-1], score=0.5, match_len=1)
    seen = []
    for accepted in pattern * 4:
        rule.observe(1, used_suffix=False, predicted=0.0, drafted=4, accepted=accepted)
        seen.append(rule.value(1, tree, 4)[1] - 1.0)  # the model's expected accepted drafts
    late = seen[len(pattern):]
    assert 1.7 < min(late) and sum(late) / len(late) == pytest.approx(chain_expectation(33 / 40, 4), abs=0.35)
    # The generator-wide value (a new request's) tracks the same rate, more slowly.
    assert rule.value(2, tree, 4)[1] - 1.0 == pytest.approx(chain_expectation(33 / 40, 4), abs=0.35)


def test_one_failed_model_step_does_not_price_the_model_out_for_the_request():
    """A request's model acceptance starts from the generator's: started from its own first
    step, one step that accepted nothing priced the model at 0 for that request, which then
    drafted from weak suffix trees or not at all for the rest (1.04x plain on one HumanEval
    prompt where the draft model alone made 2x)."""
    rule = CostRule()
    for _ in range(20):
        rule.observe(1, used_suffix=False, predicted=0.0, drafted=4, accepted=3)
    tree = DraftTree([5], [-1], score=0.2, match_len=1)
    generator = rule.expected(2, tree, 4)[1]
    rule.observe(2, used_suffix=False, predicted=0.0, drafted=4, accepted=0)
    assert 0.5 * generator < rule.expected(2, tree, 4)[1] < generator
    assert not rule.prefer_suffix(2, tree, 4)


def test_cost_rule_prices_the_models_catch_up_apart_from_drafting():
    """A model step after suffix-drafted ones first runs what the model never saw (on a 2-core
    AMD machine one 600-token catch-up cost more than the suffix trees saved on the whole
    request). Its time is split off the drafting cost and priced per token, spread over the
    steps the request has left."""
    rule = CostRule()
    rule.observe_times(draft_s=0.1, target_s=0.2)  # drafting: half a target pass
    rule.observe_times(draft_s=6.1, target_s=0.2, unseen=600)  # + 30 passes for 600 tokens
    assert rule.draft_cost == pytest.approx(0.15)  # the catch-up did not raise it
    assert rule.catchup_cost == pytest.approx((6.1 / 0.2 - 0.15) / 600)
    weak = DraftTree([5], [-1], score=0.5, match_len=1)
    assert not rule.prefer_suffix(1, weak, 4)  # caught up: the model is worth its cost
    assert rule.prefer_suffix(1, weak, 4, lag=600, remaining=100)  # a whole chat to run first
    assert not rule.prefer_suffix(1, weak, 4, lag=600, remaining=100_000)  # repaid over a long request
    assert not rule.prefer_suffix(1, DraftTree([], [], 0.0, 0), 4, lag=600, remaining=100)


def test_bad_arguments(stories):
    with pytest.raises(TypeError, match="model"):
        SuffixHybrid(SuffixDecoding())
    with pytest.raises(TypeError, match="suffix"):
        SuffixHybrid(DraftModel.from_model(stories[1], num_speculative_tokens=2), suffix="no")
