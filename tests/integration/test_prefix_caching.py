"""Automatic prefix caching through the real Generator: outputs unchanged, prefixes reused.

For every proposer family (none, draft model, MTP head, EAGLE tree, prompt lookup), prompts
that share a long prefix run with the cache on, one after another so later ones find earlier
ones' pages, and give exactly the tokens a cache-off generator gives (greedy and seeded), while
the cache reports hits. Then the edges: page pressure (eviction), preemption, cancellation,
salts, n > 1 samples, and every page free again at the end.
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch
from helpers import coin_rule, random_head

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.proposers import (
    DraftModel,
    EAGLETree,
    MTPHead,
    PromptLookup,
    SuffixDecoding,
    SuffixHybrid,
)
from specdec.proposers.hybrid import CostRule

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=11)


def _eagle_head(target, seed: int = 1) -> EagleHeadModel:
    torch.manual_seed(seed)
    head = EagleHeadModel(target, EagleHeadConfig.for_target(target.config, EagleKind.EAGLE1))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


def _proposer(name: str, target, draft):
    if name == "plain":
        return None
    if name == "draft":
        return DraftModel.from_model(draft, num_speculative_tokens=3)
    if name == "mtp":
        return MTPHead.from_model(random_head(target, 1), num_speculative_tokens=3)
    if name == "eagle":
        return EAGLETree.from_model(_eagle_head(target), None)
    if name == "hybrid":  # suffix trees or the draft model, by coin flips: partial pages too
        return SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=3),
                            SuffixDecoding(num_speculative_tokens=3), rule=coin_rule(5))  # fmt: skip
    return PromptLookup(num_speculative_tokens=3)


def _shared_prefix_prompts(vocab: int, seed: int, prefix_len: int = 37) -> list[list[int]]:
    """A prefix (37 tokens: 9 full pages and one token) with suffixes of 0 to 9 tokens, the
    bare prefix twice, and one unrelated prompt."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(n)] for n in (3, 0, 9, 1, 0, 5)]
    return prompts + [[rng.randrange(vocab) for _ in range(20)]]


def _generator(target, proposer, *, caching: bool, num_pages: int | None = None, k: int = 3):
    config = CacheConfig(page_size=PAGE, num_pages=num_pages, max_batch_size=4, prefix_caching=caching)
    policy = None if proposer is None else FixedPolicy(k)
    return Generator.from_components(target, proposer=proposer, cache_config=config, policy=policy)


def _assert_all_free(gen: Generator) -> None:
    stats = gen.kv_stats()
    assert stats["num_used_pages"] == 0 and stats["num_sequences"] == 0, stats
    assert stats["num_free_pages"] == stats["num_total_pages"], stats


@pytest.mark.parametrize("name", ["plain", "draft", "mtp", "eagle", "lookup", "hybrid"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cached_prefixes_leave_outputs_unchanged(tiny_pair, name, params):
    target, draft = tiny_pair
    prompts = _shared_prefix_prompts(target.config.vocab_size, seed=3)
    reference = _generator(target, _proposer(name, target, draft), caching=False).generate(prompts, params)
    gen = _generator(target, _proposer(name, target, draft), caching=True)
    # One at a time: each prompt can find the pages of the ones before it.
    outs = [gen.generate(p, params) for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    stats = gen.kv_stats()
    # The prefix's 9 pages are computed once, found by the five later prompts that share them
    # (a draft model keys pages once it has drafted over them: still every later prompt).
    assert stats["prefix_cache_hit_tokens"] >= 5 * 9 * PAGE, stats
    _assert_all_free(gen)
    # And batched: prompts admitted together share what is cached by then.
    again = gen.generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]
    _assert_all_free(gen)


def _prompt_kv(gen: Generator, prompt: list[int]) -> list[torch.Tensor]:
    """Every pool's K/V of the prompt's slots, after its prefill and one more step (a draft
    model catches up on the prompt when it first drafts): ``[L, 2, len(prompt), Hkv, D]``."""
    handle = gen.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    gen.step()
    gen.step()
    slots = torch.tensor(gen.kv.slot_ids(handle.request_id, range(len(prompt))))
    kv = [pool.cache.flatten(2, 3)[:, :, slots].clone() for pool in gen.kv.pools.values()]
    handle.result()
    return kv


def _kv_after_warmup(target, proposer, prompts, *, caching: bool) -> list[torch.Tensor]:
    gen = _generator(target, proposer, caching=caching)
    gen.generate(prompts[0], GREEDY)  # with the cache on, prompts[1] finds its first pages
    kv = _prompt_kv(gen, prompts[1])
    assert not caching or gen.kv_stats()["prefix_cache_hit_tokens"] > 0
    return kv


@pytest.mark.parametrize("name", ["draft", "mtp", "eagle"])
def test_cached_pages_hold_every_pools_kv(tiny_pair, name):
    """Outputs cannot show a proposer's KV is wrong (verification hides it); the pools can:
    a prompt prefilled on cached pages has, in every pool (target and proposer), the K/V of a
    prompt prefilled from scratch. Negative control: a head whose pages are reused without
    matching the token after each slot (lookahead 0) differs, because the prompts part right
    after a page (36 tokens) and the last shared page's head row pairs with that token."""
    target, draft = tiny_pair
    prompts = _shared_prefix_prompts(target.config.vocab_size, seed=12, prefix_len=36)[::2]  # 39, 45
    assert prompts[0][36] != prompts[1][36]
    expected = _kv_after_warmup(target, _proposer(name, target, draft), prompts, caching=False)
    cached = _kv_after_warmup(target, _proposer(name, target, draft), prompts, caching=True)
    assert len(cached) == len(expected) == 2
    for got, want in zip(cached, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if name != "draft":
        broken = _proposer(name, target, draft)
        broken.kv_lookahead = 0
        cached = _kv_after_warmup(target, broken, prompts, caching=True)
        torch.testing.assert_close(cached[0], expected[0], rtol=0, atol=1e-10)  # the target's
        assert not torch.allclose(cached[1], expected[1], rtol=0, atol=1e-6)  # the head's


@attrs.define
class _SwitchRule(CostRule):
    """A SuffixHybrid rule told which side drafts: ``suffix`` True drafts from the suffix
    tree (nothing when it is empty: a plain step), so the draft model never runs."""

    suffix: bool = True

    def prefer_suffix(self, seq_id, tree, k, lag=0, remaining=None) -> bool:
        return self.suffix


def test_a_draft_model_left_behind_still_reuses_the_targets_pages(tiny_pair):
    """A request its suffix trees drafted ends with the draft model never run: its pages are
    final in the target's pool only. A later prompt sharing them skips the target's prefill
    there (pages marked partial, copied for it), and when the draft model drafts it catches up
    over them: every pool then holds the K/V of a prompt prefilled from scratch. Without
    partial pages the draft model's pool kept the hit at zero."""
    target, draft = tiny_pair
    prompts = _shared_prefix_prompts(target.config.vocab_size, seed=12, prefix_len=36)[::2]

    def hybrid(rule):
        return SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=3),
                            SuffixDecoding(num_speculative_tokens=3), rule=rule)  # fmt: skip

    expected = _kv_after_warmup(target, hybrid(_SwitchRule(suffix=False)), prompts, caching=False)
    rule = _SwitchRule(suffix=True)
    gen = _generator(target, hybrid(rule), caching=True)
    first = gen.generate(prompts[0], GREEDY)
    assert gen.proposer.num_model_steps == 0 and gen.kv_stats()["prefix_cache_partial_pages"] == (
        len(prompts[0]) + GREEDY.max_new_tokens - 1) // PAGE  # every full page the target computed
    rule.suffix = False  # the draft model drafts from now on: it catches up over the copies
    cached = _prompt_kv(gen, prompts[1])
    assert gen.kv_stats()["prefix_cache_hit_tokens"] == 9 * PAGE and gen.proposer.num_model_steps > 0
    assert len(cached) == len(expected) == 2
    for got, want in zip(cached, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    plain = _generator(target, None, caching=False)
    assert first.token_ids == plain.generate(prompts[0], GREEDY).token_ids
    _assert_all_free(gen)


def test_a_cached_prompt_prefills_only_its_last_page(tiny_pair):
    """The second run of a prompt computes only what is past its cached full pages."""
    target, _ = tiny_pair
    gen = _generator(target, None, caching=True)
    prompt = _shared_prefix_prompts(target.config.vocab_size, seed=4)[1]  # 37 tokens
    rows: list[int] = []
    forward = target.forward

    def counting(layout, *args, **kwargs):
        rows.append(layout.num_tokens)
        return forward(layout, *args, **kwargs)

    target.forward = counting
    try:
        first = gen.generate(prompt, GREEDY)
        prefill_first = rows[0]
        rows.clear()
        second = gen.generate(prompt, GREEDY)
    finally:
        del target.forward
    assert first.token_ids == second.token_ids
    assert prefill_first == 37 and rows[0] == 37 - 9 * PAGE, rows[:3]


def test_eviction_under_page_pressure_keeps_outputs(tiny_pair):
    """A pool too small to keep every prefix: old pages are evicted (least recently used
    first), requests still fit, and outputs match the cache-off generator."""
    target, draft = tiny_pair
    rng = random.Random(5)
    vocab = target.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(10, 30))] for _ in range(12)]
    prompts += prompts[:3]  # early prompts again, after eviction took (some of) their pages
    reference = _generator(target, None, caching=False, num_pages=40).generate(prompts, GREEDY)
    gen = _generator(target, DraftModel.from_model(draft, num_speculative_tokens=3), caching=True, num_pages=40)
    outs = [gen.generate(p, GREEDY) for p in prompts]
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    stats = gen.kv_stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["prefix_cache_pages"] <= 40, stats
    _assert_all_free(gen)


def test_preemption_with_cached_prefixes(tiny_pair):
    """Too few pages for the batch: requests are preempted and resumed on cached pages; the
    output equals the cache-off generator's and no page leaks."""
    target, draft = tiny_pair
    prompts = _shared_prefix_prompts(target.config.vocab_size, seed=6)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reference = _generator(target, None, caching=False).generate(prompts, params)
    gen = _generator(target, MTPHead.from_model(random_head(target, 1), num_speculative_tokens=3),
                     caching=True, num_pages=44)  # fmt: skip
    outs = gen.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert gen.scheduler.num_preemptions > 0
    _assert_all_free(gen)


def test_cancelled_request_frees_its_pages_and_leaves_cache_sound(tiny_pair):
    target, draft = tiny_pair
    prompts = _shared_prefix_prompts(target.config.vocab_size, seed=7)
    reference = _generator(target, None, caching=False).generate(prompts[:2], GREEDY)
    gen = _generator(target, DraftModel.from_model(draft, num_speculative_tokens=3), caching=True)
    handle = gen.submit(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        gen.step()
    assert handle.cancel()
    _assert_all_free(gen)
    outs = gen.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert gen.kv_stats()["prefix_cache_hit_tokens"] > 0


def test_salts_keep_prefixes_apart(tiny_pair):
    """Two salts never share a page; the same salt does."""
    target, _ = tiny_pair
    prompt = _shared_prefix_prompts(target.config.vocab_size, seed=8)[1]
    gen = _generator(target, None, caching=True)
    alice = SamplingParams(max_new_tokens=4, ignore_eos=True, cache_salt="alice")
    bob = SamplingParams(max_new_tokens=4, ignore_eos=True, cache_salt="bob")
    pages: dict[str, set[int]] = {}
    for who, params in (("alice", alice), ("bob", bob)):
        handle = gen.submit(prompt, params)
        gen.step()  # admitted and prefilled
        pages[who] = set(gen.kv.page_table(handle.request_id))
        handle.result()
    assert not pages["alice"] & pages["bob"]
    assert gen.kv_stats()["prefix_cache_hit_tokens"] == 0
    again = gen.submit(prompt, alice)
    gen.step()
    assert set(gen.kv.page_table(again.request_id)) & pages["alice"]
    again.result()
    assert gen.kv_stats()["prefix_cache_hit_tokens"] == 9 * PAGE
    with pytest.raises(ValueError, match="cache_salt must be None or a non-empty string"):
        SamplingParams(cache_salt="")


def test_prompt_logprobs_requests_compute_every_row(tiny_pair):
    """Prompt logprobs need every prompt row: such a request does not start on cached pages,
    and its values equal those of a cache-off generator."""
    target, _ = tiny_pair
    prompt = _shared_prefix_prompts(target.config.vocab_size, seed=9)[1]
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=2)
    reference = _generator(target, None, caching=False).generate(prompt, params)
    gen = _generator(target, None, caching=True)
    gen.generate(prompt, GREEDY)
    out = gen.generate(prompt, params)
    assert out.token_ids == reference.token_ids
    assert len(out.prompt_logprobs) == len(reference.prompt_logprobs)
    for a, b in zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9)


def test_caching_off_shares_nothing(tiny_pair):
    target, _ = tiny_pair
    gen = _generator(target, None, caching=False)
    prompt = _shared_prefix_prompts(target.config.vocab_size, seed=10)[1]
    gen.generate([prompt, prompt], GREEDY)
    assert "prefix_cache_hit_tokens" not in gen.kv_stats()
    _assert_all_free(gen)


@pytest.mark.parametrize("name", ["plain", "mtp"])
def test_samples_of_one_prompt_share_its_pages(tiny_pair, name):
    """n > 1: samples 1.. are admitted after sample 0's prefill and start on its cached prompt
    pages; every sample equals the one a cache-off generator draws."""
    target, draft = tiny_pair
    prompt = _shared_prefix_prompts(target.config.vocab_size, seed=13)[1]  # 37 tokens
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=5, n=4)
    reference = _generator(target, _proposer(name, target, draft), caching=False).generate(prompt, params)
    gen = _generator(target, _proposer(name, target, draft), caching=True)
    samples = gen.generate(prompt, params)
    assert [s.token_ids for s in samples] == [s.token_ids for s in reference]
    assert len({tuple(s.token_ids) for s in samples}) > 1  # really different samples
    assert gen.kv_stats()["prefix_cache_hit_tokens"] == 3 * 9 * PAGE
    _assert_all_free(gen)
