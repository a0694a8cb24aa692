"""MTP and EAGLE heads loaded with ``quantization="int8" | "q4"`` (CPU): every linear layer the
head owns (its LM head and, for MTP, its draft-vocabulary rows of the target's) is stored in
that format, drafts come from it, and greedy output still equals plain decoding."""

from __future__ import annotations

import pytest
import torch
from helpers import random_head, random_prompts

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.models.eagle_checkpoints import save_eagle_head
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.models.loading import load_model
from specdec.models.mtp_head import save_draft_vocab, save_mtp_head
from specdec.models.quantized import Int8Linear, Q4Linear
from specdec.models.sub_vocab import SubVocabHead
from specdec.proposers import EAGLETree, MTPHead

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
FORMATS = {"int8": Int8Linear, "q4": Q4Linear}


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    model, _, _ = load_model(tiny_checkpoint("qwen2"), dtype="float32")
    return model


def _linears(module: torch.nn.Module) -> dict[str, type]:
    return {
        name: type(m)
        for name, m in module.named_modules()
        if isinstance(m, (torch.nn.Linear, Int8Linear, Q4Linear)) or type(m).__name__ == "PackedLinear"
    }


def _eagle3_head(target, seed: int = 4) -> EagleHeadModel:
    torch.manual_seed(seed)
    layers = (0, 1, target.config.num_layers)
    head = EagleHeadModel(target, EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=layers))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return head.to(target.dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_eagle_tree_with_a_quantized_head_keeps_greedy_output(target, tmp_path, quantization):
    save_eagle_head(_eagle3_head(target), tmp_path / "eagle")
    prompts = random_prompts(target.config.vocab_size, 4, seed=11, max_len=20)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    tree = EAGLETree.from_pretrained(tmp_path / "eagle", top_k=3, depth=3, num_verify_tokens=6, quantization=quantization)
    gen = Generator.from_components(target, proposer=tree, policy=FixedPolicy(6))
    out = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    kinds = _linears(tree.head)
    assert kinds and set(kinds.values()) == {FORMATS[quantization]}, kinds  # lm_head and fc included
    assert "lm_head" in kinds and "fc" in kinds
    assert gen.metrics.num_verify_steps > 0
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_mtp_head_quantized_with_its_draft_vocabulary(target, tmp_path, quantization):
    head_dir = tmp_path / "mtp"
    save_mtp_head(random_head(target, seed=5), head_dir)
    vocab = target.config.vocab_size
    save_draft_vocab(head_dir, torch.randperm(vocab, generator=torch.Generator().manual_seed(0)))
    prompts = random_prompts(vocab, 4, seed=12, max_len=20)
    plain = Generator.from_components(target).generate(prompts, GREEDY)
    mtp = MTPHead.from_pretrained(head_dir, num_speculative_tokens=2, draft_vocab_size=vocab // 2, quantization=quantization)
    gen = Generator.from_components(target, proposer=mtp, policy=FixedPolicy(2))
    out = gen.generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    kinds = _linears(mtp.head)
    assert kinds and set(kinds.values()) == {FORMATS[quantization]}, kinds
    assert isinstance(mtp._sub_head, SubVocabHead) and isinstance(mtp._sub_head.linear, FORMATS[quantization])
    assert not isinstance(target.lm_head, FORMATS[quantization])  # the target's own head untouched
    assert gen.metrics.num_verify_steps > 0


def test_unquantized_heads_stay_as_they_were(target, tmp_path):
    """The negative control of the checks above: without ``quantization`` no head layer is int8
    or 4-bit, so the isinstance checks do tell the two apart."""
    save_eagle_head(_eagle3_head(target), tmp_path / "eagle")
    tree = EAGLETree.from_pretrained(tmp_path / "eagle", top_k=3, depth=3, num_verify_tokens=6)
    Generator.from_components(target, proposer=tree, policy=FixedPolicy(6))
    assert not set(_linears(tree.head).values()) & set(FORMATS.values())


@pytest.mark.parametrize("bad", ["int4", "INT8", "", 8])
def test_a_bad_quantization_is_refused_before_any_file_is_read(tmp_path, bad):
    missing = tmp_path / "no-such-head"  # the value is checked first: no FileNotFoundError
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4'"):
        EAGLETree.from_pretrained(missing, quantization=bad)
    with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'q4'"):
        MTPHead.from_pretrained(missing, quantization=bad)
