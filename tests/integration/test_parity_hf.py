"""Parity with Hugging Face transformers: same checkpoint, same logits, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, ragged_prefill_logits

from specdec import Generator, SamplingParams
from specdec.models.loading import load_model

PROMPTS_STORIES = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day",
    "Sam had a big red ball. He",
    "The sun was",
    "A girl named Sue liked to sing",
    "Mom said",
]


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _prompt_ids(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral"])
def test_logits_match_transformers_tiny_float64(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    model, _, _ = load_model(path, dtype="float64")
    hf = _hf(path, torch.float64)
    prompts = _prompt_ids(model.config.vocab_size, 5, seed=1)
    ours = ragged_prefill_logits(model, prompts, page_size=4)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        # transformers runs RMSNorm and RoPE in float32 even for float64 models: float32-level tolerance.
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=2e-5)


def test_logits_match_transformers_stories_float32(stories_path):
    model, _, _ = load_model(stories_path, dtype="float32")
    hf = _hf(stories_path, torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_path)
    prompts = [tok.encode(p) for p in PROMPTS_STORIES]
    ours = ragged_prefill_logits(model, prompts, page_size=16)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers_stories(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    hf = _hf(stories_path, torch.float32)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompts = [gen.encode(p) for p in PROMPTS_STORIES]
    outs = gen.generate(prompts, params)  # one batch of 8 prompts of different lengths
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 48)
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_generation_matches_transformers_tiny(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    gen = Generator.from_pretrained(path, dtype="float64")
    hf = _hf(path, torch.float64)
    prompts = _prompt_ids(gen.target.config.vocab_size, 8, seed=2)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 48)
