"""GGUF round trip: a tiny model written the way llama.cpp writes it loads back as that model.

Every model the README names reaches specdec as a GGUF file, either loaded directly
(``load_model("x.gguf")``) or converted once by ``specdec.hub.convert_gguf`` (what ``fetch``
does). Real GGUF checkpoints are far too big for tests, so tiny random Llama and Qwen2 models are
written here with ``gguf.GGUFWriter`` exactly as llama.cpp's ``convert_hf_to_gguf.py`` lays them
out: its tensor names and metadata keys, F32 norms and biases, and for Llama the q/k rows permuted
for llama.cpp's RoPE (which the loader must undo). Each file is written in F32 and in Q8_0.

The reference is the same model saved as safetensors, the format every other specdec test uses:
the float32 source for F32, and the source with each quantized tensor replaced by its Q8_0
round trip for Q8_0. Both loading paths must reproduce the reference's config, weights, logits
and greedy tokens.
"""

from __future__ import annotations

import copy
import re
import warnings

import attrs
import numpy as np
import pytest
import torch
from conftest import TINY_CONFIGS, make_hf_model
from helpers import ragged_prefill_logits

from specdec import Generator, SamplingParams
from specdec.hub import convert_gguf
from specdec.models.loading import load_model

gguf = pytest.importorskip("gguf")

KINDS = ("llama", "qwen2")
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
QTYPES = {"f32": F32, "q8_0": Q8_0}
# A text and its tokens under tiny_vocab's merges: "the" has no leading space, so no "Ġt".
TEXT, TEXT_TOKENS = "the the", ("t", "he", "Ġthe")
FILE_TYPES = {
    F32: gguf.LlamaFileType.ALL_F32,
    Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
}

# llama.cpp's names: top-level modules, and the modules inside each ``blk.N``.
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# --- the source models and their vocabulary ---------------------------------------------------


def tiny_vocab(size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of ``size`` tokens: single bytes, three merges, and EOS last.

    Tokens are spelled in GPT-2's byte alphabet, as llama.cpp writes a "gpt2" tokenizer.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    merged, merges = ["Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"]
    byte_order = [32, 10, *range(33, 127), *range(256)]  # space and printables first
    singles = list(dict.fromkeys(spelled[b] for b in byte_order))[: size - len(merged) - 1]
    return [*singles, *merged, "<|endoftext|>"], merges


def source_model(kind: str):
    """The float32 transformers model every file of ``kind`` is written from.

    float32 because GGUF has no float64; EOS is the vocabulary's last token, as in the file.
    Epsilon and RoPE base differ from transformers' defaults, so that a key the loader misses
    shows up as a wrong config instead of falling back to the right value by luck.
    """
    eos = TINY_CONFIGS[kind]["vocab_size"] - 1
    return make_hf_model(
        kind,
        eos_token_id=eos,
        bos_token_id=eos,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=50000.0),
    ).to(torch.float32)


def q8_0_round_trip(model):
    """A copy of ``model`` whose 2-D weights went through Q8_0 and back.

    This is what a Q8_0 file must load as. Q8_0 blocks are 32 values along a row, so quantizing
    commutes with llama.cpp's q/k permutation (it only reorders rows) and the reference needs
    no permutation.
    """
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                q = gguf.quants.quantize(p.numpy(), Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q8_0)))
    return rounded


# --- writing a GGUF as llama.cpp's converter does ---------------------------------------------


def gguf_name(hf_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``."""
    module, leaf = hf_name.rsplit(".", 1)
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{leaf}"
    layer, inner = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module).groups()
    return f"blk.{layer}.{_BLOCK_NAMES[inner]}.{leaf}"


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py, verbatim.

    llama.cpp rotates interleaved pairs (x0, x1), transformers rotates halves (x0, x_{d/2}); the
    converter reorders the rows of each q/k head so that both compute the same attention.
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama_cpp_tensor(cfg, hf_name: str, data: np.ndarray) -> np.ndarray:
    """The values llama.cpp stores for one HF tensor (before quantizing)."""
    if cfg.model_type != "llama":
        return data  # Qwen2 uses NEOX-style RoPE in llama.cpp: no permutation
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return llama_cpp_permute(data, heads, heads)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return llama_cpp_permute(data, heads, kv_heads)
    return data


def add_metadata(writer, cfg, qtype) -> None:
    """The hyperparameter keys llama.cpp's converter writes for these architectures."""
    writer.add_name(f"tiny-{cfg.model_type}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.model_type == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_tokenizer(writer, cfg) -> None:
    """A "gpt2" (byte-level BPE) tokenizer, as llama.cpp writes Qwen2's and Llama 3's."""
    tokens, merges = tiny_vocab(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if cfg.model_type == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def add_tensors(writer, model, qtype, overrides=None) -> None:
    """Every tensor under its llama.cpp name; like llama.cpp, 1-D ones (norms, biases) stay F32.
    ``overrides``: other types for some 2-D tensors, by GGUF name (as llama.cpp's mixes have)."""
    cfg = model.config
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = llama_cpp_tensor(cfg, hf_name, tensor.numpy())
        tensor_type = (overrides or {}).get(gguf_name(hf_name), qtype)
        if tensor_type == F32 or data.ndim == 1:
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(data, dtype=np.float32))
        else:
            blocks = gguf.quants.quantize(data, tensor_type)
            writer.add_tensor(gguf_name(hf_name), blocks, raw_shape=blocks.shape, raw_dtype=tensor_type)


def write_gguf(path, model, qtype, overrides=None) -> None:
    writer = gguf.GGUFWriter(str(path), model.config.model_type)
    add_metadata(writer, model.config, qtype)
    add_tokenizer(writer, model.config)
    add_tensors(writer, model, qtype, overrides)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=sorted(QTYPES))
def qtype(request):
    return QTYPES[request.param]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Factory: (kind, qtype) -> (gguf file, reference safetensors directory), built once each."""
    cache: dict = {}

    def build(kind: str, qtype):
        if (kind, qtype) not in cache:
            root = tmp_path_factory.mktemp(f"gguf-{kind}-{qtype.name}")
            model = source_model(kind)
            write_gguf(root / f"tiny-{kind}.gguf", model, qtype)
            reference = model if qtype == F32 else q8_0_round_trip(model)
            reference.save_pretrained(root / "reference", safe_serialization=True)
            cache[(kind, qtype)] = (root / f"tiny-{kind}.gguf", root / "reference")
        return cache[(kind, qtype)]

    return build


@pytest.fixture(scope="module")
def converted(files, tmp_path_factory):
    """Factory: (kind, qtype) -> the directory ``convert_gguf`` made of that GGUF, built once."""
    cache: dict = {}

    def build(kind: str, qtype):
        if (kind, qtype) not in cache:
            out = tmp_path_factory.mktemp(f"converted-{kind}-{qtype.name}")
            convert_gguf(files(kind, qtype)[0], out)
            cache[(kind, qtype)] = out
        return cache[(kind, qtype)]

    return build


# --- helpers ----------------------------------------------------------------------------------


def load(path):
    model, _, _ = load_model(path, dtype="float32")
    return model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 30)]


def assert_same_config(model, reference) -> None:
    # GGUF stores the epsilon as float32, and 1e-6 does not survive that exactly.
    assert model.config.rms_norm_eps == pytest.approx(reference.config.rms_norm_eps, rel=1e-6)
    same_eps = attrs.evolve(model.config, rms_norm_eps=reference.config.rms_norm_eps)
    assert same_eps == reference.config


def assert_same_logits(model, reference) -> None:
    # Same weights in float32 through the same kernels: any difference beyond rounding noise
    # is a loading bug (a q/k permutation alone moves logits by O(1)).
    batch = prompts(reference.config.vocab_size)
    for ours, ref in zip(ragged_prefill_logits(model, batch), ragged_prefill_logits(reference, batch)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def bf16_rounded(model):
    """``model`` with every weight rounded to bfloat16, the dtype ``convert_gguf`` saves."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


# --- tests ------------------------------------------------------------------------------------


def test_written_file_is_in_llama_cpp_layout(files, kind, qtype):
    """Guards the writer itself, so that the tests below cannot pass vacuously."""
    path, _ = files(kind, qtype)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == qtype and types["blk.1.ffn_down.weight"] == qtype
    assert types["output_norm.weight"] == F32 and types["blk.0.attn_norm.weight"] == F32
    assert ("output.weight" in types) == (kind == "llama")  # tiny Qwen2 ties its embeddings
    assert ("blk.0.attn_q.bias" in types) == (kind == "qwen2")
    assert reader.fields[f"{kind}.attention.head_count_kv"].contents() == 2


def test_gguf_loads_as_its_source(files, kind, qtype):
    """``load_model`` on the .gguf gives the reference's config and bit-identical weights."""
    path, reference_dir = files(kind, qtype)
    model, reference = load(path), load(reference_dir)
    assert_same_config(model, reference)
    ours, ref = model.state_dict(), reference.state_dict()
    assert ours.keys() == ref.keys()
    mismatched = [name for name in ref if not torch.equal(ours[name], ref[name])]
    assert not mismatched, f"weights differ from the source: {mismatched}"


def test_gguf_logits_match_source(files, kind, qtype):
    path, reference_dir = files(kind, qtype)
    assert_same_logits(load(path), load(reference_dir))


def test_q8_0_weights_within_quantization_error(files, kind):
    """The Q8_0 file loads as the float source up to Q8_0's own error, and not closer.

    Q8_0 stores blocks of 32 values along a row as int8 multiples of d = absmax / 127, with d
    in float16: a value moves by at most d / 2 (rounding) + 127 * d * 2**-11 (the f16 scale),
    i.e. absmax * (1/254 + 2**-11) of its block. Nothing may move more (a misplaced tensor
    would), and every matrix must move (or the Q8_0 cases would only repeat the F32 ones).
    """
    quantized = load(files(kind, Q8_0)[0]).state_dict()
    source = load(files(kind, F32)[1]).state_dict()
    for name, weight in source.items():
        if weight.dim() == 1:
            assert torch.equal(quantized[name], weight), f"{name} is F32 in the file"
            continue
        blocks, error = weight.reshape(-1, 32), (quantized[name] - weight).reshape(-1, 32)
        bound = blocks.abs().amax(dim=1, keepdim=True) * (1 / 254 + 2**-11) * (1 + 1e-6)
        assert (error.abs() <= bound).all(), f"{name} moved by more than Q8_0 rounding"
        assert error.abs().max() > 0, f"{name} was not quantized"


def test_convert_gguf_round_trip(files, converted, kind, qtype):
    """``convert_gguf`` then ``load_model``: the reference rounded to bfloat16, as documented."""
    out = converted(kind, qtype)
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    model, reference = load(out), bf16_rounded(load(files(kind, qtype)[1]))
    assert_same_config(model, reference)
    assert_same_logits(model, reference)


def test_convert_gguf_saves_the_tokenizer(converted, kind):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted(kind, F32))
    tokens, _ = tiny_vocab(len(tokenizer))
    assert tokenizer.get_vocab() == {token: i for i, token in enumerate(tokens)}
    assert tokenizer.encode(TEXT) == [tokens.index(t) for t in TEXT_TOKENS]


def test_greedy_generation_matches_source_f32(files, kind):
    path, reference_dir = files(kind, F32)
    model, reference = load(path), load(reference_dir)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batch = prompts(reference.config.vocab_size)
    ours = Generator.from_components(model).generate(batch, params)
    ref = Generator.from_components(reference).generate(batch, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]


def test_generator_from_pretrained_gguf(files, kind):
    """The user-facing path: ``Generator.from_pretrained`` reads model and tokenizer from it."""
    path, reference_dir = files(kind, F32)
    gen = Generator.from_pretrained(path, dtype="float32")
    tokens, _ = tiny_vocab(gen.target.config.vocab_size)
    ids = gen.encode(TEXT)
    assert ids == [tokens.index(t) for t in TEXT_TOKENS]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = Generator.from_components(load(reference_dir)).generate([ids], params)[0]
    assert gen.generate([TEXT], params)[0].token_ids == ref.token_ids


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1"])
def test_q4_load_keeps_the_files_4bit_codes(tmp_path, kind, qtype_name):
    """``quantization="q4"`` on a 4-bit GGUF takes its blocks as they are: every linear layer
    dequantizes exactly to the file's own dequantization (Llama's q/k rows un-permuted), with
    no warning since no tensor had to be quantized anew; greedy decoding runs on it."""
    import warnings

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    path = tmp_path / f"tiny-{kind}.gguf"
    write_gguf(path, source_model(kind), qtype)
    dense = load(path)  # the file dequantized densely, in float32 (as transformers' reader does)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q4, _, _ = load_model(path, dtype="float32", quantization="q4")
    dense_linears = {n: m for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)}
    q4_linears = {n: m for n, m in q4.named_modules() if hasattr(m, "dequantized")}
    assert set(q4_linears) == set(dense_linears)
    for name, module in q4_linears.items():
        assert torch.equal(module.dequantized(), dense_linears[name].weight.float()), name
    out = Generator.from_components(q4).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.usefixtures("kernel")
def test_q4_load_of_an_8bit_gguf_says_what_it_quantized(files, kind):
    with pytest.warns(UserWarning, match=r"kept the file's 4-bit codes of 0 tensors and quantized \d+ others"):
        load_model(files(kind, Q8_0)[0], dtype="float32", quantization="q4")


# --- q4 read straight from the file -------------------------------------------------------------

Q4_0, Q4_1, F16 = (getattr(gguf.GGMLQuantizationType, n) for n in ("Q4_0", "Q4_1", "F16"))
# A mix as llama.cpp's Q4 files have: mostly Q4_0, some Q4_1, some 8- and 16-bit tensors that
# q4 must quantize anew (Llama's layer-0 q rows among them: their un-permutation is checked on
# dense values), and an F16 embedding (for tied Qwen2, also its LM head).
MIXED = {
    "blk.0.attn_q.weight": Q8_0,
    "blk.0.attn_k.weight": Q4_1,
    "blk.1.attn_v.weight": Q8_0,
    "blk.0.ffn_down.weight": F16,
    "blk.1.ffn_up.weight": Q4_1,
    "output.weight": Q8_0,
    "token_embd.weight": F16,
}
LAYOUTS = {"q4_0": None, "mixed": MIXED}


@pytest.fixture(scope="module")
def q4_files(tmp_path_factory):
    """Factory: (kind, layout) -> a GGUF file of mostly 4-bit tensors, written once each."""
    cache: dict = {}

    def build(kind: str, layout: str):
        if (kind, layout) not in cache:
            path = tmp_path_factory.mktemp(f"gguf-q4-{kind}-{layout}") / f"tiny-{kind}.gguf"
            write_gguf(path, source_model(kind), Q4_0, LAYOUTS[layout])
            cache[(kind, layout)] = path
        return cache[(kind, layout)]

    return build


def _gguf_parts(cfg, module: str) -> list[tuple[str, int]]:
    """(GGUF name, rows) of the parts of one of specdec's linear modules, in fused order."""
    if module == "lm_head":
        return [("token_embd.weight" if cfg.tie_word_embeddings else "output.weight", cfg.vocab_size)]
    layer, inner = re.fullmatch(r"layers\.(\d+)\.(.+)", module).groups()
    kv = cfg.num_kv_heads * cfg.head_dim
    parts = {
        "self_attn.qkv_proj": [("attn_q", cfg.num_heads * cfg.head_dim), ("attn_k", kv), ("attn_v", kv)],
        "self_attn.o_proj": [("attn_output", cfg.hidden_size)],
        "mlp.gate_up_proj": [("ffn_gate", cfg.intermediate_size), ("ffn_up", cfg.intermediate_size)],
        "mlp.down_proj": [("ffn_down", cfg.hidden_size)],
    }[inner]
    return [(f"blk.{layer}.{name}.weight", rows) for name, rows in parts]


def dense_then_q4(path, dtype):
    """The q4 model as ``load_model`` built it before reading GGUF files directly: the dense
    load, then every linear layer quantized, taking the file's codes for its 4-bit parts
    (Llama's q/k rows un-permuted) and quantizing the dense weights of the others."""
    from specdec.kernels.cpu_q4 import quantize_q4
    from specdec.models.gguf_q4 import _DECODERS, _reverse_permute_rows
    from specdec.models.quantized import quantize_linears

    model, _, _ = load_model(path, dtype=dtype, pack=False)
    cfg, tensors = model.config, {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    codes = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        pieces, start, cols = [], 0, module.weight.shape[1]
        for name, rows in _gguf_parts(cfg, module_name):
            t = tensors[name]
            if t.tensor_type.name in _DECODERS:
                blocks = np.ascontiguousarray(t.data).reshape(rows * cols // 32, -1)
                q, d, c = (torch.from_numpy(np.ascontiguousarray(x)) for x in _DECODERS[t.tensor_type.name](blocks))
                found = (q.view(rows, cols // 32, 32), d.view(rows, -1), c.view(rows, -1))
                if kind_of(path) == "llama" and ".attn_q." in name:
                    found = _reverse_permute_rows(found, cfg.num_heads)
                elif kind_of(path) == "llama" and ".attn_k." in name:
                    found = _reverse_permute_rows(found, cfg.num_kv_heads)
                pieces.append(found)
            else:
                pieces.append(quantize_q4(module.weight[start : start + rows]))
            start += rows
        codes[module_name] = tuple(torch.cat(p) for p in zip(*pieces))
    return quantize_linears(model, "q4", codes)


def kind_of(path) -> str:
    return path.stem.removeprefix("tiny-")


def load_q4(path, dtype="bfloat16"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mixed files' re-quantized tensors
        model, _, _ = load_model(path, dtype=dtype, quantization="q4")
    return model


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_q4_from_the_file_equals_dense_then_quantized(q4_files, kind, layout, dtype):
    """Every packed buffer, bias, norm and the embedding of the directly read q4 model equal, bit
    for bit, those of the dense load quantized afterwards (mixed files included: re-quantized
    tensors round to ``dtype`` first, as the dense load does); so do the layers' dtypes."""
    path = q4_files(kind, layout)
    ours, ref = load_q4(path, dtype), dense_then_q4(path, dtype)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    assert sum(name.endswith(".packed") for name in a) == 4 * ref.config.num_layers + 1
    assert ("layers.0.self_attn.qkv_proj.bias" in a) == (kind == "qwen2")
    differ = [name for name in b if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]
    assert not differ, f"differ from dense-then-quantized: {differ}"
    layers = {n: (type(m), m.out_dtype, m.weight_dtype) for n, m in ref.named_modules() if hasattr(m, "packed")}
    assert {n: (type(m), m.out_dtype, m.weight_dtype) for n, m in ours.named_modules() if hasattr(m, "packed")} == layers
    assert torch.equal(ours.inv_freq, ref.inv_freq) and ours.config == ref.config


@pytest.mark.usefixtures("kernel")
def test_q4_from_the_file_generates_as_dense_then_quantized(q4_files, kind):
    path = q4_files(kind, "mixed")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batch = prompts(TINY_CONFIGS[kind]["vocab_size"])
    ours = Generator.from_components(load_q4(path)).generate(batch, params)
    ref = Generator.from_components(dense_then_q4(path, "bfloat16")).generate(batch, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]


@pytest.mark.usefixtures("kernel")
def test_q4_from_the_file_never_builds_the_dense_model(q4_files, kind, monkeypatch):
    """Neither transformers' dense model nor specdec's dense assembly runs; the warning names the
    non-4-bit linear weights of the mixed file (the F16 embedding is one only where tied)."""
    import transformers

    import specdec.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a q4 GGUF load built a dense model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(loading, "model_from_state_dict", refuse)
    head = "token_embd" if kind == "qwen2" else "output"
    kinds = ", ".join(sorted(["attn_q", "attn_v", "ffn_down", head]))
    with pytest.warns(UserWarning, match=rf"codes of 11 tensors and quantized 4 others \({kinds}\)"):
        model, _, _ = load_model(q4_files(kind, "mixed"), quantization="q4")
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and not model.embed_tokens.weight.is_meta
    assert all(not t.is_meta for t in model.state_dict().values())
    out = Generator.from_components(model).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


# --- one parse of the file per load -------------------------------------------------------------


def count_parses(monkeypatch) -> dict[str, int]:
    """From now on, count specdec's header reads and gguf-py reader constructions (the parse
    transformers' GGUF loading does for the config, the model and the tokenizer)."""
    from specdec.models.gguf_file import GgufFile

    counts = {"GgufFile.read": 0, "GGUFReader": 0}
    read, init = GgufFile.read.__func__, gguf.GGUFReader.__init__

    def counting_read(cls, path):
        counts["GgufFile.read"] += 1
        return read(cls, path)

    def counting_init(self, *args, **kwargs):
        counts["GGUFReader"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(GgufFile, "read", classmethod(counting_read))
    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    return counts


@pytest.mark.parametrize("quantization", [None, "int8", "q4"])
def test_a_load_parses_the_file_once(files, kind, quantization, monkeypatch):
    import warnings

    path, _ = files(kind, Q8_0)
    counts = count_parses(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # q4 of an 8-bit file says what it quantized
        load_model(path, dtype="float32", quantization=quantization)
    assert counts == {"GgufFile.read": 1, "GGUFReader": 0}


def test_the_tokenizer_is_autotokenizers_with_fewer_parses(files, kind, monkeypatch):
    """The same class and tokens as AutoTokenizer's own choice, with one parse less where this
    transformers names a tokenizer after the model type (else AutoTokenizer decides alone)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from specdec.codec import load_tokenizer

    path, _ = files(kind, F32)
    counts = count_parses(monkeypatch)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs, counts["GGUFReader"] = counts["GGUFReader"], 0
    ours = load_tokenizer(path)
    assert type(ours) is type(reference) and ours.get_vocab() == reference.get_vocab()
    assert ours(TEXT)["input_ids"] == reference(TEXT)["input_ids"] and ours.eos_token_id == reference.eos_token_id
    named = bool(TOKENIZER_MAPPING_NAMES.get(kind))
    assert counts["GGUFReader"] < theirs if named else counts["GGUFReader"] == theirs


def test_header_config_is_transformers_config(files, kind, qtype):
    from transformers import AutoConfig

    from specdec.models.gguf_file import GgufFile
    from specdec.models.llama import ModelConfig

    path, _ = files(kind, qtype)
    ours = GgufFile.read(path).hf_config()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ModelConfig.from_hf_config(ours) == ModelConfig.from_hf_config(theirs)
    public = lambda config: {k: v for k, v in config.to_dict().items() if not k.startswith("_")}  # noqa: E731
    assert public(ours) == public(theirs)


def test_header_reads_what_gguf_py_reads(files, kind, qtype):
    """Every tensor's type, shape and bytes, and every metadata value (an array of strings by
    its length), as gguf-py's reader has them."""
    from specdec.models.gguf_file import GgufFile

    path, _ = files(kind, qtype)
    file, reader = GgufFile.read(path), gguf.GGUFReader(str(path))
    assert list(file.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        ours = file.tensors[tensor.name]
        assert ours.tensor_type == tensor.tensor_type and ours.shape == tuple(int(s) for s in tensor.shape)
        assert ours.data.tobytes() == tensor.data.tobytes()
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own version and counts
        value = field.contents()
        strings = isinstance(value, list) and value and isinstance(value[0], str)
        assert file.metadata[key] == (len(value) if strings else value), key


def test_header_refuses_what_is_not_a_whole_gguf(files, tmp_path):
    from specdec.models.gguf_file import GgufFile

    data = files("qwen2", F32)[0].read_bytes()
    cases = {
        "cut.gguf": (data[: len(data) - 100], "cut.gguf is cut short: tensor .* ends past the end"),
        "header.gguf": (data[:200], "header.gguf is cut short inside its header"),
        "other.gguf": (b"PK\x03\x04" + data[4:], "other.gguf is not a GGUF file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message):
            load_model(tmp_path / name)
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="phi.gguf: GGUF architecture 'phi2' is not supported"):
        GgufFile.read(tmp_path / "phi.gguf").hf_config()
