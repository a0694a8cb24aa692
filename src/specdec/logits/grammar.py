"""Structured output: a request's grammar as a mask on every verify row, on xgrammar.

A :class:`GrammarCompiler` (one per tokenizer and logits width) compiles each
:class:`~specdec.config.StructuredOutput` once; a :class:`GrammarState` (one per request)
follows the request's committed output and masks a verify step's rows: row ``r`` keeps only
the tokens the grammar allows after ``output + extensions[r]``. Masking every row with its own
history keeps speculation lossless; a draft that leaves the grammar gets an all ``-inf`` row.

Why xgrammar and not llguidance (``python -m benchmarks.grammar_mask_cost``, results in
``benchmarks/results/grammar-mask-cost-20261204-2026.json``: Qwen2.5-Coder's vocabulary of
151,936 ids, AMD EPYC Zen 4 (AVX-512), one thread, xgrammar 0.2.9, llguidance 1.9.1; the mask
of one position in µs, mean over a valid output's walk with warm caches, the first walk in
brackets):

==================  ======  ==============  ===============  ====================
grammar             tokens  xgrammar mask   llguidance mask  compile ms (xgr/llg)
==================  ======  ==============  ===============  ====================
nested JSON schema  125     11.0 (13.3)     15.1 (77.6)      37.1 / 1.1
any JSON object     28      16.7 (20.1)     18.6 (35.2)      18.5 / 0.3
email regex         12      15.5 (20.3)     123.3 (481.2)    13.4 / 0.7
date regex          11      1.4 (2.1)       7.2 (62.8)       0.2 / 0.9
choice of 4         5       1.4 (2.9)       13.7 (48.6)      0.3 / 0.7
arithmetic EBNF     24      2.7 (3.4)       9.0 (13.8)       0.2 / 1.2
==================  ======  ==============  ===============  ====================

xgrammar precomputes the masks of context-independent tokens when it compiles, so the per-row
cost, paid ``k + 1`` times a speculative step, is lower on every grammar and steadier (at most
105 µs, where llguidance's first masks reach 4.5-5.5 ms); it rolls back for 0.02-0.09 µs a
token (llguidance 0.04-13 µs), without a depth limit, and reads the tokenizer in 0.6 s (3.3 s).
llguidance compiles faster (about 1 ms against up to 37 ms), but a compile happens once per
schema and is cached here. Neither's batched draft call beats the plain loop below on chains
(xgrammar's ``traverse_draft_tree``: 13.5 µs a row against 12.1 µs on the nested schema).

llguidance is the more faithful JSON-schema compiler: xgrammar 0.2.9 lets a string with
``minLength``/``maxLength`` hold raw control characters (invalid JSON), which
:func:`_bounded_strings_as_patterns` works around, and accepts some invalid (overlong) UTF-8
byte sequences that a model does not produce in practice. The API here does not expose the
backend, so it can change without callers noticing.

The grammar is the smaller part of :meth:`GrammarState.mask_rows`' cost: 70-210 µs a row on
that vocabulary (mean over 8-draft chains), mostly spent writing ``-inf`` over 152k columns.

Formats: ``json_schema`` is xgrammar's JSON schema (strict: no properties beyond the schema's;
any whitespace between tokens; properties in schema order; no escapes in a string with a
pattern or a length bound), ``{}`` and ``json_object`` any JSON object; ``regex`` xgrammar's
(ECMAScript-like: no lookaround, no ``\\p{..}``); ``choice`` the exact strings; ``grammar``
GBNF-style EBNF (llama.cpp's) with a rule named ``root``. Special tokens (BOS, UNK, chat
markers) are never allowed; the EOS ids given are the stop tokens, allowed where the structure
is complete.

Example:
    >>> compiler = GrammarCompiler(tokenizer, vocab_size=512, eos_token_ids=[2])  # doctest: +SKIP
    >>> state = compiler.new_state(StructuredOutput(choice=["yes", "no"]))  # doctest: +SKIP
    >>> logits = torch.randn(2, 512)  # [rows, vocab]: the step's rows, the 2nd after one draft
    >>> state.mask_rows(output_ids=[], extensions=[[], [draft]], logits=logits)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from specdec.config import StructuredOutput, check_arg, non_negative_int, positive_int

__all__ = [
    "GrammarCompiler",
    "GrammarState",
    "apply_bitmask",
    "apply_bitmask_cpu",
    "bitmask_words",
]

# Whitespace characters allowed between two JSON tokens (a newline and 11 spaces of indent).
JSON_MAX_WHITESPACE = 12

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false: )?")


def _xgrammar():
    """The ``xgrammar`` module, or ImportError saying how to get it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(
            "structured output (SamplingParams.structured_output) needs xgrammar: "
            "pip install 'specdec[structured]' (or 'xgrammar>=0.2.9')"
        ) from err
    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per bitmask row: bit ``t % 32`` of word ``t // 32`` is token ``t``."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """In place: ``-inf`` wherever a token's bit is 0, and at every column ``>= vocab_size``.

    The pure-torch reference, for any device and float dtype; :meth:`GrammarState.mask_rows`
    takes it for CUDA logits and :func:`apply_bitmask_cpu` for CPU ones.

    Args:
        logits: ``[rows, width]`` float, any device. A ``width`` below ``vocab_size`` uses the
            first ``width`` bits of each row.
        bitmask: ``[rows, bitmask_words(vocab_size)]`` int32, any device (copied to the logits').
        vocab_size: the ids the bitmask describes.

    Example:
        >>> logits = torch.zeros(1, 40)
        >>> apply_bitmask(logits, torch.tensor([[0b101, 0]], dtype=torch.int32), vocab_size=36)
        >>> (logits[0] == 0).nonzero().flatten().tolist()
        [0, 2]
    """
    rows, width = logits.shape
    n = min(width, vocab_size)
    if width > n:
        logits[:, n:] = -torch.inf
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    words = bitmask.to(logits.device)[:, : bitmask_words(n)]  # [rows, ceil(n / 32)] int32
    keep = ((words.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :n]  # [rows, n] int32
    logits[:, :n].masked_fill_(keep == 0, -torch.inf)


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """:func:`apply_bitmask` for CPU logits on a little-endian machine, without branches: numpy
    unpacks the bits, builds ``+inf`` (keep) / ``-inf`` (drop) from them as integers, and takes
    the minimum with the logits in place.

    ~0.4-0.6 ms for ``[9, 151936]`` float32 on one core whatever the mask, where the torch
    reference takes 2-6 ms, a ``where=`` copy 0.5-5.6 ms (slow on mixed masks: branches) and
    xgrammar's CPU kernel 2.8-5.3 ms (slowest on the usual mask, a few allowed ids).

    Args:
        logits: ``[rows, width]`` float on the CPU.
        bitmask: ``[rows, bitmask_words(vocab_size)]`` int32 on the CPU.
        vocab_size: the ids the bitmask describes.
    """
    width = logits.shape[1]
    n = min(width, vocab_size)
    if width > n:
        logits[:, n:] = -torch.inf
    # Little-endian int32 words as bytes put token t at byte t // 8, bit t % 8: numpy's
    # "little" bit order. Inverting the packed bytes gives the ids to drop directly.
    packed = ~bitmask.contiguous().numpy().view(np.uint8)  # [rows, 4 * words] uint8
    drop = np.unpackbits(packed, axis=-1, count=n, bitorder="little")  # [rows, n] uint8 0/1
    head = logits.detach()[:, :n]  # [rows, n], a view: writes land in logits
    if head.dtype not in _UINT_OF:  # bfloat16 has no numpy dtype
        head.masked_fill_(torch.from_numpy(drop.view(np.bool_)), -torch.inf)
        return
    values = head.numpy()
    uint = _UINT_OF[head.dtype]
    bound = drop.astype(uint)  # [rows, n]: 1 where dropped
    bound <<= 8 * bound.itemsize - 1  # the sign bit where dropped
    bound |= np.array(np.inf, dtype=values.dtype).view(uint)  # -inf where dropped, else +inf
    np.minimum(values, bound.view(values.dtype), out=values)


# The unsigned integer of each float's width, to build +-inf from bits.
_UINT_OF = {torch.float16: np.uint16, torch.float32: np.uint32, torch.float64: np.uint64}


class GrammarCompiler:
    """One per generator: the tokenizer's vocabulary info for the grammar engine, and compiled
    grammars cached per :class:`~specdec.config.StructuredOutput` (bounded LRU, thread-safe).

    Args:
        tokenizer: a Hugging Face tokenizer (its vocabulary is read once, ~1 s for 150k ids).
        vocab_size: the width of the model's logits; ids at or past ``len(tokenizer)`` (padding
            columns) are never allowed.
        eos_token_ids: the stop tokens, allowed where the structure is complete.
        cache_size: compiled grammars kept, least recently used dropped first.

    Example:
        >>> compiler = GrammarCompiler(tokenizer, 512, [2])  # doctest: +SKIP
        >>> compiler.compile(StructuredOutput(regex=r"\\d+")) is compiler.compile(
        ...     StructuredOutput(regex=r"\\d+"))  # doctest: +SKIP
        True
    """

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, cache_size: int = 64
    ) -> None:
        check_arg(positive_int, "vocab_size", vocab_size)
        check_arg(positive_int, "cache_size", cache_size)
        eos = [int(t) for t in eos_token_ids]
        for t in eos:
            check_arg(non_negative_int, "eos_token_ids", t)
            if t >= vocab_size:
                raise ValueError(f"eos_token_ids must be in [0, {vocab_size}), got {t}")
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        info = _tokenizer_info(xgr, tokenizer, vocab_size, eos)
        # xgrammar's own cache is unbounded; the LRU below bounds it instead.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Compiled grammars held now (at most ``cache_size``)."""
        return len(self._cache)

    def compile(self, spec: StructuredOutput) -> object:
        """The compiled grammar of ``spec`` (an ``xgrammar.CompiledGrammar``), from the cache
        when it is there.

        Raises:
            TypeError: ``spec`` is not a ``StructuredOutput``.
            ValueError: the schema, regex or grammar is malformed; the message names the field
                (``structured_output.json_schema is not a valid JSON schema: ...``).
        """
        if not isinstance(spec, StructuredOutput):
            raise TypeError(f"spec must be a StructuredOutput, got {type(spec).__name__}")
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        # Compiled outside the lock so one slow schema holds up no other request; when two
        # threads race on one spec, the first to store wins and both return its object.
        compiled = self._compile(spec)
        with self._lock:
            compiled = self._cache.setdefault(spec, compiled)
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh :class:`GrammarState` of ``spec`` (compiled once, then cached)."""
        matcher = _xgrammar().GrammarMatcher(self.compile(spec))
        return GrammarState(matcher, self.vocab_size)

    def _json(self, schema: str) -> object:
        # Whitespace between JSON tokens is bounded: unbounded, a small model can emit blank
        # lines until max_new_tokens (seen with stories260K); JSON_MAX_WHITESPACE still allows
        # newlines and indentation a few levels deep.
        return self._compiler.compile_json_schema(schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)

    def _compile(self, spec: StructuredOutput) -> object:
        if spec.json_schema is not None:
            schema = _schema_text(spec.json_schema)
            return self._run("json_schema", "is not a valid JSON schema", self._json, schema)
        if spec.json_object:
            return self._json('{"type": "object"}')
        if spec.regex is not None:
            return self._run("regex", "is not a valid regex", self._compiler.compile_regex,
                             spec.regex)  # fmt: skip
        if spec.choice is not None:
            # GBNF string literals take JSON's escapes, so json.dumps quotes each choice exactly.
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return self._run("choice", "cannot be compiled", self._compiler.compile_grammar, ebnf)
        return self._run("grammar", "is not a valid EBNF grammar (GBNF, with a rule named root)",
                         self._compiler.compile_grammar, spec.grammar)  # fmt: skip

    @staticmethod
    def _run(field: str, what: str, compile_fn, text: str) -> object:
        """``compile_fn(text)``, its error a ValueError naming ``structured_output.<field>``."""
        try:
            return compile_fn(text)
        except (RuntimeError, ValueError) as err:
            reason = _CPP_PREFIX.sub("", str(err)).strip()
            raise ValueError(f"structured_output.{field} {what}: {reason}") from None


def _tokenizer_info(xgr, tokenizer, vocab_size: int, eos: list[int]):
    """xgrammar's view of the vocabulary, with every special token (BOS, UNK, chat markers,
    GGUF's ``[PAD<id>]`` fillers) made empty: xgrammar reads an empty token as one it never
    allows, where it would otherwise take ``<|im_start|>`` as its literal text inside a JSON
    string. The EOS ids stay allowed as stop tokens."""
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos
    )
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    encoded = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special and text != f"[PAD{i}]":
            encoded[i] = text
    return xgr.TokenizerInfo(
        encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=eos,
        add_prefix_space=detected.add_prefix_space,
    )  # fmt: skip


def _schema_text(text: str) -> str:
    """The schema as xgrammar takes it: checked to be a JSON object; ``{}`` is any JSON
    object (what ``StructuredOutput`` documents), not any JSON value."""
    try:
        schema = json.loads(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"structured_output.json_schema is not valid JSON text: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"structured_output.json_schema is not a valid JSON schema: must be a JSON object, "
            f"got {type(schema).__name__}"
        )
    if not schema:
        return '{"type": "object"}'
    fixed = _bounded_strings_as_patterns(schema)
    return text if fixed == schema else json.dumps(fixed)


# Keys whose values are data, not schemas; and keys whose values map names to schemas.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _bounded_strings_as_patterns(node: object) -> object:
    """``{"type": "string", "minLength": m, "maxLength": n}`` -> ``"pattern": "^[\\s\\S]{m,n}$"``,
    everywhere in the schema.

    xgrammar 0.2.9 compiles a length-bounded string to a character class that admits raw
    control characters (a tab inside the quotes: invalid JSON), while its ``pattern`` rule
    keeps to JSON's string characters. Both refuse escapes, so the pattern admits exactly the
    valid subset of what the length rule did. A string that already has a pattern or a format
    is left alone.
    """
    if isinstance(node, list):
        return [_bounded_strings_as_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _bounded_strings_as_patterns(v) for name, v in value.items()}
        else:
            out[key] = _bounded_strings_as_patterns(value)
    low, high = out.get("minLength", 0), out.get("maxLength")
    if (
        out.get("type") == "string"
        and ("minLength" in out or "maxLength" in out)
        and "pattern" not in out
        and "format" not in out
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (low, high or 0))
        and (high is None or low <= high)
    ):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"
    return out


class GrammarState:
    """One request's grammar matcher, advanced over its committed output.

    Made by :meth:`GrammarCompiler.new_state`. Not thread-safe: one request's steps run one at
    a time. Every method leaves the matcher at the committed output (``consumed`` tokens);
    :meth:`mask_rows` rolls back what it walks.
    """

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher  # xgrammar.GrammarMatcher
        self.vocab_size = vocab_size
        self.consumed = 0  # committed output tokens consumed so far
        self._refused = False  # a committed token the grammar refused (a final EOS/stop)

    @property
    def ended(self) -> bool:
        """The grammar has terminated (accepted a stop token) or refused a committed token:
        no further token is allowed."""
        return self._refused or self._matcher.is_terminated()

    def sync(self, output_ids: Sequence[int]) -> None:
        """Consume ``output_ids[consumed:]``; the output only grows.

        A token the grammar refuses (every committed token was sampled under the mask, so only
        a final EOS or stop token can be) ends the state, without an exception.
        """
        if len(output_ids) < self.consumed:
            raise ValueError(
                f"output_ids has {len(output_ids)} tokens, fewer than the {self.consumed} "
                "already consumed (a request's output only grows)"
            )
        for t in output_ids[self.consumed :]:
            if self.ended:
                break
            if not self._matcher.accept_token(int(t)):
                self._refused = True
        self.consumed = len(output_ids)

    def mask_rows(
        self, output_ids: Sequence[int], extensions: Sequence[Sequence[int]], logits: torch.Tensor
    ) -> None:
        """In place: row ``r`` of ``logits`` keeps only the tokens the grammar allows after
        ``output_ids + extensions[r]``; every other column becomes ``-inf``.

        A row whose extension leaves the grammar, or any row once the grammar has ended, is
        all ``-inf``. Columns at or past ``vocab_size`` are ``-inf``; a ``width`` below it uses
        the first ``width`` columns of the mask (a draft model's narrower vocabulary).

        Cost per row on a 152k vocabulary: a mask (1-100 µs), an accept (~1 µs) and writing
        the mask into the logits (~50 µs on one CPU core; 70-210 µs a row in all, module
        docstring). Rows are walked in order, rolling back only to the prefix shared with the
        previous row, so a chain (``drafts[:r]``) or a tree with parents before children
        consumes each token once; any order is correct, and extensions of any length roll
        back (xgrammar keeps the whole history).

        Args:
            output_ids: the request's committed output tokens (synced first).
            extensions: one per row, the drafted tokens between the output and the row.
            logits: ``[rows, width]`` float, CPU or CUDA, ``rows == len(extensions)``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(extensions):
            raise ValueError(
                f"logits must be [rows, width] with rows == len(extensions) == {len(extensions)}, "
                f"got shape {tuple(logits.shape)}"
            )
        self.sync(output_ids)
        words = bitmask_words(self.vocab_size)
        bitmask = torch.zeros(len(extensions), words, dtype=torch.int32)  # [rows, words]
        if not self.ended:
            self._fill(extensions, bitmask)
        self._apply(logits, bitmask)

    def _fill(self, extensions: Sequence[Sequence[int]], bitmask: torch.Tensor) -> None:
        """Row ``r`` of ``bitmask`` (zeroed) <- the mask after ``extensions[r]``; rolls back."""
        m = self._matcher
        path: list[int] = []  # the tokens accepted beyond the committed output, in order
        try:
            for r, ext in enumerate(extensions):
                shared = 0
                while shared < len(path) and shared < len(ext) and path[shared] == ext[shared]:
                    shared += 1
                if shared < len(path):
                    m.rollback(len(path) - shared)
                    del path[shared:]
                for t in ext[shared:]:
                    t = int(t)
                    # A terminated matcher (EOS accepted) takes nothing more; asking it would
                    # only make xgrammar print a warning.
                    if m.is_terminated() or not m.accept_token(t):
                        break  # left the grammar: the row stays all zero bits
                    path.append(t)
                if len(path) == len(ext) and not m.is_terminated():
                    m.fill_next_token_bitmask(bitmask, r)
        finally:
            if path:
                m.rollback(len(path))

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        if logits.device.type == "cpu" and sys.byteorder == "little":
            apply_bitmask_cpu(logits, bitmask, self.vocab_size)
        else:
            apply_bitmask(logits, bitmask, self.vocab_size)
