"""A seeded sampled request gives the same tokens whatever happens around it.

Alone, beside 1-7 different companions (greedy, unseeded and other seeded requests of other
lengths), in reversed arrival order, joining a batch that is already running (mixed steps),
and under forced preemption, for every proposer and with a policy that picks a random k for
every request at every step: the tokens are always those of plain decoding with that seed
(specdec.noise). A verifier that reads the noise one position late is caught (negative
control).
"""

from __future__ import annotations

import pytest
from helpers import ScriptedPolicy, perturbed, random_head, random_prompts

from specdec import CacheConfig, Generator, SamplingParams
from specdec.proposers import DraftModel, MTPHead, PromptLookup
from specdec.verify import chain

K = 3
SEEDED = {
    "t1.0": SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True),
    "t0.7-top-p": SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=12, ignore_eos=True),
}
PROPOSERS = ("plain", "draft", "mtp", "lookup")


@pytest.fixture(scope="module")
def models(tiny_pair):
    target, _ = tiny_pair
    # A draft close to the target, so that seeded drafts are accepted often.
    return target, perturbed(target, 0.1, seed=5)


@pytest.fixture(scope="module")
def prompt(models):
    base = random_prompts(models[0].config.vocab_size, 1, seed=21, max_len=12)[0]
    return base + base  # repeated, so prompt lookup finds something


def _companions(vocab: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(vocab, n, seed=100 + n)
    kinds = [
        SamplingParams(max_new_tokens=7, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=1.0, ignore_eos=True),  # unseeded
        SamplingParams(max_new_tokens=13, temperature=0.8, top_k=5, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=19, temperature=1.2, seed=11, ignore_eos=True),  # same seed
    ]
    return prompts, [kinds[i % len(kinds)] for i in range(n)]


def _generator(models, proposer: str, seed: int, **cache) -> Generator:
    target, draft = models
    cache_config = CacheConfig(**cache) if cache else None
    if proposer == "plain":
        return Generator.from_components(target, cache_config=cache_config)
    made = {
        "draft": lambda: DraftModel.from_model(draft, num_speculative_tokens=K),
        "mtp": lambda: MTPHead.from_model(random_head(target, 4), num_speculative_tokens=K),
        "lookup": lambda: PromptLookup(num_speculative_tokens=K),
    }[proposer]()
    return Generator.from_components(
        target, proposer=made, cache_config=cache_config, policy=ScriptedPolicy(seed, K)
    )


@pytest.fixture(scope="module")
def alone(models, prompt):
    plain = Generator.from_components(models[0])
    return {name: plain.generate(prompt, p).token_ids for name, p in SEEDED.items()}


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("name", list(SEEDED))
def test_seeded_output_is_the_same_in_any_company(models, prompt, alone, proposer, name):
    params, expected = SEEDED[name], alone[name]
    gen = _generator(models, proposer, seed=1)
    assert gen.generate(prompt, params).token_ids == expected
    vocab = models[0].config.vocab_size
    for n in range(1, 8):
        others, other_params = _companions(vocab, n)
        outs = gen.generate([prompt, *others], [params, *other_params])
        assert outs[0].token_ids == expected, f"{n} companions"
        outs = gen.generate([*others, prompt], [*other_params, params])
        assert outs[-1].token_ids == expected, f"{n} companions, arriving first"
    if proposer != "plain":
        assert gen.metrics.num_drafted > 0 and gen.metrics.num_accepted > 0


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_seeded_output_survives_late_arrivals_and_preemption(models, prompt, alone, proposer):
    params, expected = SEEDED["t1.0"], alone["t1.0"]
    # 14 pages of 4 slots: the batch below does not fit, so the newest requests are preempted
    # and recomputed, and companions join a running batch in mixed steps.
    gen = _generator(models, proposer, seed=2, page_size=4, num_pages=14, max_batch_size=8)
    others, other_params = _companions(models[0].config.vocab_size, 5)
    handles = [gen.submit(others[0], other_params[0])]
    gen.step()
    ours = gen.submit(prompt, params)
    for _ in range(2):
        gen.step()
    handles += [gen.submit(p, sp) for p, sp in zip(others[1:], other_params[1:])]
    assert ours.result().token_ids == expected
    for h in handles:
        h.result()
    assert gen.scheduler.num_preemptions > 0
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


def test_a_verifier_reading_the_noise_one_position_late_is_caught(models, prompt, alone, monkeypatch):
    """Negative control: still a valid sample of the target (the noise is fresh at every
    position) but not the seed's plain output, which the tests above compare against."""
    real = chain.coupled_verify

    def late(target_probs, draft_token_ids, num_draft_tokens, noises):
        return real(target_probs, draft_token_ids, num_draft_tokens, [n.shifted(1) for n in noises])

    monkeypatch.setattr(chain, "coupled_verify", late)
    gen = _generator(models, "draft", seed=1)
    assert gen.generate(prompt, SEEDED["t1.0"]).token_ids != alone["t1.0"]
