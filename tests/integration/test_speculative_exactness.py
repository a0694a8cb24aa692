"""Speculative greedy output equals plain greedy output, token for token, for every proposer.

These tests pin k with ``FixedPolicy`` (they count drafts and accepted lengths at a known k);
tests/integration/test_adaptive_policy.py covers the default adaptive policy."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers import perturbed, random_prompts, record_drafts

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.models.loading import load_model
from specdec.proposers import DraftModel, PromptLookup, TokenListProposer


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    return random_prompts(vocab, n, seed)


GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_draft_model_greedy_exact_tiny_float64(tiny_pair, k):
    target, draft = tiny_pair
    prompts = _prompts(target.config.vocab_size, 5, seed=k)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = Generator.from_components(
        target, proposer=DraftModel.from_model(draft, num_speculative_tokens=k), policy=FixedPolicy(k)
    )
    spec = gen.generate(prompts, GREEDY)  # one batch of mixed lengths
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = gen.metrics
    assert 0 < m.num_accepted < m.num_drafted  # the draft really disagrees sometimes
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


@pytest.mark.parametrize("threshold", [0.15, 0.3])
def test_draft_model_with_a_confidence_threshold_is_greedy_exact(tiny_pair, threshold):
    """Chains that end where the draft hesitates (k = 6 a ceiling), in a batch whose chains
    end at different steps: the same output as plain decoding, and chains of several lengths."""
    target, draft = tiny_pair
    prompts = _prompts(target.config.vocab_size, 5, seed=7)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    proposer = DraftModel.from_model(draft, num_speculative_tokens=6, confidence_threshold=threshold)
    gen = Generator.from_components(target, proposer=proposer, policy=FixedPolicy(6))
    spec = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    drafted = gen.metrics.drafted_per_position
    assert drafted[0] > drafted[-1] and len(set(drafted)) > 2, drafted  # chains of many lengths
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


def test_confidence_threshold_is_checked():
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\), got 1.0"):
        DraftModel.from_pretrained("no-such-draft", confidence_threshold=1.0)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_prompt_lookup_greedy_exact_tiny_float64(tiny_pair, k):
    target, _ = tiny_pair
    base = _prompts(target.config.vocab_size, 4, seed=10 + k)
    prompts = [p + p + p for p in base]  # repetitive prompts give lookup something to find
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = Generator.from_components(target, proposer=PromptLookup(num_speculative_tokens=k), policy=FixedPolicy(k))
    spec = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert gen.metrics.num_drafted > 0


def test_draft_model_greedy_exact_stories_float32(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    draft = perturbed(target, 0.15, seed=1)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "Mom said"]
    plain_gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = plain_gen.generate(prompts, params)
    for k in (2, 4, 6):
        gen = Generator.from_components(
            target, plain_gen.tokenizer, proposer=DraftModel.from_model(draft, num_speculative_tokens=k),
            policy=FixedPolicy(k),
        )
        spec = gen.generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert 0.1 < gen.metrics.acceptance_rate < 1.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_identical_draft_is_fully_accepted(tiny_pair, temperature):
    target, _ = tiny_pair
    k = 4
    gen = Generator.from_components(
        target, proposer=DraftModel.from_model(target, num_speculative_tokens=k), policy=FixedPolicy(k)
    )
    # 1 token from prefill, then whole steps of k + 1: no step is cut by max_new_tokens.
    params = [
        SamplingParams(max_new_tokens=1 + 6 * (k + 1), temperature=temperature, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    gen.generate(_prompts(target.config.vocab_size, 3, seed=0), params)
    assert gen.metrics.acceptance_rate == 1.0
    assert gen.metrics.mean_accepted_length == k + 1


def test_batch_matches_each_sequence_alone(tiny_pair):
    target, draft = tiny_pair
    prompts = _prompts(target.config.vocab_size, 6, seed=3)
    make = lambda: Generator.from_components(target, proposer=DraftModel.from_model(draft, num_speculative_tokens=3), policy=FixedPolicy(3))  # noqa: E731
    batched = make().generate(prompts, GREEDY)
    for p, out in zip(prompts, batched):
        assert make().generate(p, GREEDY).token_ids == out.token_ids


def test_greedy_requests_exact_inside_a_sampled_batch(tiny_pair):
    target, draft = tiny_pair
    prompts = _prompts(target.config.vocab_size, 6, seed=4)
    params = [
        GREEDY if i % 2 == 0 else SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(6)
    ]
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = Generator.from_components(
        target, proposer=DraftModel.from_model(draft, num_speculative_tokens=4), policy=FixedPolicy(4)
    )
    mixed = gen.generate(prompts, params)
    for i in range(0, 6, 2):
        assert mixed[i].token_ids == plain[i].token_ids
    # The sampled rows are the same seeded requests' plain output (a seed pins the tokens).
    plain_sampled = Generator.from_components(target).generate(prompts[1::2], params[1::2])
    assert [o.token_ids for o in mixed[1::2]] == [o.token_ids for o in plain_sampled]
    assert gen.metrics.num_accepted > 0


class EveryOtherRepeat(TokenListProposer):
    """A user-defined proposer living in the test module: guesses the last token repeats."""

    def draft(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [token_ids[-1]] * k if len(token_ids) % 2 else []


def test_user_defined_proposer_plugs_in(tiny_pair):
    target, _ = tiny_pair
    prompts = _prompts(target.config.vocab_size, 3, seed=6)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    gen = Generator.from_components(target, proposer=EveryOtherRepeat(num_speculative_tokens=3), policy=FixedPolicy(3))
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [o.token_ids for o in plain]
    assert gen.metrics.num_drafted > 0


def test_logprobs_identical_with_and_without_speculation(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    draft = perturbed(target, 0.15, seed=2)
    params = SamplingParams(max_new_tokens=40, logprobs=3, ignore_eos=True)
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    spec = Generator.from_components(
        target, plain.tokenizer, proposer=DraftModel.from_model(draft, num_speculative_tokens=4),
        policy=FixedPolicy(4),
    )
    a = plain.generate("Once upon a time", params)
    b = spec.generate("Once upon a time", params)
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == 40
    # float32 logits of a 5-row verify pass and a 1-row decode pass differ in the last bits
    # (GEMM blocking), ~1e-5 on logprobs of magnitude ~10.
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-4


def test_stop_string_inside_accepted_draft(stories_path):
    target, _, _ = load_model(stories_path, dtype="float32")
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    free = plain.generate("Once upon a time", SamplingParams(max_new_tokens=60, ignore_eos=True))
    stop = free.text[25:31]  # a string the plain output reaches mid-way
    params = SamplingParams(max_new_tokens=60, stop=stop, ignore_eos=True)
    # An identical draft accepts everything, so the stop string lands inside an accepted draft.
    spec = Generator.from_components(
        target, plain.tokenizer, proposer=DraftModel.from_model(target, num_speculative_tokens=6),
        policy=FixedPolicy(6),
        cache_config=CacheConfig(page_size=4),
    )
    a = plain.generate("Once upon a time", params)
    b = spec.generate("Once upon a time", params)
    assert a.text == b.text == free.text[: free.text.find(stop)]
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason == "stop"
    assert spec.metrics.num_accepted > 0
    assert spec.kv_stats()["num_free_pages"] == spec.kv_stats()["num_total_pages"]


@pytest.mark.usefixtures("kernel")
def test_bf16_packed_speculation_is_exact(stories_path):
    """With packed bf16 weights, a verify row computes exactly what decoding computes."""
    target, _, _ = load_model(stories_path, dtype="bfloat16", pack=True)
    draft, _, _ = load_model(stories_path, dtype="bfloat16", pack=False)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn_like(p))
    from specdec.models.packed import pack_linears

    pack_linears(draft)
    prompts = [[1, 403, 407, 261, 378], [1, 365, 1100 % 512, 263]]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = Generator.from_components(target).generate(prompts, params)
    gen = Generator.from_components(
        target, proposer=DraftModel.from_model(draft, num_speculative_tokens=4), policy=FixedPolicy(4)
    )
    spec = gen.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert gen.metrics.num_accepted > 0


K_STOP = 4
PROMPT_STOP = [1, 403, 407, 261, 378]


def _stop_inside_a_draft(tokens: Sequence[int]) -> int:
    """An output index that a verify step with all K_STOP drafts accepted emits as a draft,
    neither the first nor the last of them (so neither at the draft's start nor its end),
    holding a token that does not appear before it."""
    # Output 0 comes from the prefill; each verify step then emits K_STOP drafts + 1 bonus.
    for i, tok in enumerate(tokens):
        offset = (i - 1) % (K_STOP + 1)  # 0 .. K_STOP - 1: a draft, K_STOP: the bonus
        if i >= 1 and 1 <= offset <= K_STOP - 2 and tok not in tokens[:i]:
            return i
    raise AssertionError("no suitable stop position")


@pytest.mark.parametrize("stop", ["eos", "stop_token_id"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_stop_token_inside_an_accepted_draft(stories_path, stop, mode):
    """A draft identical to the target is accepted whole (greedy: same argmax; seeded: same
    noise), so the stop token lands inside an accepted draft, not at its end: the request
    must end right there, exactly as plain decoding does, with nothing past it kept."""
    target, _, _ = load_model(stories_path, dtype="float32")
    sampling = dict(temperature=0.9, top_p=0.95, seed=5) if mode == "seeded" else {}
    free = SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling)
    tokens = Generator.from_components(target).generate(PROMPT_STOP, free).token_ids
    i = _stop_inside_a_draft(tokens)
    stop_id = tokens[i]
    if stop == "eos":
        params, eos = SamplingParams(max_new_tokens=40, **sampling), [stop_id]
    else:
        params, eos = SamplingParams(max_new_tokens=40, stop_token_ids=[stop_id], **sampling), None
    plain = Generator.from_components(target, eos_token_ids=eos).generate(PROMPT_STOP, params)
    gen = Generator.from_components(
        target,
        eos_token_ids=eos,
        proposer=DraftModel.from_model(target, num_speculative_tokens=K_STOP),
        policy=FixedPolicy(K_STOP),
    )
    handle = gen.submit(PROMPT_STOP, params)
    steps = []
    while not handle.done:
        steps.append(gen.step())
    out = handle.result()
    assert out.token_ids == plain.token_ids == tokens[: i + 1]
    assert out.finish_reason == plain.finish_reason == "stop"
    last = steps[-1]
    # The last step accepted every draft but kept only the tokens up to the stop.
    assert last.speculative and last.num_drafted == (K_STOP,) and last.num_accepted == (K_STOP,)
    assert 1 < len(last.new_token_ids[0]) < K_STOP
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_int8_draft_changes_proposals_not_output(stories_path, temperature):
    """An int8 draft (a perturbed copy of the target, so that it is often wrong) leaves the
    output the plain target's: greedy token for token, and with a seed the same sample."""
    from specdec.models.quantized import quantize_linears

    target, _, _ = load_model(stories_path, dtype="bfloat16")
    draft, _, _ = load_model(stories_path, dtype="bfloat16", pack=False)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn_like(p))
    quantize_linears(draft)
    prompts = [[1, 403, 407, 261, 378], [1, 365, 263]]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=temperature, seed=11)
    plain = Generator.from_components(target).generate(prompts, params)
    gen = Generator.from_components(
        target, proposer=DraftModel.from_model(draft, num_speculative_tokens=4), policy=FixedPolicy(4)
    )
    spec = gen.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted


@pytest.mark.usefixtures("kernel")
def test_int8_draft_from_pretrained_is_quantized(stories_path):
    from specdec.models.quantized import Int8Linear

    bf16 = DraftModel.from_pretrained(stories_path)
    int8 = DraftModel.from_pretrained(stories_path, quantization="int8")
    layers = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * int8.model.config.num_layers + 1  # qkv, o, gate_up, down; head
    prompt = [[1, 403, 407, 261, 378]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    target, _, _ = load_model(stories_path, dtype="bfloat16")
    outs = [
        Generator.from_components(target, proposer=d, policy=FixedPolicy(4)).generate(prompt, params)[0]
        for d in (bf16, int8)
    ]
    assert outs[0].token_ids == outs[1].token_ids


def test_int8_draft_rejects_bad_quantization(stories_path):
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4', got 'int4'"):
        DraftModel.from_pretrained(stories_path, quantization="int4")


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_target_speculation_equals_its_own_plain_output(stories_path, quantization):
    """A quantized target is a model of its own; speculation over it (a q4 draft, a batch of
    prompts, verify passes of 1..5 rows) reproduces its plain greedy output token for token."""
    from specdec.models.quantized import Int8Linear, Q4Linear

    cls = {"int8": Int8Linear, "q4": Q4Linear}[quantization]
    plain_gen = Generator.from_pretrained(stories_path, quantization=quantization)
    layers = [m for m in plain_gen.target.modules() if isinstance(m, cls)]
    assert len(layers) == 4 * plain_gen.target.config.num_layers + 1  # qkv, o, gate_up, down; head
    prompts = [[1, 403, 407, 261, 378], [1, 365, 263], [1, 13, 29, 77, 5, 6]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = plain_gen.generate(prompts, params)
    draft = DraftModel.from_pretrained(stories_path, num_speculative_tokens=4, quantization="q4")
    gen = Generator.from_pretrained(
        stories_path, quantization=quantization, proposer=draft, policy=FixedPolicy(4)
    )
    spec = gen.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert gen.metrics.num_accepted > 0
    bf16 = Generator.from_pretrained(stories_path).generate(prompts, params)
    assert [o.token_ids for o in bf16] != [o.token_ids for o in plain] or quantization == "int8"


@pytest.mark.usefixtures("kernel")
def test_quantized_model_is_cached_and_reloads_identically(stories_path):
    from specdec.models.loading import safetensors_files
    from specdec.models.packed_cache import packed_cache_file

    first, _, _ = load_model(stories_path, quantization="q4")
    cache = packed_cache_file(safetensors_files(stories_path), "q4")
    assert cache.is_file() and cache != packed_cache_file(safetensors_files(stories_path), "int8")
    second, _, _ = load_model(stories_path, quantization="q4")
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The input embedding (read one row per token: the LM head has its own q4 weights) stays a
    # memory map of the cache file, on the first load (after writing it) and on the next.
    for model in (first, second):
        assert _mapped_from(model.embed_tokens.weight, cache)
        assert not _mapped_from(model.layers[0].mlp.down_proj.packed, cache)  # in the arena


def _mapped_from(t: torch.Tensor, file) -> bool:
    """Whether ``t``'s memory lies in a mapping of ``file`` (per /proc/self/maps)."""
    start = t.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(file.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= start < hi:
                return True
    return False


def test_quantization_is_checked_before_loading(tmp_path):
    """Bad ``quantization`` is refused by name before any file is read (the path does not exist)."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4', got 'fp4'"):
        Generator.from_pretrained(missing, quantization="fp4")
    with pytest.raises(ValueError, match="quantization='q4' runs on the CPU only"):
        Generator.from_pretrained(missing, quantization="q4", device="cuda")
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4'"):
        DraftModel.from_pretrained(missing, quantization="int4")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_vocabulary_changes_proposals_not_output(tiny_pair, temperature):
    """A draft model that drafts from part of the vocabulary: the plain output (greedy, and a
    seeded sample), drafts from that part only, and a cheaper LM head."""
    target, draft = tiny_pair
    vocab = target.config.vocab_size
    subset = list(range(0, vocab, 2))  # half the tokens
    prompts = _prompts(vocab, 4, seed=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=temperature, seed=5)
    plain = Generator.from_components(target).generate(prompts, params)
    proposer = DraftModel.from_model(draft, num_speculative_tokens=3, draft_vocab=subset)
    drafted = record_drafts(proposer)
    gen = Generator.from_components(target, proposer=proposer, policy=FixedPolicy(3))
    assert [o.token_ids for o in gen.generate(prompts, params)] == [o.token_ids for o in plain]
    assert drafted and set(drafted) <= set(subset)
    assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted
    assert proposer.head.linear.weight.shape[0] == len(subset)


def test_greedy_drafts_from_the_vocabularys_columns_equal_those_from_full_rows(tiny_pair, monkeypatch):
    """A greedy draft with a draft vocabulary argmaxes (and measures confidence) over that
    vocabulary's columns only; it drafts what the full rows (-inf elsewhere) draft, chain ends
    included, also where two of its tokens tie (the lower id wins on both paths)."""
    target, draft = tiny_pair
    vocab = target.config.vocab_size
    subset = list(range(1, vocab, 3))
    with torch.no_grad():  # ties: two draft-vocabulary tokens with the same LM-head row
        draft.lm_head.weight[subset[9]] = draft.lm_head.weight[subset[2]]
    prompts = _prompts(vocab, 4, seed=11)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)

    def run():
        proposer = DraftModel.from_model(draft, num_speculative_tokens=4, confidence_threshold=0.3, draft_vocab=subset)
        drafted, ends = record_drafts(proposer), []
        original = proposer.propose
        proposer.propose = lambda ctx, original=original: _keep_ends(original(ctx), ends)
        gen = Generator.from_components(target, proposer=proposer, policy=FixedPolicy(4))
        out = [o.token_ids for o in gen.generate(prompts, params)]
        return out, drafted, ends

    fast = run()
    full_rows = DraftModel._logits
    monkeypatch.setattr(DraftModel, "_logits", lambda self, layout, ctx, greedy: full_rows(self, layout, ctx, greedy=False))
    slow = run()
    assert fast == slow
    assert subset[2] in fast[1] and subset[9] not in fast[1]  # a tie was drafted, lower id
    assert any(n < 4 for step in fast[2] for n in step)  # some chains ended by confidence


def _keep_ends(proposal, ends: list):
    ends.append(proposal.num_draft_tokens)
    return proposal


def test_draft_vocabulary_is_checked_before_loading():
    with pytest.raises(ValueError, match="draft_vocab must not repeat a token id"):
        DraftModel.from_pretrained("no-such-draft", draft_vocab=[1, 1])
    with pytest.raises(TypeError, match="draft_vocab must be a 1-D sequence of token ids"):
        DraftModel.from_pretrained("no-such-draft", draft_vocab=3)


def test_draft_vocabulary_outside_the_models_vocabulary_is_named(tiny_pair):
    _, draft = tiny_pair
    vocab = draft.config.vocab_size
    with pytest.raises(ValueError, match=rf"draft_vocab must hold token ids in \[0, {vocab}\)"):
        DraftModel.from_model(draft, draft_vocab=[0, vocab])
