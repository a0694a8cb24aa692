"""The transformers adapter (specdec.models.hf_adapter): architectures with no native family run
their own code over specdec's paged KV, exactly as transformers decodes them."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_model
from helpers import (
    assert_greedy_as_transformers,
    cpu_prefill_logits,
    hf_greedy,
    hf_logits,
    perturbed,
    run_cli,
    word_tokenizer,
)

from specdec import CacheConfig, Generator, SamplingParams
from specdec.models.hf_adapter import TransformersAdapter
from specdec.proposers import DraftModel, MTPHead, PromptLookup, SuffixDecoding, SuffixHybrid
from specdec.proposers.chain_drafting import ChainProposerConfig

VOCAB = 97


def _gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128, **kw))


def _neox(**kw):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=128, rotary_pct=0.25, max_position_embeddings=128, **kw)  # fmt: skip
    return GPTNeoXForCausalLM(cfg)


def _falcon(**kw):
    from transformers import FalconConfig, FalconForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=128, new_decoder_architecture=True, num_kv_heads=2)  # fmt: skip
    return FalconForCausalLM(FalconConfig(**dict(cfg, **kw)))


BUILDERS = {
    "gpt2": _gpt2,
    "gpt_neox": _neox,  # partial rotary (a quarter of each head), parallel residual
    "falcon": _falcon,  # grouped KV heads (new decoder architecture)
    "falcon-mq": lambda: _falcon(new_decoder_architecture=False, multi_query=True),  # one KV head
}


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random float64 model with sharp logits (greedy ties would make parity meaningless)."""
    torch.manual_seed(seed)
    model = BUILDERS[kind]().to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10.0)  # the 0.02 init gives near-uniform logits
    return model


def prompts(seed: int = 3) -> list[list[int]]:
    """Three ragged prompts that repeat themselves (so prompt lookup and suffix trees draft)."""
    g = torch.Generator().manual_seed(seed)
    body = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 11, 5)]
    return [b * 3 for b in body]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def hf(kind):
    return build(kind)


def test_prefill_logits_equal_transformers(hf):
    adapter = TransformersAdapter(hf)
    ps = prompts()
    ours = cpu_prefill_logits(adapter, ps)  # one ragged batch through the paged backend
    for p, logits in zip(ps, ours):
        torch.testing.assert_close(logits, hf_logits(hf, p), rtol=0, atol=1e-9)


def _proposer(name: str, draft: TransformersAdapter, k: int):
    if name == "draft":
        return DraftModel.from_model(draft, num_speculative_tokens=k)
    if name == "lookup":
        return PromptLookup(num_speculative_tokens=k)
    if name == "suffix":  # tree-shaped proposals: verified under the tree mask
        return SuffixDecoding(num_speculative_tokens=k, spec_offset=float(k))
    return SuffixHybrid(DraftModel.from_model(draft, num_speculative_tokens=k),
                        SuffixDecoding(num_speculative_tokens=k, spec_offset=float(k)))  # fmt: skip


@pytest.mark.parametrize("proposer", [None, "draft", "lookup", "suffix", "hybrid"])
def test_greedy_equals_transformers(kind, hf, proposer):
    target = TransformersAdapter(hf)
    draft = TransformersAdapter(perturbed(copy.deepcopy(hf), 0.3)) if proposer else None
    drafts = _proposer(proposer, draft, 3) if proposer else None
    assert_greedy_as_transformers(target, hf, drafts, 3, prompts(), 20, expect_accepted=proposer is not None)


class PositionsDropped(TransformersAdapter):
    """Bug: the pass's positions not handed to the model (it numbers the flattened batch 0..n-1
    itself): wrong for every request after the first and for tree rows."""

    def forward(self, layout, *args, **kwargs):
        import attrs

        arange = torch.arange(layout.token_ids.numel())
        return super().forward(attrs.evolve(layout, positions=arange), *args, **kwargs)


def test_the_check_catches_positions_dropped():
    hf = build("gpt2")
    with pytest.raises(AssertionError):
        assert_greedy_as_transformers(PositionsDropped(hf), hf, None, 0, prompts(), 12, expect_accepted=False)


def test_the_callers_model_runs_without_a_copy_and_stays_usable(tmp_path):
    hf = build("gpt2")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    attn = hf.config._attn_implementation
    gen = Generator.from_pretrained(hf, cache_config=CacheConfig(num_pages=64))
    assert gen.model_impl == "transformers" and gen.target.hf_model is hf
    ours = {t.untyped_storage().data_ptr() for t in gen.target.state_dict().values()}
    assert ours == {t.untyped_storage().data_ptr() for t in hf.state_dict().values()}
    out = gen.generate(prompts()[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, prompts()[0], 8)
    # The caller's model is as it was: weights, attention implementation, its own generate.
    assert hf.config._attn_implementation == attn
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in before.items())


def test_generators_sharing_a_target_step_in_threads_exactly():
    """Two generators over one adapter (``with_proposer``) stepping in two threads: the
    attention switch is the model object's, so passes over it are serialised (one lock per
    object, shared by every adapter over it)."""
    import threading

    hf = build("gpt2")
    target = TransformersAdapter(hf)
    assert TransformersAdapter(hf)._lock is target._lock
    plain = Generator.from_components(target)
    other = plain.with_proposer(PromptLookup(3), policy=3)
    ps = prompts()
    want = [hf_greedy(hf, p, 16) for p in ps]
    got: dict[int, list] = {}
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)

    def run(i, gen):
        got[i] = [o.token_ids for o in gen.generate(ps, params)]

    threads = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate((plain, other, plain, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == want for i in range(4))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_memory_grows_by_the_kv_pool_not_the_weights():
    """Measured: wrapping a 48 MB model adds less than a tenth of it (the probe and a small KV
    pool); the native loader's copy of a same-size Llama adds the whole size (the control)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_embd=512, n_layer=4, n_head=8, n_positions=128)).eval()
    size = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert size > 40e6
    before = _rss()
    gen = Generator.from_pretrained(hf, cache_config=CacheConfig(num_pages=8, page_size=16))
    gen.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    grown = _rss() - before
    assert grown < 0.1 * size, (grown, size)
    llama = make_hf_model("llama", 0, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=8, vocab_size=4096).float()  # fmt: skip
    before = _rss()
    native = Generator.from_pretrained(llama, dtype="float32", cache_config=CacheConfig(num_pages=8, page_size=16))
    assert native.model_impl == "native"
    assert _rss() - before > 0.5 * sum(p.numel() * 4 for p in llama.parameters())


def test_model_impl_picks_the_path():
    llama = make_hf_model("llama", 0)
    p = [5, 9, 3, 17, 5, 9]
    native = Generator.from_pretrained(llama, dtype="float64")
    forced = Generator.from_pretrained(llama, model_impl="transformers")
    assert (native.model_impl, forced.model_impl) == ("native", "transformers")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert forced.generate(p, params).token_ids == native.generate(p, params).token_ids == hf_greedy(llama, p, 12)
    with pytest.raises(ValueError, match="unsupported architecture.*model_impl='transformers'"):
        Generator.from_pretrained(build("gpt2"), model_impl="native")
    with pytest.raises(ValueError, match=r"model_impl must be one of \('auto', 'native', 'transformers'\)"):
        Generator.from_pretrained(llama, model_impl="hf")


def test_a_checkpoint_directory_loads_on_the_adapter(tmp_path):
    hf = build("gpt_neox")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    gen = Generator.from_pretrained(tmp_path, dtype="float64")
    assert gen.model_impl == "transformers"
    draft = DraftModel.from_pretrained(tmp_path, dtype="float64", num_speculative_tokens=3)
    assert isinstance(draft.model, TransformersAdapter)
    spec = gen.with_proposer(draft, policy=3)
    p = prompts()[1]
    out = spec.generate(p, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf, p, 16)
    assert spec.metrics.num_accepted == spec.metrics.num_drafted > 0  # the same model drafts


def test_the_cli_runs_a_checkpoint_on_the_adapter(tmp_path, capsys):
    hf = build("gpt2")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    word_tokenizer(VOCAB).save_pretrained(tmp_path)
    args = ["generate", "--target", str(tmp_path), "--prompt", "t5 t6 t7 t5 t6", "--max-new-tokens", "6",
            "--dtype", "float64", "--ignore-eos", "--proposer", "prompt-lookup"]  # fmt: skip
    rc, out, _ = run_cli(args, capsys)
    assert rc == 0 and "6 tokens" in out
    rc, _, err = run_cli([*args, "--model-impl", "native"], capsys)
    assert rc != 0 and "unsupported architecture" in err


def test_a_checkpoint_missing_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    build("gpt2").save_pretrained(tmp_path, safe_serialization=True)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in state.items() if "h.1.mlp" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match="do not match its config.*h.1.mlp"):
        Generator.from_pretrained(tmp_path, dtype="float64")


def test_what_the_adapter_cannot_serve_is_refused_naming_it():
    hf = build("gpt2")
    with pytest.raises(ValueError, match="quantization='int8' needs a natively supported family"):
        Generator.from_pretrained(hf, quantization="int8")
    with pytest.raises(ValueError, match="dtype='bfloat16'.*torch.float64.*pass dtype=None"):
        Generator.from_pretrained(hf, dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        Generator.from_pretrained(hf, tensor_parallel_size=2, model_impl="transformers")
    target = TransformersAdapter(hf)
    with pytest.raises(ValueError, match="MTP head reads the target's hidden states.*GPT2LMHeadModel"):
        mtp = MTPHead(ChainProposerConfig(num_speculative_tokens=2), path=Path("heads/none"))
        Generator.from_components(target, proposer=mtp)
    with pytest.raises(ValueError, match="draft_vocab needs a natively supported draft family"):
        DraftModel.from_model(target, draft_vocab=[1, 2, 3])
    with pytest.raises(ValueError, match="ALiBi"):
        TransformersAdapter(_falcon(alibi=True, new_decoder_architecture=False).eval())


def test_bloom_which_bypasses_the_attention_interface_is_refused():
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)).eval()
    with pytest.raises(ValueError, match="BloomForCausalLM.*AttentionInterface|ALiBi"):
        Generator.from_pretrained(bloom)


# ---- T > 0: the engine's output distribution through the adapter ----------------------------------


@pytest.fixture(scope="module")
def lossless():
    import test_lossless_engine as lossless

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lossless, "BATCH", 512)
        yield lossless


@pytest.fixture(scope="module")
def adapter_models(lossless):
    """The lossless suite's transformers target and draft (float64), both on the adapter."""
    hf_target, _, _ = lossless.build_models()
    hf_draft = copy.deepcopy(hf_target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as build_models' draft: agrees often, not always
        for p in hf_draft.parameters():
            p.add_(0.25 * p.abs().mean() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return hf_target, TransformersAdapter(hf_target), TransformersAdapter(hf_draft)


@pytest.mark.parametrize(
    ("sampling", "proposer", "mode"),
    [("t1.0", "draft", "stream"), ("t0.8-topk8-topp0.9", "hybrid", "seeded")],
)
def test_sampled_output_matches_the_target_distribution(lossless, adapter_models, sampling, proposer, mode):
    case = lossless.Case(sampling, 3, proposer, mode)
    result, gen = lossless.run_case(adapter_models, case)
    assert gen.model_impl == "transformers"
    assert min(result.values()) > lossless.ALPHA, result
    assert 0.02 < gen.metrics.acceptance_rate < 0.95, gen.metrics.acceptance_rate


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
