"""Shared fixtures: tiny random HF checkpoints (saved as safetensors) and the bundled stories260K."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tiny models run faster on one thread, and a second OpenMP thread spins against whatever else
# shares the 2-core machine (other test processes, a benchmark): keep tests single-threaded.
torch.set_num_threads(1)

STORIES = Path(__file__).resolve().parents[1] / "src" / "specdec" / "data" / "stories260K"
_OWN_CACHE: list[str] = []


def pytest_configure(config):
    """Tests never touch the user's ``~/.cache/specdec``: converted models, packed weights and
    the CPU kernel's build go to a directory of this run (``SPECDEC_TEST_CACHE`` names one to
    reuse between runs instead). Set before collection, so every import sees it; subprocesses
    (examples, the notebook, the wheel) inherit it. Parallel workers (pytest-xdist) share the
    controller's directory: they inherit its environment, so the kernel builds once and converted
    models are reused (every cache write is a rename, so concurrent writers are safe)."""
    if hasattr(config, "workerinput") and os.environ.get("SPECDEC_CACHE"):
        return  # an xdist worker: the controller set SPECDEC_CACHE and removes it at the end
    root = os.environ.get("SPECDEC_TEST_CACHE")
    if not root:
        root = tempfile.mkdtemp(prefix="specdec-test-cache-")
        _OWN_CACHE.append(root)
    os.environ["SPECDEC_CACHE"] = root


def pytest_unconfigure(config):
    for root in _OWN_CACHE:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kernel():
    """Tests of the packed CPU kernel need it built. Where the CPU can run it (AVX2 + FMA) a
    failed build fails the test, loudly, rather than skipping it; ``SPECDEC_ALLOW_NO_KERNEL=1``
    allows the skip on machines without a compiler."""
    from specdec.kernels import cpu_linear

    if cpu_linear.kernel_available():
        return
    if not cpu_linear._cpu_supports_avx2_fma_f16c():
        pytest.skip("this CPU has no AVX2/FMA/F16C: the kernel is never used here")
    if os.environ.get("SPECDEC_DISABLE_CPU_KERNEL"):
        pytest.skip("SPECDEC_DISABLE_CPU_KERNEL is set")
    if os.environ.get("SPECDEC_ALLOW_NO_KERNEL") == "1":
        pytest.skip("the CPU kernel did not build (allowed by SPECDEC_ALLOW_NO_KERNEL=1)")
    try:
        cpu_linear._build_and_load()
    except Exception as err:  # noqa: BLE001 - reported as the failure
        pytest.fail(f"the CPU kernel failed to build on an AVX2/FMA/F16C machine: {err}", pytrace=False)
    pytest.fail("the CPU kernel was unavailable but then built: a flaky build?", pytrace=False)

TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=97,
        max_position_embeddings=512,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=103,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=89,
        max_position_embeddings=256,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model of a tiny config, float64, with non-trivial biases/norms."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(TINY_CONFIGS[kind], **overrides)
    model_type = kwargs.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))  # sharper logits than the 0.02 init
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: kind -> directory with config.json + model.safetensors of a tiny random model."""
    cache: dict[tuple[str, int], Path] = {}

    def build(kind: str, seed: int = 0) -> Path:
        if (kind, seed) not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{kind}-{seed}")
            make_hf_model(kind, seed).save_pretrained(path, safe_serialization=True)
            cache[(kind, seed)] = path
        return cache[(kind, seed)]

    return build


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return STORIES


@pytest.fixture(scope="session")
def tiny_pair(tiny_checkpoint):
    """(target, draft): a tiny random float64 Qwen2 and a noisy copy that agrees often, not always."""
    from helpers import perturbed

    from specdec.models.loading import load_model

    target, _, _ = load_model(tiny_checkpoint("qwen2"), dtype="float64")
    return target, perturbed(target, 0.3, seed=5)
