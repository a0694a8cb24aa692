"""A transformers model already in memory as the target or the draft (specdec.models.from_transformers)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model
from helpers import hf_greedy, word_tokenizer

from specdec import Generator, SamplingParams
from specdec.proposers import DraftModel

PROMPTS = [[5, 9, 3, 17], [40, 2, 2, 8, 31, 6, 11], [1]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_a_model_object_decodes_as_transformers_does(kind):
    hf = make_hf_model(kind, 0)  # float64
    gen = Generator.from_pretrained(hf, dtype="float64")
    outs = gen.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in PROMPTS]


def test_the_callers_model_is_left_as_it_was():
    hf = make_hf_model("llama", 0).to(torch.float32)  # specdec copies in bfloat16 by default
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    gen = Generator.from_pretrained(hf)
    gen.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    after = hf.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
    # No storage is shared: the copy is specdec's own.
    ours = {t.untyped_storage().data_ptr() for t in gen.target.state_dict().values()}
    assert not ours & {t.untyped_storage().data_ptr() for t in after.values()}


def test_a_draft_object_speculates_losslessly():
    target = make_hf_model("qwen2", 0)
    draft = make_hf_model("qwen2", 0)
    with torch.no_grad():  # a noisy copy: agrees often, not always
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    proposer = DraftModel.from_pretrained(draft, dtype="float64", num_speculative_tokens=3)
    gen = Generator.from_pretrained(target, dtype="float64", proposer=proposer, policy=3)
    outs = gen.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 24) for p in PROMPTS]
    assert 0 < gen.metrics.num_accepted < gen.metrics.num_drafted  # real rejections


def test_a_tokenizer_and_generation_eos_come_with_the_object():
    hf = make_hf_model("llama", 0).eval()
    vocab = hf.config.vocab_size
    hf.generation_config.eos_token_id = [vocab - 1, vocab - 2]
    tok = word_tokenizer(vocab)
    gen = Generator.from_pretrained(hf, tokenizer=tok, dtype="float32")
    assert gen.tokenizer is tok
    assert {vocab - 1, vocab - 2} <= set(gen.eos_token_ids)
    assert gen.generate("t3 t4 t5", SamplingParams(max_new_tokens=3, ignore_eos=True)).text


def test_without_a_tokenizer_it_takes_token_ids_only():
    gen = Generator.from_pretrained(make_hf_model("llama", 0).eval(), dtype="float32")
    assert gen.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        gen.generate("some text", SamplingParams(max_new_tokens=2))


def test_unsupported_objects_are_refused_naming_what():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="unsupported architecture"):
        Generator.from_pretrained(gpt2, model_impl="native")
    assert Generator.from_pretrained(gpt2).model_impl == "transformers"  # the adapter's (its tests)
    with pytest.raises(TypeError, match="model source must be a path or a name"):
        Generator.from_pretrained(torch.nn.Linear(2, 2))
    hf = make_hf_model("llama", 0)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs the target as a checkpoint"):
        Generator.from_pretrained(hf, tensor_parallel_size=2)


def test_offloaded_weights_are_refused():
    hf = make_hf_model("llama", 0)
    with torch.device("meta"):
        meta = type(hf)(hf.config)
    with pytest.raises(ValueError, match="meta device"):
        Generator.from_pretrained(meta)
