"""specdec.logits.grammar: structured-output masks, on the bundled stories260K tokenizer.

Outputs walked by picking random allowed tokens until EOS must satisfy their schema, regex or
choice; a step's masked rows (chains, trees, any order) must equal fresh per-prefix masks and
leave the state where it was; bad grammars fail naming their field; padding columns are never
allowed; compiled grammars are cached within bounds.
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading

import pytest
import torch

pytest.importorskip("xgrammar")

from transformers import AutoTokenizer  # noqa: E402

from specdec.config import StructuredOutput  # noqa: E402
from specdec.logits.grammar import (  # noqa: E402
    GrammarCompiler,
    apply_bitmask,
    apply_bitmask_cpu,
    bitmask_words,
)

VOCAB = 512  # stories260K's vocabulary and logits width
EOS = 2
# Byte tokens 0x80-0xFF: xgrammar accepts some invalid UTF-8 (overlong) byte sequences, which
# decode to U+FFFD; the walks test structure, so they pick these only when nothing else is left.
HIGH_BYTES = frozenset(range(3 + 0x80, 3 + 0x100))

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", 3, None]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id"],
        },
        "nick": {"type": "string", "minLength": 1, "maxLength": 4},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
EMAIL = r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ("yes", "no way", 'say "hi"', "back\\slash", "two\nlines")


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def allowed(state, output, extension=()) -> list[int]:
    """The ids the state allows after ``output + extension`` (one masked row)."""
    logits = torch.zeros(1, VOCAB)
    state.mask_rows(output, [list(extension)], logits)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def walk(state, seed: int, max_tokens: int = 400) -> list[int]:
    """Random allowed tokens until EOS (taken half the time it is allowed); the output
    without EOS. The state has consumed the EOS and ended."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < max_tokens:
        ids = allowed(state, out)
        assert ids, f"no allowed token after {out}"
        if EOS in ids and (len(ids) == 1 or rng.random() < 0.5):
            state.sync([*out, EOS])
            assert state.ended
            return out
        ids = [t for t in ids if t != EOS]
        out.append(rng.choice([t for t in ids if t not in HIGH_BYTES] or ids))
    pytest.fail(f"no EOS within {max_tokens} tokens")


def encode(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` without the lone prefix-space piece the tokenizer puts first."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[1:] if tokenizer.convert_ids_to_tokens(ids[0]) == "\u2581" else ids


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def check_record(obj) -> None:
    """RECORD by hand (and by jsonschema when it is installed)."""
    assert isinstance(obj, dict)
    assert set(RECORD["required"]) <= set(obj) <= set(RECORD["properties"])
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert obj["kind"] in ("cat", "dog", 3, None)
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert 1 <= len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b"}
    assert isinstance(obj["owner"]["id"], int) and set(obj["owner"]) <= {"id", "ok"}
    if "nick" in obj:
        assert 1 <= len(obj["nick"]) <= 4
    if "score" in obj:
        assert isinstance(obj["score"], (int, float))
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(obj, RECORD)


# ----------------------------------------------------------------------------- (a) outputs


def test_json_schema_walks_validate(compiler, tokenizer):
    spec = StructuredOutput(json_schema=RECORD)
    for seed in range(12):
        text = text_of(tokenizer, walk(compiler.new_state(spec), seed))
        check_record(json.loads(text))  # json.loads is strict: no raw control characters


def test_regex_and_choice_walks_match(compiler, tokenizer):
    email = StructuredOutput(regex=EMAIL)
    for seed in range(8):
        assert re.fullmatch(EMAIL, text_of(tokenizer, walk(compiler.new_state(email), seed)))
    choice = StructuredOutput(choice=CHOICES)
    seen = {text_of(tokenizer, walk(compiler.new_state(choice), seed)) for seed in range(30)}
    assert seen <= set(CHOICES) and len(seen) >= 3


def test_json_object_and_empty_schema_start_an_object(compiler, tokenizer):
    for spec in (StructuredOutput(json_object=True), StructuredOutput(json_schema={})):
        state = compiler.new_state(spec)
        first = allowed(state, [])
        assert EOS not in first
        for t in first:
            text = text_of(tokenizer, [t]).strip()
            assert text == "" or text.startswith("{"), text
        closed = encode(tokenizer, "{}")
        assert EOS in allowed(state, [], closed)


def test_eos_only_where_complete_and_refused_token_ends(compiler, tokenizer):
    state = compiler.new_state(StructuredOutput(regex=r"[0-9]{2}"))
    digits = [t for t in allowed(state, []) if text_of(tokenizer, [t]).isdigit()]
    one = next(t for t in digits if len(text_of(tokenizer, [t])) == 1)
    assert EOS not in allowed(state, []) and EOS not in allowed(state, [], [one])
    assert allowed(state, [], [one, one]) == [EOS]
    letter = tokenizer.convert_tokens_to_ids("a")
    state.sync([one, letter])  # a stop token the grammar refuses: ended, no exception
    assert state.ended and state.consumed == 2 and allowed(state, [one, letter]) == []
    with pytest.raises(ValueError, match="only grows"):
        state.sync([one])


# ----------------------------------------------------------------------------- (b) rows


def masked(state, output, extensions, logits) -> torch.Tensor:
    out = logits.clone()
    state.mask_rows(output, extensions, out)
    return out


def fresh_rows(compiler, spec, output, extensions, logits) -> torch.Tensor:
    """Each row from a new state synced to ``output + extension`` (the definition)."""
    rows = []
    for r, ext in enumerate(extensions):
        state = compiler.new_state(spec)
        rows.append(masked(state, [*output, *ext], [[]], logits[r : r + 1]))
    return torch.cat(rows)


@pytest.fixture(scope="module")
def record_walk(compiler):
    spec = StructuredOutput(json_schema=RECORD)
    return spec, walk(compiler.new_state(spec), seed=3)


def test_chain_rows_equal_fresh_masks(compiler, record_walk):
    spec, out = record_walk
    g = torch.Generator().manual_seed(0)
    state = compiler.new_state(spec)
    bad = tokenizer_bad_token(compiler, spec, out[:10])
    cases = [
        (out[:5], out[5:13]),  # a valid chain
        (out[:10], [*out[10:13], bad, *out[14:17]]),  # leaves the grammar at draft 3
        (out[:-3], [*out[-3:], EOS, out[0]]),  # completes, stops, then runs past the stop
    ]
    for output, drafts in cases:
        rows = [drafts[:r] for r in range(len(drafts) + 1)]
        logits = torch.randn(len(rows), VOCAB, generator=g)
        before = allowed(state, output)
        got = masked(state, output, rows, logits)
        assert torch.equal(got, fresh_rows(compiler, spec, output, rows, logits))
        assert state.consumed == len(output) and allowed(state, output) == before
    assert torch.isinf(got[-1]).all() and torch.isinf(got[-2]).all()  # after EOS: nothing


def tokenizer_bad_token(compiler, spec, output) -> int:
    """An id the grammar refuses after ``output``."""
    ok = set(allowed(compiler.new_state(spec), output))
    return next(t for t in range(3, VOCAB) if t not in ok)


def test_tree_rows_in_any_order_equal_fresh_masks(compiler, record_walk):
    spec, out = record_walk
    a, b, c = out[8], out[9], out[10]
    bad = tokenizer_bad_token(compiler, spec, out[:8])
    other = next(t for t in allowed(compiler.new_state(spec), out[:8]) if t != a)
    tree = [[], [a], [other], [a, b], [a, bad], [a, b, c], [bad], [bad, a], [a, b, c, out[11]]]
    g = torch.Generator().manual_seed(1)
    state = compiler.new_state(spec)
    for order in (tree, tree[::-1], random.Random(0).sample(tree, len(tree))):
        logits = torch.randn(len(order), VOCAB, generator=g)
        got = masked(state, out[:8], order, logits)
        assert torch.equal(got, fresh_rows(compiler, spec, out[:8], order, logits))
        dead = [r for r, ext in enumerate(order) if bad in ext]
        alive = torch.isfinite(got).any(dim=-1)  # [rows] bool
        assert alive.tolist() == [r not in dead for r in range(len(order))]
    assert allowed(state, out[:8]) == allowed(compiler.new_state(spec), out[:8])


def test_long_chain_rolls_back(compiler, tokenizer):
    """A 64-draft chain (the widest draft) is masked and rolled back exactly."""
    spec = StructuredOutput(regex=r"[a-z ]{1,100}")
    state = compiler.new_state(spec)
    story = "once upon a time there was a little girl named lily who loved to play in the park "
    drafts = encode(tokenizer, story * 3)[:64]
    assert len(drafts) == 64
    rows = [drafts[:r] for r in range(65)]
    logits = torch.randn(65, VOCAB, generator=torch.Generator().manual_seed(2))
    got = masked(state, [], rows, logits)
    assert torch.equal(got, fresh_rows(compiler, spec, [], rows, logits))
    assert allowed(state, []) == allowed(compiler.new_state(spec), [])


# ----------------------------------------------------------------------------- (c) errors


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(json_schema='{"type": "foo"}'), "json_schema"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(json_schema="[1, 2]"), "json_schema"),
        (dict(json_schema={"type": "object", "properties": 5}), "json_schema"),
        (dict(regex="(ab"), "regex"),
        (dict(regex="[a-"), "regex"),
        (dict(grammar='root ::= "a" | missing'), "grammar"),
        (dict(grammar='start ::= "a"'), "grammar"),
        (dict(grammar="root := 'a'"), "grammar"),
    ],
)
def test_malformed_grammar_names_its_field(compiler, spec, field):
    held = len(compiler)
    with pytest.raises(ValueError, match=rf"^structured_output\.{field} "):
        compiler.compile(StructuredOutput(**spec))
    assert len(compiler) == held  # nothing half-done in the cache


def test_bad_arguments(tokenizer, compiler):
    with pytest.raises(TypeError, match="StructuredOutput"):
        compiler.compile({"regex": "a"})
    with pytest.raises(ValueError, match="eos_token_ids"):
        GrammarCompiler(tokenizer, VOCAB, [VOCAB])
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tokenizer, 0, [EOS])
    with pytest.raises(ValueError, match="rows"):
        state = compiler.new_state(StructuredOutput(regex="a"))
        state.mask_rows([], [[], []], torch.zeros(1, VOCAB))


def test_missing_backend_says_what_to_install(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match="pip install"):
        GrammarCompiler(tokenizer, VOCAB, [EOS])


# ----------------------------------------------------------------------------- (d) widths


def test_padding_columns_are_never_allowed(tokenizer):
    padded = GrammarCompiler(tokenizer, VOCAB + 8, [EOS])  # 8 padding ids past the tokenizer
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"s": {"type": "string"}}})
    state = padded.new_state(spec)
    inside = encode(tokenizer, '{"s": "')
    for width in (VOCAB + 8, VOCAB + 20):  # the model's width, and a wider draft's
        logits = torch.zeros(2, width)
        state.mask_rows([], [[], inside], logits)
        assert torch.isinf(logits[:, VOCAB:]).all()
        assert torch.isfinite(logits[1]).sum() > 100  # inside a string most ids are allowed
        assert torch.isinf(logits[1, [0, 1, EOS]]).all()  # but not <unk>, <s> or EOS
    narrow = torch.zeros(2, 300)  # a narrower draft: the mask's first 300 columns
    state.mask_rows([], [[], inside], narrow)
    assert torch.equal(narrow, logits[:, :300])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [100, 150, 200])
def test_cpu_apply_matches_torch_reference(dtype, width):
    vocab = 150
    g = torch.Generator().manual_seed(width)
    shape = (3, bitmask_words(vocab))
    bitmask = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=g)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    logits = torch.randn(3, width, generator=g).to(dtype)
    want, got = logits.clone(), logits.clone()
    apply_bitmask(want, bitmask, vocab)
    apply_bitmask_cpu(got, bitmask, vocab)
    assert torch.equal(got, want)
    bits = [(int(bitmask[2, t // 32]) >> (t % 32)) & 1 for t in range(min(width, vocab))]
    assert torch.isfinite(want[2, : len(bits)]).tolist() == [bool(b) for b in bits]
    assert torch.isinf(want[0]).all() and torch.isinf(want[1, vocab:]).all()
    assert torch.equal(want[1, :vocab], logits[1, :vocab])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_equal_cpu_rows(compiler, record_walk):
    spec, out = record_walk
    rows = [out[5:5 + r] for r in range(9)]
    logits = torch.randn(len(rows), VOCAB + 4, generator=torch.Generator().manual_seed(3))
    state = compiler.new_state(spec)
    on_gpu = logits.cuda()
    state.mask_rows(out[:5], rows, on_gpu)
    assert torch.equal(on_gpu.cpu(), masked(state, out[:5], rows, logits))


# ----------------------------------------------------------------------------- (e) cache


def test_cache_returns_the_same_object_within_bounds(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)
    first = small.compile(StructuredOutput(choice=["a", "b"]))
    assert small.compile(StructuredOutput(choice=("a", "b"))) is first
    for pattern in ("x+", "y+", "z+"):
        small.compile(StructuredOutput(regex=pattern))
        assert len(small) <= 2
    assert small.compile(StructuredOutput(choice=["a", "b"])) is not first  # evicted
    kept = small.compile(StructuredOutput(regex="z+"))
    small.compile(StructuredOutput(regex="x+"))
    assert small.compile(StructuredOutput(regex="z+")) is kept  # recently used, kept


def test_concurrent_compiles_share_one_object(compiler):
    spec = StructuredOutput(json_schema={"type": "object", "properties": {"n": {"type": "number"}}})
    got = []
    threads = [threading.Thread(target=lambda: got.append(compiler.compile(spec))) for _ in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(g is got[0] for g in got)
