"""Bad input fails early and cleanly through the public API.

The rule (DESIGN.md 6.11): bad input gets a ValueError/TypeError/FileNotFoundError naming the
argument or file and what is allowed, raised before any work starts, leaving no KV page
allocated and no request queued; the generator keeps working afterwards. An error raised
inside a step (a misbehaving plug-in) must leave the same clean state behind.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil

import attrs
import numpy as np
import pytest
import torch
from conftest import make_hf_model
from helpers import random_head, run_cli

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.config import MAX_SPECULATIVE_TOKENS
from specdec.models.loading import load_model
from specdec.proposers import DraftModel, MTPHead, PromptLookup, TokenListProposer
from specdec.request import RequestError
from specdec.types import DraftProposal, ProposalKind
from specdec.verify.chain import ChainVerifier

VOCAB = 101  # the tiny "llama" config of conftest
CONTEXT = 256
OK = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def target(tiny_dir):
    model, _, _ = load_model(tiny_dir, dtype="float64")
    return model


@pytest.fixture(scope="module")
def gen(tiny_dir):
    """One generator shared by every input case: each must leave it clean and working."""
    return Generator.from_pretrained(tiny_dir, dtype="float64")


@pytest.fixture(scope="module")
def reference(target):
    """Plain greedy output of the target for a few prompts: what a working generator gives."""
    return Generator.from_components(target).generate(PROMPTS, GREEDY)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def assert_clean(gen: Generator) -> None:
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert stats["num_sequences"] == 0
    assert not gen.scheduler.has_unfinished()


def assert_clean_and_working(gen: Generator) -> None:
    assert_clean(gen)
    out = gen.generate([1, 2, 3], OK)
    assert len(out.token_ids) == 4
    assert_clean(gen)


def assert_rejected_before_work(gen: Generator, call, error, match: str) -> None:
    """``call(gen)`` raises ``error`` matching ``match`` without a single forward pass."""
    forwards = gen.metrics.num_target_forwards
    with pytest.raises(error, match=match):
        call(gen)
    assert gen.metrics.num_target_forwards == forwards
    assert_clean_and_working(gen)


# --- prompts ---------------------------------------------------------------------------------

BAD_PROMPTS = {
    "empty-string": ("", ValueError, "prompt must not be empty"),
    "empty-token-list": ([], ValueError, "prompts must not be empty"),
    "empty-list-of-prompts": ([[]], ValueError, "prompt must not be empty"),
    "one-empty-in-batch": ([[1, 2], []], ValueError, "prompt must not be empty"),
    "longer-than-context": (
        [1] * CONTEXT,
        ValueError,
        rf"maximum sequence length is {CONTEXT} \(the model's context.*at most {CONTEXT - 1}",
    ),
    "token-id-past-vocab": ([1, VOCAB], ValueError, rf"prompt token ids must be in \[0, {VOCAB}\)"),
    "negative-token-id": ([-1, 2], ValueError, rf"prompt token ids must be in \[0, {VOCAB}\)"),
    "past-vocab-in-batch": ([[1], [2, VOCAB + 5]], ValueError, r"token ids must be in \[0, 101\)"),
    "strings-and-ints": (["a", 1], TypeError, "prompts must be a string, a list of token ids"),
    "strings-and-lists": (
        ["a", [1, 2]],
        TypeError,
        "prompts must be a string, a list of token ids",
    ),
    "bool-token": ([[1, True]], TypeError, "prompts must be a string, a list of token ids"),
    "float-tokens": ([1.0, 2.0], TypeError, "prompts must be a string, a list of token ids"),
    "float-array": (np.array([1.0, 2.0]), TypeError, "integer token ids, got 1-d float64"),
    "bool-tensor": (torch.tensor([True]), TypeError, "integer token ids, got 1-d torch.bool"),
    "3-d-array": (np.zeros((1, 1, 2), dtype=np.int64), TypeError, "1-d or 2-d integer"),
    "array-past-vocab": (np.array([1, VOCAB]), ValueError, r"token ids must be in \[0, 101\)"),
    "none": (None, TypeError, "prompts must be"),
    "int": (7, TypeError, "prompts must be"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_generate(gen, case):
    prompt, error, match = BAD_PROMPTS[case]
    assert_rejected_before_work(gen, lambda g: g.generate(prompt, OK), error, match)


@pytest.mark.parametrize(
    "case", [c for c in BAD_PROMPTS if "batch" not in c and "list-of" not in c]
)
def test_bad_prompt_stream_raises_at_the_call(gen, case):
    prompt, error, match = BAD_PROMPTS[case]
    # No next(): stream() validates when called, not when first iterated.
    assert_rejected_before_work(gen, lambda g: g.stream(prompt, OK), error, match)


def test_stream_takes_one_prompt(gen):
    assert_rejected_before_work(
        gen, lambda g: g.stream([[1, 2], [3]], OK), TypeError, r"stream\(\) takes one prompt"
    )


def test_text_prompt_without_tokenizer(gen):
    assert_rejected_before_work(gen, lambda g: g.generate("hello", OK), ValueError, "no tokenizer")


def test_empty_string_is_rejected_even_when_the_tokenizer_adds_bos(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    assert gen.encode("") != []  # stories260K encodes "" as [BOS]: still no prompt
    assert_rejected_before_work(
        gen, lambda g: g.generate("", OK), ValueError, "prompt must not be empty"
    )
    assert_rejected_before_work(
        gen, lambda g: g.generate(["Once", ""], OK), ValueError, "prompt must not be empty"
    )


def test_valid_edge_prompts_are_accepted(gen):
    out = gen.generate([0] * (CONTEXT - 1), SamplingParams(max_new_tokens=1))  # context - 1 tokens
    assert len(out.token_ids) == 1
    assert gen.generate(torch.tensor([VOCAB - 1, 0]), OK).prompt_token_ids == [VOCAB - 1, 0]
    assert_clean(gen)


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([4, 5, 6]),
        np.array([4, 5, 6], dtype=np.int32),
        [np.int64(4), np.int32(5), 6],
        torch.tensor([4, 5, 6], dtype=torch.int32),
    ],
    ids=["int64-array", "int32-array", "numpy-integers", "int32-tensor"],
)
def test_numpy_prompts_are_accepted_like_lists(gen, prompt):
    expected = gen.generate([4, 5, 6], OK).token_ids
    out = gen.generate(prompt, OK)
    assert out.prompt_token_ids == [4, 5, 6] and out.token_ids == expected
    assert gen.submit(prompt, OK).result().token_ids == expected
    assert len("".join(gen.stream(prompt, OK))) == 0  # no tokenizer: empty text, no error
    outs = gen.generate(np.array([[4, 5, 6], [4, 5, 6]]), OK)
    assert [o.token_ids for o in outs] == [expected, expected]
    outs = gen.generate([np.array([4, 5, 6]), [4, 5, 6]], OK)
    assert [o.token_ids for o in outs] == [expected, expected]
    assert_clean(gen)


# --- SamplingParams ----------------------------------------------------------------------------

BAD_PARAMS = [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=-3), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens="8"), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
    (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.1), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), ValueError, "top_p must be finite"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=5.0), TypeError, "top_k must be an int"),
    (dict(min_p=1.0), ValueError, r"min_p must be in \[0, 1\)"),
    (dict(min_p=-0.01), ValueError, r"min_p must be in \[0, 1\)"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(seed=2**64), ValueError, r"seed must be < 2\*\*64"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed="42"), TypeError, "seed must be an int"),
    (dict(stop=[""]), ValueError, "stop must hold non-empty strings"),
    (dict(stop=[3]), ValueError, "stop must hold non-empty strings"),
    (dict(stop_token_ids=[-2]), ValueError, "stop_token_ids must hold token ids >= 0"),
    (dict(logprobs=-1), ValueError, "logprobs must be >= 0"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be a bool, got int"),
    (dict(ignore_eos="no"), TypeError, "ignore_eos must be a bool, got str"),
    (dict(ignore_eos=None), TypeError, "ignore_eos must be a bool, got NoneType"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"), BAD_PARAMS, ids=[str(c[0]) for c in BAD_PARAMS]
)
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_stop_token_ids_past_the_vocabulary(gen):
    params = SamplingParams(max_new_tokens=4, stop_token_ids=[3, VOCAB])
    match = rf"stop_token_ids must be token ids in \[0, {VOCAB}\), got \[{VOCAB}\]"
    assert_rejected_before_work(gen, lambda g: g.generate([1, 2], params), ValueError, match)
    assert_rejected_before_work(gen, lambda g: g.submit([1, 2], params), ValueError, match)


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_tiny_temperature_samples_the_argmax(gen, temperature):
    """logits / T overflows for a tiny T: computed safely, it is the argmax (no tie here)."""
    greedy = gen.generate([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True)).token_ids
    for seed in (None, 3):
        params = SamplingParams(max_new_tokens=8, temperature=temperature, seed=seed, ignore_eos=True)
        assert gen.generate([1, 2, 3], params).token_ids == greedy
    assert_clean(gen)


def test_non_finite_probabilities_fail_only_their_request(target, monkeypatch):
    """A sampled request whose processed distribution is NaN fails with a RequestError; it is
    never given a made-up token, and the rest of its batch completes."""
    import specdec.sampling as sampling

    real = sampling.processed_probs

    def poisoned(logits, st):
        probs = real(logits, st)
        bad = torch.tensor([p.temperature in (0.5, 0.6) for p in st.params])  # the victims
        return torch.where(bad[:, None], torch.nan, probs)

    monkeypatch.setattr(sampling, "processed_probs", poisoned)
    gen = Generator.from_components(target)
    seeded = SamplingParams(max_new_tokens=6, temperature=0.5, seed=1, ignore_eos=True)
    unseeded = SamplingParams(max_new_tokens=6, temperature=0.6, ignore_eos=True)
    other = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True)
    victims = [gen.submit([1, 2], seeded), gen.submit([1, 3], unseeded)]
    handles = [gen.submit([3, 4], other), gen.submit([5], GREEDY)]
    for victim in victims:  # both ways of drawing (position-keyed noise, a stream) refuse
        with pytest.raises(RequestError, match="sampling probabilities are not finite"):
            victim.result()
        assert victim.output_ids == []
    assert len(handles[0].result().token_ids) == 6
    assert len(handles[1].result().token_ids) == 12
    assert_clean(gen)


def test_extreme_valid_seed_works(gen):
    out = gen.generate([1, 2], SamplingParams(max_new_tokens=3, temperature=1.0, seed=2**64 - 1))
    assert len(out.token_ids) == 3


BAD_PARAMS_ARGUMENT = {
    "string": ([1, 2], "greedy", TypeError, "params must be a SamplingParams, got str"),
    "dict": ([1, 2], {"temperature": 1.0}, TypeError, "params must be a SamplingParams, got dict"),
    "too-many": ([[1], [2]], [OK, OK, OK], ValueError, "params has 3 entries for 2 prompts"),
    "too-few": ([[1], [2], [3]], [OK], ValueError, "params has 1 entries for 3 prompts"),
    "list-for-one-prompt": ([1, 2], [OK, OK], ValueError, "params has 2 entries for 1 prompts"),
    "wrong-entry": ([[1], [2]], [OK, "x"], TypeError, "params must be a SamplingParams, got str"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS_ARGUMENT))
def test_bad_params_argument(gen, case):
    prompts, params, error, match = BAD_PARAMS_ARGUMENT[case]
    assert_rejected_before_work(gen, lambda g: g.generate(prompts, params), error, match)


def test_bad_params_argument_stream(gen):
    assert_rejected_before_work(
        gen,
        lambda g: g.stream([1, 2], {"max_new_tokens": 3}),
        TypeError,
        "params must be a SamplingParams",
    )


def test_stop_strings_need_a_tokenizer(gen):
    params = SamplingParams(max_new_tokens=4, stop=["\n"])
    assert_rejected_before_work(
        gen,
        lambda g: g.generate([[1], [2]], [OK, params]),
        ValueError,
        "params.stop needs a tokenizer",
    )
    assert_rejected_before_work(
        gen, lambda g: g.stream([1], params), ValueError, "params.stop needs a tokenizer"
    )
    # The alternative, stop_token_ids, works without one: stop at a token the free run emits.
    free = gen.generate([1], SamplingParams(max_new_tokens=8, ignore_eos=True)).token_ids
    i = next(i for i, t in enumerate(free) if i >= 1 and t not in free[:i])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[free[i]], ignore_eos=True)
    out = gen.generate([1], params)
    assert out.token_ids == free[: i + 1] and out.finish_reason == "stop"


# --- cache capacity ----------------------------------------------------------------------------

BAD_CACHE_CONFIGS = [
    (dict(page_size=0), ValueError, "page_size must be >= 1"),
    (dict(page_size="16"), TypeError, "page_size must be an int"),
    (dict(num_pages=0), ValueError, "num_pages must be >= 1"),
    (dict(max_batch_size=-1), ValueError, "max_batch_size must be >= 1"),
    (dict(max_num_tokens=0), ValueError, "max_num_tokens must be >= 1"),
    (dict(max_num_tokens=1.5), TypeError, "max_num_tokens must be an int"),
    (dict(max_model_len=0), ValueError, "max_model_len must be >= 1"),
    (dict(max_model_len="4k"), TypeError, "max_model_len must be an int"),
    (dict(max_model_len=64, max_num_tokens=32), ValueError, "deprecated name of max_model_len"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"), BAD_CACHE_CONFIGS, ids=[str(c[0]) for c in BAD_CACHE_CONFIGS]
)
def test_bad_cache_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(**kwargs)


def test_cache_config_must_be_a_cache_config(target, tiny_dir, monkeypatch):
    with pytest.raises(TypeError, match="cache_config must be a CacheConfig, got dict"):
        Generator.from_components(target, cache_config={"page_size": 4})
    _forbid_loading(monkeypatch)
    with pytest.raises(TypeError, match="cache_config must be a CacheConfig, got dict"):
        Generator.from_pretrained(tiny_dir, cache_config={"page_size": 4})


@pytest.mark.parametrize("k", [None, 3])
def test_request_larger_than_the_cache(target, k):
    proposer = None if k is None else PromptLookup(num_speculative_tokens=k)
    gen = Generator.from_components(
        target, proposer=proposer, cache_config=CacheConfig(max_model_len=32)
    )
    assert gen.max_sequence_len == 32
    too_long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    assert_rejected_before_work(
        gen,
        lambda g: g.generate([[1] * 2, [2] * 10], too_long),
        ValueError,
        r"max_new_tokens must be at most 22 for this 10-token prompt: the maximum sequence length is 32 "
        r"tokens \(max_model_len.*40 were requested \(10 in the prompt, 30 in the completion\)",
    )
    assert_rejected_before_work(
        gen, lambda g: g.stream([2] * 10, too_long), ValueError, "max_model_len"
    )
    out = gen.generate([2] * 10, SamplingParams(max_new_tokens=22, ignore_eos=True))  # exactly fits
    assert len(out.token_ids) == 22
    assert_clean(gen)


def test_request_larger_than_the_whole_page_pool(target):
    gen = Generator.from_components(target, cache_config=CacheConfig(num_pages=2, page_size=4))
    # 8 slots in all, one kept for the bonus row: 7 tokens fit.
    assert_rejected_before_work(
        gen,
        lambda g: g.generate([1, 2, 3], SamplingParams(max_new_tokens=5)),
        ValueError,
        r"maximum sequence length is 7 tokens \(what the KV cache's 2 pages of 4 slots.*num_pages",
    )
    assert (
        len(gen.generate([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True)).token_ids)
        == 4
    )


# --- context length ----------------------------------------------------------------------------


def test_the_default_maximum_length_is_the_models_context(gen, stories_path):
    assert gen.max_sequence_len == CONTEXT
    assert Generator.from_pretrained(stories_path, dtype="float32").max_sequence_len == 512


def test_the_default_pool_is_shared_not_a_context_per_batch_slot(target):
    """A request may reach the whole context, but the default pool holds max_batch_size
    sequences of up to 4,096 tokens (each with its k + 1 verify slots), not one context each."""
    from specdec.kv.sizing import pool_pages

    assert pool_pages(CacheConfig(), max_len=32768, k=4) == 8 * 257  # 8 x (4,096 + 5 slots), 16 a page
    assert pool_pages(CacheConfig(max_batch_size=1), max_len=32768, k=4) == 2049  # one whole context
    assert pool_pages(CacheConfig(num_pages=7), max_len=32768, k=4) == 7
    gen = Generator.from_components(target, cache_config=CacheConfig(max_batch_size=2))
    assert gen.max_sequence_len == CONTEXT
    assert gen.kv_stats()["num_total_pages"] == 2 * 17  # 2 x (256 + 1 slots), 16 a page


def test_a_32k_model_reaches_its_context_from_a_pool_of_4096_tokens_per_slot():
    """The default pool of a 32k-context model is 8 x 4,096 tokens (as before the limit followed
    the context), yet one request may use it all: 32k, prompt + output."""
    from specdec.models.llama import ModelConfig
    from specdec.models.loading import model_from_state_dict

    hf = make_hf_model("llama", 0, max_position_embeddings=32768)
    model = model_from_state_dict(ModelConfig.from_hf_config(hf.config), iter(hf.state_dict().items()),
                                  dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    gen = Generator.from_components(model)
    assert gen.max_sequence_len == 32768
    assert gen.kv_stats()["num_total_pages"] == 8 * 257  # 8 x (4,096 + 1 slots), 16 a page
    assert_rejected_before_work(gen, lambda g: g.generate([1, 2], SamplingParams(max_new_tokens=32767)),
                                ValueError, "max_new_tokens must be at most 32766")  # fmt: skip
    alone = Generator.from_components(model, cache_config=CacheConfig(max_batch_size=1))
    assert alone.kv_stats()["num_total_pages"] == 2049  # one whole context


def test_max_model_len_bounds_requests(target):
    gen = Generator.from_components(target, cache_config=CacheConfig(max_model_len=40))
    assert gen.max_sequence_len == 40
    assert len(gen.generate([1] * 10, SamplingParams(max_new_tokens=30, ignore_eos=True)).token_ids) == 30
    assert_rejected_before_work(
        gen, lambda g: g.generate([1] * 40, OK), ValueError,
        r"prompt has 40 tokens, but the maximum sequence length is 40 \(max_model_len.*at most 39",
    )  # fmt: skip
    assert_clean(gen)


def test_max_model_len_past_the_context_is_refused(target, tiny_dir, monkeypatch):
    match = rf"max_model_len \(300\) exceeds the model's context \(max_position_embeddings = {CONTEXT}\)"
    with pytest.raises(ValueError, match=match):
        Generator.from_components(target, cache_config=CacheConfig(max_model_len=300))
    _forbid_loading(monkeypatch)  # a model directory's context is read from config.json alone
    with pytest.raises(ValueError, match=match):
        Generator.from_pretrained(tiny_dir, cache_config=CacheConfig(max_model_len=300))


def test_max_num_tokens_is_the_deprecated_name_of_max_model_len(target):
    with pytest.warns(DeprecationWarning, match="use max_model_len"):
        config = CacheConfig(max_num_tokens=32)
    assert Generator.from_components(target, cache_config=config).max_sequence_len == 32


def test_a_kv_cache_larger_than_free_memory_is_refused_before_allocation(target, monkeypatch):
    monkeypatch.setattr("specdec.kv.sizing.available_memory", lambda device: 1000)
    allocated = []
    monkeypatch.setattr("specdec.kv.paged.PagePool.__init__", lambda *a, **k: allocated.append(a))
    with pytest.raises(ValueError, match=r"max_model_len \(256\) and num_pages \(136 of 16 slots\) make a KV cache of .* free; lower"):
        Generator.from_components(target)
    assert allocated == []


OVER_LONG = {
    "prompt": ([1] * CONTEXT, OK, rf"prompt has {CONTEXT} tokens, but the maximum sequence length is {CONTEXT}"),
    "max_new_tokens": (
        [1] * 6,
        SamplingParams(max_new_tokens=10**8),
        rf"max_new_tokens must be at most {CONTEXT - 6} for this 6-token prompt: the maximum sequence "
        rf"length is {CONTEXT} tokens \(the model's context, max_position_embeddings\), and {10**8 + 6} were "
        rf"requested \(6 in the prompt, {10**8} in the completion\)",
    ),
    "one-past": ([1] * 6, SamplingParams(max_new_tokens=CONTEXT - 5), rf"at most {CONTEXT - 6}"),
}
CALLS = {
    "generate": lambda g, p, sp: g.generate(p, sp),
    "generate-batch": lambda g, p, sp: g.generate([[1, 2], p], [OK, sp]),
    "stream": lambda g, p, sp: g.stream(p, sp),
    "submit": lambda g, p, sp: g.submit(p, sp),
    "submit_samples": lambda g, p, sp: g.submit_samples(p, attrs.evolve(sp, n=2, temperature=1.0)),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("case", OVER_LONG)
def test_a_request_past_the_context_is_refused_never_cut(gen, case, call):
    """A prompt or max_new_tokens past the maximum length raises before anything is queued or
    any page held (the library's form of the server's 400), whatever the entry point."""
    prompt, params, match = OVER_LONG[case]
    assert_rejected_before_work(gen, lambda g: CALLS[call](g, prompt, params), ValueError, match)
    assert_clean_and_working(gen)


def test_a_request_that_exactly_fills_the_context_runs_to_its_end(gen):
    out = gen.generate([1] * 6, SamplingParams(max_new_tokens=CONTEXT - 6, ignore_eos=True))
    assert len(out.token_ids) == CONTEXT - 6 and out.finish_reason == "length"
    assert_clean(gen)


# --- loading -----------------------------------------------------------------------------------


def _forbid_loading(monkeypatch) -> None:
    """Any checkpoint load from here on is a test failure (validation must come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was loaded before the arguments were validated")

    monkeypatch.setattr("specdec.generator.load_model", refuse)
    monkeypatch.setattr("specdec.proposers.draft_model.load_model", refuse)


@pytest.mark.parametrize("dtype", ["float8", "int8", "", torch.int32, 16])
def test_unknown_dtype(tmp_path, dtype):
    # Checked before the path: a missing directory does not hide the bad dtype.
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(ValueError, match="dtype must be one of"):
            load(tmp_path / "missing", dtype=dtype)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "meta", 3.5])
def test_unknown_device(tmp_path, device):
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(ValueError, match="device"):
            load(tmp_path / "missing", device=device)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_when_unavailable(tmp_path, device):
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(ValueError, match="CUDA is not available; use device='cpu'"):
            load(tmp_path / "missing", device=device)


def test_cuda_index_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="device 'cuda:99'"):
        Generator.from_pretrained(tmp_path / "missing", device="cuda:99")


def test_missing_model_directory(tmp_path):
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(FileNotFoundError, match="missing-model.*does not exist"):
            load(tmp_path / "missing-model")


def test_directory_without_config_json(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "model.safetensors", tmp_path)
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(FileNotFoundError, match="no config.json in model directory"):
            load(tmp_path, dtype="float64")


def test_config_json_that_is_not_json(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        Generator.from_pretrained(tmp_path, dtype="float64")


class _Tripwire:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_checkpoint_is_refused_and_never_unpickled(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "config.json", tmp_path)
    tripwire = tmp_path / "UNPICKLED"
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(str(tripwire))))
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors in .*never pickles"):
            load(tmp_path, dtype="float64")
    assert not tripwire.exists()


@pytest.mark.parametrize("keep", ["5 bytes", "100 bytes", "half", "all but 1 byte"])
def test_truncated_safetensors(tmp_path, tiny_dir, keep):
    data = (tiny_dir / "model.safetensors").read_bytes()
    cut = {"5 bytes": 5, "100 bytes": 100, "half": len(data) // 2, "all but 1 byte": len(data) - 1}[
        keep
    ]
    shutil.copy(tiny_dir / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data[:cut])
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(
            ValueError, match="corrupt or unreadable checkpoint file .*model.safetensors"
        ):
            load(tmp_path, dtype="float64")


def test_unsupported_architecture(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": VOCAB}
        )
    )
    shutil.copy(tiny_dir / "model.safetensors", tmp_path)
    for load in (Generator.from_pretrained, DraftModel.from_pretrained):
        with pytest.raises(
            ValueError, match=r"unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM.*adapter"
        ):
            load(tmp_path, dtype="float64", model_impl="native")
        # By default it goes to the transformers adapter, which finds no GPT-2 weights there.
        with pytest.raises(ValueError, match=r"weights in .*do not match its config"):
            load(tmp_path, dtype="float64")


def test_weights_that_do_not_match_the_config(tmp_path, tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_size=32)))  # weights: 64
    shutil.copy(tiny_dir / "model.safetensors", tmp_path)
    with pytest.raises(
        ValueError, match=r"wrong shape \(checkpoint != config\).*embed_tokens.weight"
    ):
        Generator.from_pretrained(tmp_path, dtype="float64")


# --- proposers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "error"),
    [(0, ValueError), (-2, ValueError), (2.5, TypeError), ("4", TypeError), (None, TypeError)],
)
def test_draft_model_bad_num_speculative_tokens(tiny_dir, target, k, error):
    with pytest.raises(error, match="num_speculative_tokens must be"):
        DraftModel.from_model(target, num_speculative_tokens=k)
    with pytest.raises(error, match="num_speculative_tokens must be"):
        DraftModel.from_pretrained(tiny_dir, num_speculative_tokens=k, dtype="float64")


def test_draft_model_validates_before_loading(tiny_dir, monkeypatch):
    _forbid_loading(monkeypatch)
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        DraftModel.from_pretrained(tiny_dir, num_speculative_tokens=0)


def test_draft_model_needs_a_specdec_model():
    with pytest.raises(TypeError, match="model must be a specdec LlamaModel"):
        DraftModel.from_model(torch.nn.Linear(2, 2), num_speculative_tokens=2)


@pytest.mark.parametrize("k", [MAX_SPECULATIVE_TOKENS + 1, 10_000])
def test_one_upper_bound_for_k_across_proposers(target, k):
    match = rf"num_speculative_tokens must be an int in 1\.\.{MAX_SPECULATIVE_TOKENS}"
    with pytest.raises(ValueError, match=match):
        DraftModel.from_model(target, num_speculative_tokens=k)
    with pytest.raises(ValueError, match=match):
        MTPHead.from_model(random_head(target), num_speculative_tokens=k)
    with pytest.raises(ValueError, match=match):
        PromptLookup(num_speculative_tokens=k)
    with pytest.raises(ValueError, match=match):
        Generator.from_components(target, proposer=ZeroWidth(k))
    # The bound itself is allowed everywhere.
    assert DraftModel.from_model(target, num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    assert PromptLookup(num_speculative_tokens=MAX_SPECULATIVE_TOKENS)


def test_draft_vocabulary_must_match_the_target(tiny_checkpoint, target):
    other, _, _ = load_model(tiny_checkpoint("qwen2"), dtype="float64")  # 103 tokens, not 101
    match = "draft model's vocabulary has 103 tokens but the target's has 101"
    with pytest.raises(ValueError, match=match):
        Generator.from_components(target, proposer=DraftModel.from_model(other, num_speculative_tokens=2))
    gen = Generator.from_components(target)
    with pytest.raises(ValueError, match=match):
        gen.with_proposer(DraftModel.from_model(other, num_speculative_tokens=2))
    assert_clean_and_working(gen)


@pytest.mark.parametrize("k", [0, -1, 65, 2.5, "2", None])
def test_prompt_lookup_bad_num_speculative_tokens(k):
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an int in 1\.\.64"):
        PromptLookup(num_speculative_tokens=k)


def test_prompt_lookup_rejects_bool_num_speculative_tokens():
    with pytest.raises((TypeError, ValueError), match="num_speculative_tokens"):
        PromptLookup(num_speculative_tokens=True)


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(0, 3), (4, 3), (-1, -1)])
def test_prompt_lookup_bad_ngram(min_ngram, max_ngram):
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookup(num_speculative_tokens=2, min_ngram=min_ngram, max_ngram=max_ngram)


class OnlyPropose:
    """Has a propose method but not the rest of the Proposer protocol."""

    num_speculative_tokens = 2

    def propose(self, ctx):
        raise AssertionError("never called")


class ZeroWidth(TokenListProposer):
    def __init__(self, k: object) -> None:
        super().__init__(2)
        self.num_speculative_tokens = k  # a plug-in that skipped its own validation

    def draft(self, token_ids, k):
        return []


@pytest.mark.parametrize(
    ("proposer", "error", "match"),
    [
        (object(), TypeError, "proposer must implement specdec.interfaces.Proposer, got object"),
        (
            OnlyPropose(),
            TypeError,
            "proposer must implement specdec.interfaces.Proposer, got OnlyPropose",
        ),
        (
            "prompt-lookup",
            TypeError,
            "proposer must implement specdec.interfaces.Proposer, got str",
        ),
        (ZeroWidth(0), ValueError, r"proposer.num_speculative_tokens must be an int in 1\.\.64, got 0"),
        (
            ZeroWidth("3"),
            ValueError,
            r"proposer.num_speculative_tokens must be an int in 1\.\.64, got '3'",
        ),
    ],
    ids=["object", "partial", "string", "zero-width", "string-width"],
)
def test_proposer_not_implementing_the_protocol(
    target, tiny_dir, monkeypatch, proposer, error, match
):
    with pytest.raises(error, match=match):
        Generator.from_components(target, proposer=proposer)
    _forbid_loading(monkeypatch)
    with pytest.raises(error, match=match):
        Generator.from_pretrained(tiny_dir, proposer=proposer)


def test_verifier_not_implementing_the_protocol(target):
    with pytest.raises(
        TypeError, match="verifier must implement specdec.interfaces.Verifier, got object"
    ):
        Generator.from_components(target, proposer=PromptLookup(2), verifier=object())


# --- errors inside a step ----------------------------------------------------------------------


class Faulty:
    """A DraftModel wrapper that misbehaves in one chosen way on its ``fail_at``-th propose.

    Everything else is delegated, so once disarmed it is an ordinary (stateful) draft model,
    and its greedy output must equal plain greedy output: no state survived the failure.
    """

    kind = ProposalKind.CHAIN
    needs_target_hidden = False

    def __init__(self, draft: DraftModel, fault: str, fail_at: int = 1) -> None:
        self.inner = draft
        self.fault = fault
        self.fail_at = fail_at
        self.calls = 0
        self.armed = True
        self.fired = False

    @property
    def num_speculative_tokens(self) -> int:
        return self.inner.num_speculative_tokens

    def kv_specs(self):
        return self.inner.kv_specs()

    def propose(self, ctx):
        proposal = self.inner.propose(ctx)
        self.calls += 1
        if not self.armed or self.calls < self.fail_at or self.fault == "on-target-step-raises":
            return proposal
        self.fired = True
        ids, n = proposal.draft_token_ids, proposal.num_draft_tokens
        if self.fault == "raises":
            raise RuntimeError("proposer exploded")
        if self.fault == "extra-row":
            return DraftProposal(
                kind=ProposalKind.CHAIN,
                draft_token_ids=torch.cat([ids, ids[:1]]),
                num_draft_tokens=(*n, n[0]),
            )
        if self.fault == "too-many-drafts":
            wide = torch.cat([ids, ids], dim=1)
            return DraftProposal(
                kind=ProposalKind.CHAIN,
                draft_token_ids=wide,
                num_draft_tokens=tuple(2 * x for x in n),
            )
        if self.fault == "tree-kind":
            parents = torch.arange(ids.shape[1])[None].expand_as(ids) - 1
            return DraftProposal(
                kind=ProposalKind.TREE, draft_token_ids=ids, num_draft_tokens=n, parents=parents
            )
        if self.fault == "token-past-vocab":
            return DraftProposal(
                kind=ProposalKind.CHAIN, draft_token_ids=ids + VOCAB, num_draft_tokens=n
            )
        if self.fault == "bad-draft-probs":
            probs = torch.full(
                (ids.shape[0], ids.shape[1], VOCAB + 3), 1.0 / (VOCAB + 3), dtype=torch.float64
            )
            return DraftProposal(
                kind=ProposalKind.CHAIN, draft_token_ids=ids, num_draft_tokens=n, draft_probs=probs
            )
        return proposal

    def on_target_step(self, step) -> None:
        self.inner.on_target_step(step)
        # fail_at=1 fails on the prefill step, later ones after fail_at - 1 verify steps.
        if self.armed and self.fault == "on-target-step-raises" and self.calls + 1 >= self.fail_at:
            self.fired = True
            raise RuntimeError("on_target_step exploded")

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)


def perturbed(model):
    """A noisy copy of ``model``: a draft that agrees with it often but not always."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


class RaisingVerifier(ChainVerifier):
    def __init__(self) -> None:
        self.armed = True

    def verify(self, target_logits, proposal, params, generators, **kwargs):
        if self.armed:
            raise RuntimeError("verifier exploded")
        return super().verify(target_logits, proposal, params, generators, **kwargs)


FAULTS = {
    "raises": (RuntimeError, "proposer exploded"),
    "extra-row": (ValueError, r"proposer returned (\d+) rows for a batch of (?!\1)\d+"),
    "too-many-drafts": (ValueError, "proposer drafted"),
    "tree-kind": (ValueError, "proposer declares kind chain but returned a tree proposal"),
    # The engine checks draft ids before the target's embedding lookup (a device assert on CUDA).
    "token-past-vocab": (ValueError, "drafted token ids outside"),
    "bad-draft-probs": (ValueError, "draft_probs must be"),
    "on-target-step-raises": (RuntimeError, "on_target_step exploded"),
}


def _sampled_and_greedy(n: int) -> list[SamplingParams]:
    return [
        GREEDY
        if i % 2 == 0
        else SamplingParams(max_new_tokens=12, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(n)
    ]


@pytest.mark.parametrize("via", ["generate", "stream"])
@pytest.mark.parametrize("fail_at", [1, 3])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_error_inside_a_step_leaves_nothing_behind(target, reference, fault, fail_at, via):
    draft = DraftModel.from_model(perturbed(target), num_speculative_tokens=3)
    proposer = Faulty(draft, fault, fail_at=fail_at)
    gen = Generator.from_components(
        target, proposer=proposer, cache_config=CacheConfig(page_size=4), policy=FixedPolicy(3)
    )
    error, match = FAULTS[fault]
    with pytest.raises(error, match=match):
        if via == "generate":
            gen.generate(PROMPTS, _sampled_and_greedy(len(PROMPTS)))
        else:
            for _ in gen.stream(PROMPTS[1], _sampled_and_greedy(2)[1]):
                pass
    assert proposer.fired and proposer.calls >= fail_at - 1  # it failed where we meant it to
    assert_clean(gen)
    assert draft._computed == {}  # the draft model's per-sequence state was released too

    proposer.armed = False
    outs = gen.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert gen.metrics.num_drafted > 0
    assert_clean(gen)


def test_error_in_the_verifier_leaves_nothing_behind(target, reference):
    verifier = RaisingVerifier()
    gen = Generator.from_components(
        target, proposer=PromptLookup(num_speculative_tokens=3), verifier=verifier, policy=3
    )
    with pytest.raises(RuntimeError, match="verifier exploded"):
        gen.generate([p * 3 for p in PROMPTS], GREEDY)
    assert_clean(gen)
    verifier.armed = False
    assert [o.token_ids for o in gen.generate(PROMPTS, GREEDY)] == [o.token_ids for o in reference]
    assert_clean(gen)


def test_abandoned_stream_leaves_nothing_behind(stories_path):
    gen = Generator.from_pretrained(
        stories_path, dtype="float32", proposer=PromptLookup(num_speculative_tokens=3)
    )
    never_started = gen.stream("Once upon a time", GREEDY)  # validated; queued when iterated
    assert_clean(gen)
    started = gen.stream("The little dog", GREEDY)
    next(started)
    assert gen.scheduler.has_unfinished()
    started.close()  # the consumer stops early
    assert_clean(gen)
    del never_started
    assert_clean_and_working(gen)


# --- command line ------------------------------------------------------------------------------


_cli = run_cli  # (exit code, stdout, stderr) of one `specdec` command


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["generate", "--target", "/no/such/model", "--prompt", "x"], "specdec: error: "),
        (["generate", "--target", "{stories}", "--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
        (["generate", "--target", "{stories}", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["generate", "--target", "{stories}", "--prompt", "", "--dtype", "float32"], "prompt must not be empty"),
        (["generate", "--target", "{stories}", "--prompt", "x", "--dtype", "float8"], "dtype"),
        (["generate", "--target", "{stories}", "--prompt", "x", "--mtp-head", "/no/such/head"], "specdec: error: "),
        (["generate", "--target", "{stories}", "--prompt", "Once", "--max-new-tokens", "100000000"],
         r"max_new_tokens must be at most 510 .*maximum sequence length is 512 tokens \(the model's context"),
        (["generate", "--target", "{stories}", "--prompt", "Once", "--max-model-len", "8", "--max-new-tokens", "7"],
         r"max_new_tokens must be at most 6 .*max_model_len; raise .*--max-model-len"),
        (["generate", "--target", "{stories}", "--prompt", "x", "--max-model-len", "1000"],
         r"max_model_len \(1000\) exceeds the model's context \(max_position_embeddings = 512\)"),
    ],
    ids=["missing-model", "temperature", "max-new-tokens", "empty-prompt", "dtype", "missing-head",
         "past-context", "past-max-model-len", "max-model-len-past-context"],
)
def test_cli_errors_are_one_line_and_exit_2(stories_path, capsys, args, match):
    args = [a.replace("{stories}", str(stories_path)) for a in args]
    code, out, err = _cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert "Traceback" not in err
    assert __import__("re").search(match, lines[0]), lines[0]


def test_cli_debug_shows_the_traceback(capsys):
    from specdec.cli import main

    with pytest.raises(FileNotFoundError):
        main(["--debug", "generate", "--target", "/no/such/model", "--prompt", "x"])


@pytest.mark.parametrize("value", ["0", "-5", "4k"])
def test_cli_rejects_bad_max_model_len(stories_path, capsys, value):
    code, _, err = _cli(["generate", "--target", str(stories_path), "--prompt", "x", "--max-model-len", value], capsys)
    assert code == 2 and "--max-model-len: must be an int >= 1" in err


@pytest.mark.parametrize("threads", ["0", "-2", "two"])
def test_cli_rejects_bad_thread_counts(stories_path, capsys, threads):
    code, _, err = _cli(
        ["generate", "--target", str(stories_path), "--prompt", "x", "--threads", threads], capsys
    )
    assert code == 2 and "--threads: must be an int >= 1" in err


@pytest.mark.parametrize(
    "args",
    [["--draft", "a", "--prompt-lookup"], ["--mtp-head", "a", "--draft", "b"], ["-k", "0"], ["--policy", "greedy"]],
    ids=["draft-and-lookup", "mtp-and-draft", "k-zero", "policy"],
)
def test_cli_rejects_bad_proposer_flags(stories_path, capsys, args):
    code, _, err = _cli(["generate", "--target", str(stories_path), "--prompt", "x", *args], capsys)
    assert code == 2 and "usage:" in err
