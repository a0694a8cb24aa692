"""Config fields the native decoder cannot honour are refused at load; the ones it can are honoured.

A transformers config field that changes the model's math but not specdec's would load and
decode wrongly without a word (a Llama with ``hidden_act="gelu"`` run as SiLU disagrees with
transformers' greedy output on 20 of 72 tokens). Each refused case here must raise a ValueError
at ``Generator.from_pretrained(dir)`` naming the field and its value, before any weight is read
(the directories hold no weights at all, and reading them is patched to fail). Each accepted
case loads a tiny random float64 checkpoint saved by transformers and decodes greedily exactly
as transformers does: one full forward without a cache over prompt + output, whose argmax at
each position must be the token specdec emitted (transformers' eager attention, so its mask is
its own).
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from conftest import TINY_CONFIGS, make_hf_model

from specdec import Generator, SamplingParams
from specdec.models import loading
from specdec.models.llama import ModelConfig

NEW_TOKENS = 24
NATIVE = "not supported by specdec's native decoder"


def _config_dir(tmp_path, kind: str, json_fields: dict | None = None, **overrides):
    """A directory holding only the config.json of a tiny ``kind`` model: transformers' config
    with ``overrides``, then ``json_fields`` written over the JSON itself (``None`` deletes a
    key, as in a config.json written by an older transformers)."""
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[kind], **overrides)
    AutoConfig.for_model(kwargs.pop("model_type"), **kwargs).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for key, value in (json_fields or {}).items():
        data.pop(key) if value is None else data.__setitem__(key, value)
    path.write_text(json.dumps(data))
    return tmp_path


def _no_weight_work(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("weights were looked for before the config was checked")

    monkeypatch.setattr(loading, "safetensors_files", fail)
    monkeypatch.setattr(loading, "model_from_state_dict", fail)


LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
    original_max_position_embeddings=64,
)  # fmt: skip

# (id, kind, config overrides, config.json fields, the field the error names, its value)
REFUSED = [
    ("activation-with-weights", "llama", dict(hidden_act="prelu"), None, "hidden_act", "'prelu'"),
    ("unknown-activation", "llama", dict(hidden_act="gelu_foo"), None, "hidden_act", "'gelu_foo'"),
    # Windows on the last layer only (transformers: layers >= max_window_layers), as a config
    # of transformers 5 spells it (layer_types) and as an older one (max_window_layers only).
    (
        "qwen2-some-layers-windowed",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        None,
        "layer_types",
        "full_attention, sliding_attention",
    ),
    (
        "qwen2-some-layers-windowed-old-config",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        dict(layer_types=None),
        "layer_types",
        "max_window_layers=1",
    ),
    (
        "qwen2-layer-types-mixed",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=4),
        dict(layer_types=["sliding_attention", "full_attention"]),
        "layer_types",
        "sliding_attention, full_attention",
    ),
    # MistralForCausalLM windows every layer and ignores layer_types; AutoConfig reads a
    # mistral config.json with layer_types as Ministral's (windows per layer): where the two
    # readings differ, the model's attention is unknown.
    (
        "mistral-layer-types-mixed",
        "mistral",
        dict(sliding_window=4),
        dict(
            architectures=["MistralForCausalLM"],
            layer_types=["sliding_attention", "full_attention"],
        ),
        "layer_types",
        "sliding_attention, full_attention",
    ),
    (
        "mistral-layer-types-full-with-window",
        "mistral",
        dict(sliding_window=4),
        dict(architectures=["MistralForCausalLM"], layer_types=["full_attention"] * 2),
        "layer_types",
        "full_attention x2",
    ),
    (
        "llama-layer-types-windowed",
        "llama",
        {},
        dict(sliding_window=4, layer_types=["sliding_attention"] * 2),
        "layer_types",
        "sliding_attention x2",
    ),
    (
        "longrope",
        "llama",
        dict(rope_parameters=LONGROPE),
        None,
        "rope_parameters.rope_type",
        "'longrope'",
    ),
    (
        "unknown-rope-type",
        "llama",
        {},
        dict(rope_parameters=dict(rope_type="spiral", rope_theta=1e4)),
        "rope_parameters.rope_type",
        "'spiral'",
    ),
    (
        "rope-per-layer-type",
        "llama",
        {},
        dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e4))),
        "rope_parameters",
        "full_attention",
    ),
    (
        "partial-rotary",
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="linear", factor=2.0, rope_theta=1e4, partial_rotary_factor=0.5
            )
        ),
        None,
        "rope_parameters.partial_rotary_factor",
        "0.5",
    ),
    (
        "pre-quantized",
        "qwen2",
        {},
        dict(quantization_config=dict(quant_method="awq", bits=4)),
        "quantization_config",
        "'awq'",
    ),
]


@pytest.mark.parametrize(("kind", "overrides", "json_fields", "field", "value"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])  # fmt: skip
def test_refused_before_any_weight_is_read(
    tmp_path, monkeypatch, kind, overrides, json_fields, field, value
):
    path = _config_dir(tmp_path, kind, json_fields, **overrides)
    _no_weight_work(monkeypatch)
    with pytest.raises(ValueError) as err:
        Generator.from_pretrained(path, dtype="float64")
    message = str(err.value)
    assert NATIVE in message and f"config field {field}=" in message and value in message, message
    assert "supported:" in message


@pytest.mark.parametrize("types", [["full_attention"], ["full_attention", "chunked_attention"]])
def test_layer_types_transformers_5_would_reject_are_refused_too(types):
    """transformers 5 itself refuses these config.json files (wrong length, unknown type);
    a config object from elsewhere gets specdec's own error."""
    from types import SimpleNamespace

    from specdec.models.config_checks import uniform_window

    cfg = SimpleNamespace(num_hidden_layers=2, sliding_window=None, layer_types=types)
    for arch in ("llama", "qwen2", "mistral"):
        with pytest.raises(ValueError, match=f"{NATIVE}: config field layer_types="):
            uniform_window(cfg, arch)


def _hf_greedy_check(hf, gen: Generator, prompt: list[int]) -> list[int]:
    """specdec's greedy tokens after ``prompt``, checked against transformers: each is the
    argmax of transformers' full forward at its position."""
    out = gen.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)).token_ids
    full = torch.tensor([prompt + out])
    with torch.no_grad():
        ref = hf(full, use_cache=False).logits[0, len(prompt) - 1 : -1].argmax(-1)
    assert out == ref.tolist()
    return out


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# (id, kind, overrides, the ModelConfig fields the load must give)
ACCEPTED = [
    ("gelu", "llama", dict(hidden_act="gelu"), dict(hidden_act="gelu")),
    (
        "gelu-tanh",
        "qwen2",
        dict(hidden_act="gelu_pytorch_tanh"),
        dict(hidden_act="gelu_pytorch_tanh"),
    ),
    ("relu2", "mistral", dict(hidden_act="relu2"), dict(hidden_act="relu2")),
    # Every layer windowed (max_window_layers=0) or none (max_window_layers >= layers), on a
    # prompt three times the window: one attention for all layers, as transformers applies it.
    (
        "qwen2-all-layers-windowed",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
        dict(sliding_window=5),
    ),
    (
        "qwen2-no-layer-windowed",
        "qwen2",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=2),
        dict(sliding_window=None),
    ),
    (
        "mistral-layer-types-agree",
        "mistral",
        dict(sliding_window=5, layer_types=["sliding_attention"] * 2),
        dict(sliding_window=5),
    ),
    # Fields the transformers class of the architecture does not read: neither does specdec.
    ("llama-sliding-window-unread", "llama", dict(sliding_window=5), dict(sliding_window=None)),
    (
        "qwen2-mlp-bias-unread",
        "qwen2",
        dict(mlp_bias=True, attention_bias=True),
        dict(qkv_bias=True, o_bias=False, mlp_bias=False),
    ),
    (
        "mistral-attention-bias-unread",
        "mistral",
        dict(attention_bias=True, mlp_bias=True),
        dict(qkv_bias=False, o_bias=False, mlp_bias=False),
    ),
    (
        "llama-biases",
        "llama",
        dict(attention_bias=True, mlp_bias=True),
        dict(qkv_bias=True, o_bias=True, mlp_bias=True),
    ),
    # Dynamic NTK changes its frequencies only past max_position_embeddings, where specdec never goes.
    (
        "dynamic-rope",
        "llama",
        dict(
            max_position_embeddings=48,
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=1e4),
        ),
        {},
    ),
    (
        "yarn-rope",
        "llama",
        dict(
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, rope_theta=1e4, original_max_position_embeddings=32
            ),
        ),
        {},
    ),
]


@pytest.mark.parametrize(
    ("kind", "overrides", "expected"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_accepted_configs_decode_as_transformers(tmp_path, kind, overrides, expected):
    hf = make_hf_model(kind, seed=3, attn_implementation="eager", **overrides)
    hf.save_pretrained(tmp_path)
    gen = Generator.from_pretrained(tmp_path, dtype="float64")
    cfg = gen.target.config
    assert {k: getattr(cfg, k) for k in expected} == expected
    prompt_len = 15 if cfg.sliding_window is None else 3 * cfg.sliding_window
    _hf_greedy_check(hf, gen, _prompt(cfg.vocab_size, prompt_len))


def test_windows_on_every_layer_and_on_none_differ(tmp_path):
    """The two Qwen2 window cases above are not one case twice: the same weights decode
    differently with every layer windowed and with none."""
    outs = []
    for first in (0, 2):
        hf = make_hf_model("qwen2", seed=3, attn_implementation="eager", use_sliding_window=True,
                           sliding_window=5, max_window_layers=first)  # fmt: skip
        hf.save_pretrained(tmp_path / str(first))
        gen = Generator.from_pretrained(tmp_path / str(first), dtype="float64")
        outs.append(_hf_greedy_check(hf, gen, _prompt(hf.config.vocab_size, 15)))
    assert outs[0] != outs[1]


def test_gelu_changes_the_output():
    """The bug this guards against: the same weights run as SiLU decode differently."""
    hf = make_hf_model("llama", seed=3, hidden_act="gelu")
    cfg = ModelConfig.from_hf_config(hf.config)
    silu = loading.model_from_state_dict(
        attrs.evolve(cfg, hidden_act="silu"), iter(hf.state_dict().items()), dtype=torch.float64,
        device=torch.device("cpu"),
    )  # fmt: skip
    gelu = loading.model_from_state_dict(cfg, iter(hf.state_dict().items()), dtype=torch.float64,
                                         device=torch.device("cpu"))  # fmt: skip
    prompt = _prompt(cfg.vocab_size, 15)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    runs = [Generator.from_components(m).generate(prompt, params).token_ids for m in (silu, gelu)]
    assert runs[0] != runs[1]


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """act -> a tiny bf16-kernel-shaped Llama (hidden 256: the whole-stack kernel applies)."""
    paths = {}
    for act in ("silu", "gelu"):
        path = tmp_path_factory.mktemp(f"wide-{act}")
        make_hf_model(
            "llama", seed=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, intermediate_size=384, hidden_act=act,
        ).save_pretrained(path)  # fmt: skip
        paths[act] = path
    return paths


def _count_fused_calls(monkeypatch) -> dict[str, int]:
    """Counts the CPU kernel's fused SiLU ops: the one-call decoder stack and silu_mul."""
    from specdec.kernels.cpu_linear import load_kernel

    kernel, calls = load_kernel(), {"decoder_layers": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(kernel, name)

        def counted(*args, _name=name, _real=real):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(kernel, name, counted)
    return calls


@pytest.mark.usefixtures("kernel")
def test_bf16_cpu_kernels_run_silu_only(wide_checkpoints, monkeypatch):
    """On a CPU in bf16 the fused kernels compute SiLU-and-multiply: a GELU model must not take
    them (its bf16 greedy output then follows transformers'), while a SiLU model of the same
    shape does (the control: the kernels would apply here)."""
    from transformers import AutoModelForCausalLM

    calls = _count_fused_calls(monkeypatch)
    prompt = _prompt(512, 12)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    Generator.from_pretrained(wide_checkpoints["silu"], dtype="bfloat16").generate(prompt, params)
    assert calls["decoder_layers"] + calls["silu_mul"] > 0
    calls.update(decoder_layers=0, silu_mul=0)
    gen = Generator.from_pretrained(wide_checkpoints["gelu"], dtype="bfloat16")
    out = gen.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1))
    assert calls == {"decoder_layers": 0, "silu_mul": 0}
    hf = AutoModelForCausalLM.from_pretrained(wide_checkpoints["gelu"], dtype=torch.float64).eval()
    with torch.no_grad():
        ref = (
            hf(torch.tensor([prompt + out.token_ids]))
            .logits[0, len(prompt) - 1 : -1]
            .log_softmax(-1)
        )
    # bf16 against float64: each emitted token is transformers' choice or within bf16 noise of it.
    chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (ref.max(-1).values - chosen).max() < 0.1, ref.max(-1).values - chosen
