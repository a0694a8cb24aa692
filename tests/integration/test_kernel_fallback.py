"""When the packed bf16 CPU kernel cannot be used, specdec falls back to torch, visibly and
correctly: a failing build warns and leaves plain ``nn.Linear`` layers, as does
``SPECDEC_DISABLE_CPU_KERNEL`` (silently: the user asked for it); a damaged packed-model cache
entry is repacked. Either way greedy output is that of the plain torch bf16 model.

Each test works in its own ``SPECDEC_CACHE`` and restores the process-wide kernel handle.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from specdec import Generator, SamplingParams
from specdec.kernels import cpu_linear
from specdec.models.loading import load_model
from specdec.models.packed import PackedLinear
from specdec.models.packed_cache import packed_cache_file

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPTS = ["Once upon a time", "The little dog"]


@pytest.fixture
def fresh_kernel_handle(monkeypatch, tmp_path):
    """A private cache and a kernel handle that is looked up again (and again after the test)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    cpu_linear.load_kernel.cache_clear()
    yield
    monkeypatch.undo()
    cpu_linear.load_kernel.cache_clear()


def _packed_layers(model) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def _greedy(model, tokenizer) -> list[list[int]]:
    return [o.token_ids for o in Generator.from_components(model, tokenizer).generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def torch_reference(stories_path):
    """Greedy output of the plain torch bf16 model (no packing), and the tokenizer."""
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    model, _, _ = load_model(stories_path, dtype="bfloat16", pack=False)
    return _greedy(model, gen.tokenizer), gen.tokenizer


def test_a_failing_kernel_build_warns_and_falls_back(stories_path, torch_reference, monkeypatch, fresh_kernel_handle):
    def broken_build():
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(cpu_linear, "_build_and_load", broken_build)
    with pytest.warns(UserWarning, match="kernel unavailable, using torch: compiler exploded"):
        model, _, _ = load_model(stories_path, dtype="bfloat16")
    assert _packed_layers(model) == 0
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Linear)
    packed = cpu_linear.pack_weight(torch.randn(16, 8).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16_dot=1 needs the CPU kernel"):  # not the reference
        cpu_linear.packed_linear(torch.randn(1, 8).to(torch.bfloat16), packed, 16, bf16_dot=1)
    expected, tokenizer = torch_reference
    assert _greedy(model, tokenizer) == expected


def test_a_missing_kernel_source_warns_and_falls_back(stories_path, torch_reference, monkeypatch, fresh_kernel_handle, tmp_path):
    """The installed-package failure of old: the source file is not there to read."""
    monkeypatch.setattr(cpu_linear, "__file__", str(tmp_path / "nowhere" / "cpu_linear.py"))
    with pytest.warns(UserWarning, match="kernel unavailable, using torch"):
        model, _, _ = load_model(stories_path, dtype="bfloat16")
    assert _packed_layers(model) == 0
    assert _greedy(model, torch_reference[1]) == torch_reference[0]


def test_disabling_the_kernel_falls_back_silently(stories_path, torch_reference, monkeypatch, fresh_kernel_handle):
    monkeypatch.setenv("SPECDEC_DISABLE_CPU_KERNEL", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _, _ = load_model(stories_path, dtype="bfloat16")
    assert cpu_linear.load_kernel() is None
    assert _packed_layers(model) == 0
    assert _greedy(model, torch_reference[1]) == torch_reference[0]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_packed_cache_entry_is_repacked(stories_path, torch_reference, kernel, damage, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    first, _, _ = load_model(stories_path, dtype="bfloat16")
    expected = _greedy(first, torch_reference[1])
    (entry,) = (tmp_path / "cache" / "packed").glob("*/model.safetensors")
    assert entry == packed_cache_file(sorted(stories_path.glob("*.safetensors")))
    data = entry.read_bytes()
    entry.write_bytes({"garbage": bytes(len(data)), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    again, _, _ = load_model(stories_path, dtype="bfloat16")
    assert _packed_layers(again) == _packed_layers(first) > 0
    assert _greedy(again, torch_reference[1]) == expected
    assert entry.read_bytes() == data  # repaired: the next load maps it again
