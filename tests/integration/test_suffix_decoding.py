"""Suffix decoding through the real Generator: exact, fast on repeats, and bounded.

Greedy and seeded outputs equal plain decoding at batch > 1 and under preemption; a repeated
request is drafted almost entirely from the first one's output; each request's index is freed
when it ends and the global index stays within its bound. (Its distribution at T > 0:
tests/integration/test_lossless_engine.py, the ``suffix`` cases and their negative control.)
"""

from __future__ import annotations

import pytest

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.codec import load_tokenizer
from specdec.models.loading import load_model
from specdec.proposers import SuffixDecoding

PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play",
    "Tom had a big red ball. He liked to play with it every day. One day",
    "The sun was hot.",
    "Sue and her mom went to the park. They saw a big dog. The dog",
]
GREEDY = SamplingParams(max_new_tokens=60)
SEEDED = SamplingParams(max_new_tokens=60, temperature=0.8, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def stories(stories_path):
    target, _, _ = load_model(stories_path, dtype="float64")
    return target, load_tokenizer(stories_path)


def _pair(stories, cache: CacheConfig | None = None, **settings):
    target, tok = stories
    plain = Generator.from_components(target, tok, cache_config=cache)
    proposer = SuffixDecoding(num_speculative_tokens=12, **settings)
    return plain, Generator.from_components(target, tok, proposer=proposer, cache_config=cache,
                                            policy=FixedPolicy(12)), proposer  # fmt: skip


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_plain_decoding_batched_and_repeated(stories, params):
    plain, gen, proposer = _pair(stories)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    for _ in range(3):  # the later rounds draft from the earlier rounds' outputs
        assert [o.token_ids for o in gen.generate(PROMPTS, params)] == expected
    m = gen.metrics
    assert m.num_accepted > 0.5 * sum(len(t) for t in expected), m  # repeats are drafted
    assert proposer._requests == {}  # every request's index was freed


def test_a_repeated_request_takes_few_target_passes(stories):
    plain, gen, _ = _pair(stories)
    first = gen.generate(PROMPTS[1], GREEDY)
    second = gen.generate(PROMPTS[1], GREEDY)
    assert second.token_ids == first.token_ids == plain.generate(PROMPTS[1], GREEDY).token_ids
    # One prefill and a few verify steps of up to 12 drafts for 60 tokens.
    assert second.metrics.num_target_forwards <= 10 < first.metrics.num_target_forwards, (
        first.metrics.num_target_forwards, second.metrics.num_target_forwards)  # fmt: skip


def test_preemption_keeps_outputs(stories):
    cache = CacheConfig(page_size=4, num_pages=40, max_batch_size=4)
    plain, gen, proposer = _pair(stories, cache)
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for _ in range(2):
        assert [o.token_ids for o in gen.generate(PROMPTS, GREEDY)] == expected
    assert gen.scheduler.num_preemptions > 0
    assert proposer._requests == {}
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_the_global_index_stays_within_its_bound(stories):
    _, gen, proposer = _pair(stories, max_global_nodes=3000)
    for i in range(4):
        gen.generate([p + " " * i for p in PROMPTS], SEEDED)
        assert proposer.global_trie.num_nodes <= 3000
    assert proposer.global_trie.num_nodes > 500  # pruned, not emptied


def test_chains_and_no_global_index_are_exact_too(stories):
    plain, gen, proposer = _pair(stories, tree=False, max_global_nodes=0)
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in gen.generate(PROMPTS, GREEDY)] == expected
    assert proposer.global_trie.num_nodes == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(max_depth=0), "max_depth"),
        (dict(min_token_prob=1.0), "min_token_prob"),
        (dict(spec_factor=0.0), "spec_factor"),
        (dict(tree="yes"), "tree"),
    ],
)
def test_bad_settings_name_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SuffixDecoding(**kwargs)
