"""What a grammar mask costs per verified position: xgrammar against llguidance on one vocabulary.

Structured output masks the target's logits at every verify row, so a speculative step with k
drafts pays for k + 1 masks on the CPU, between the target pass and verification. This walks
a valid output (the tokenizer's tokens of a valid text) through each grammar and times, per
backend:

- ``compile``: grammar text -> a ready matcher, cold (nothing cached) and the cost of a fresh
  matcher from a compiled grammar (what a request pays when its grammar is cached);
- ``mask``: the next-token bitmask at every position of the walk (first walk: lazy caches
  cold; later walks: the per-position minimum);
- ``accept`` and ``rollback``: one token in, the whole walk back out;
- ``chain``: what ``GrammarState.mask_rows`` does for a chain of 8 drafts at each position:
  mask, accept, ..., mask, roll back 8 -- in a Python loop, and in the backend's own batched
  call (xgrammar ``traverse_draft_tree``, llguidance ``fill_next_token_bitmask_par_with_draft_tokens``);
- ``apply``: the bitmask on ``[9, vocab]`` float32 logits (xgrammar's CPU kernel against
  specdec's pure-torch ``apply_bitmask`` and numpy ``apply_bitmask_cpu``);
- ``mask_rows``: specdec's ``GrammarState.mask_rows`` on the same chains, mask applied, per row.

Writes ``benchmarks/results/grammar-mask-cost-<UTC stamp>.json`` and prints a table; about a
minute on two cores (loading the tokenizer into each backend is most of it).

    python -m benchmarks.grammar_mask_cost [--tokenizer DIR] [--walks 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import machine_info, write_json

DEFAULT_TOKENIZER = Path("~/.cache/specdec/qwen2.5-coder-0.5b-instruct").expanduser()
CHAIN = 8  # drafts per chain: a typical k

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "status": {"type": "string", "enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
        "contacts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"kind": {"enum": ["email", "phone"]}, "value": {"type": "string"}},
                "required": ["kind", "value"],
            },
        },
        "nickname": {"type": "string"},
    },
    "required": ["id", "name", "status", "tags", "address"],
}
NESTED_TEXT = json.dumps(
    {
        "id": 4821,
        "name": "Ada Lovelace",
        "status": "active",
        "score": -12.75e-3,
        "tags": ["math", "engines", "poetry"],
        "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
        "contacts": [{"kind": "email", "value": "ada@example.org"}, {"kind": "phone", "value": "+44 20 7946 0958"}],
    }
)
ARITHMETIC_EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
"""
CHOICES = ["positive", "negative", "neutral", "mixed, leaning positive"]

# name -> (kind, grammar text, a valid output)
CASES = {
    "json-nested": ("json_schema", json.dumps(NESTED_SCHEMA), NESTED_TEXT),
    "json-object": ("json_schema", '{"type": "object"}', '{"a": [1, 2.5, {"b": null}], "c": "d", "e": true}'),
    "regex-email": ("regex", r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,6}", "jane.doe+specdec@example-mail.co.uk"),
    "regex-date": ("regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "2024-02-29"),
    "choice": ("choice", json.dumps(CHOICES), "mixed, leaning positive"),
    "ebnf-arith": ("grammar", ARITHMETIC_EBNF, "(12+3.5)*4-5/(6+7)*(8-9)+100"),
}  # fmt: skip


def ebnf_choice(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are GBNF's."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        self.cached = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)

    def compile(self, kind: str, text: str, *, cache: bool = False):
        c = self.cached if cache else self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(text)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar(ebnf_choice(json.loads(text)))
        return c.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def chain_native(self, m, drafts: list[int], bitmask: torch.Tensor) -> None:
        """One call for the whole chain: node 0 is the committed state, node i+1 drafts[i]."""
        n = len(drafts) + 1
        nxt = torch.arange(1, n + 1, dtype=torch.int64)
        nxt[-1] = -1
        m.traverse_draft_tree(nxt, torch.full((n,), -1, dtype=torch.int64),
                              torch.tensor([0, *drafts], dtype=torch.int64), bitmask[:n])  # fmt: skip


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, kind: str, text: str, *, cache: bool = False):
        """llguidance compiles lazily inside a matcher; the "compiled grammar" is a template
        matcher that new requests deep-copy."""
        grammar = self.llg.grammar_from(kind if kind != "grammar" else "gbnf", text)
        m = self.llg.LLMatcher(self.lt, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, row)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def chain_native(self, m, drafts: list[int], bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(m, 0, drafts)], bitmask[: len(drafts) + 1]
        )


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def _summary(values_us: list[float]) -> dict[str, float]:
    s = sorted(values_us)
    return {
        "mean": round(statistics.fmean(s), 2),
        "median": round(statistics.median(s), 2),
        "p90": round(s[min(len(s) - 1, int(0.9 * len(s)))], 2),
        "max": round(s[-1], 2),
    }


def measure(backend, kind: str, text: str, ids: list[int], eos: int, vocab: int, walks: int) -> dict:
    """Every cost of one grammar on one backend (module docstring)."""
    cold = []
    for _ in range(3):
        t0 = time.perf_counter()
        compiled = backend.compile(kind, text)
        backend.matcher(compiled)
        cold.append(time.perf_counter() - t0)
    backend.compile(kind, text, cache=True)
    t0 = time.perf_counter()
    compiled = backend.compile(kind, text, cache=True)
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.matcher(compiled)
    new_matcher = time.perf_counter() - t0

    bitmask = torch.zeros((CHAIN + 1, (vocab + 31) // 32), dtype=torch.int32)  # [rows, words]
    per_walk_mask, per_walk_accept, rollback_all = [], [], []
    for _ in range(walks):
        m = backend.matcher(compiled)
        masks, accepts = [], []
        for t in [*ids, eos]:
            t0 = time.perf_counter()
            backend.fill(m, bitmask, 0)
            t1 = time.perf_counter()
            ok = backend.accept(m, t)
            t2 = time.perf_counter()
            if not ok:
                raise RuntimeError(f"{backend.name} refused token {t} of {text!r}")
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
        t0 = time.perf_counter()
        backend.rollback(m, len(ids) + 1)
        rollback_all.append((time.perf_counter() - t0) / (len(ids) + 1))
        per_walk_mask.append(masks)
        per_walk_accept.append(accepts)
    warm_mask = [_us(min(col)) for col in zip(*per_walk_mask[1:])] if walks > 1 else []
    warm_accept = [_us(min(col)) for col in zip(*per_walk_accept[1:])] if walks > 1 else []

    # mask_rows on a chain: k+1 masks, k accepts, one rollback; per verified row.
    m = backend.matcher(compiled)
    loop, native = [], []
    for p in range(len(ids)):
        drafts = ids[p : p + CHAIN]
        t0 = time.perf_counter()
        for r, t in enumerate(drafts):
            backend.fill(m, bitmask, r)
            backend.accept(m, t)
        backend.fill(m, bitmask, len(drafts))
        backend.rollback(m, len(drafts))
        t1 = time.perf_counter()
        backend.chain_native(m, drafts, bitmask)
        t2 = time.perf_counter()
        loop.append((t1 - t0) / (len(drafts) + 1))
        native.append((t2 - t1) / (len(drafts) + 1))
        backend.accept(m, ids[p])
    return {
        "tokens": len(ids) + 1,
        "compile_cold_ms": round(1e3 * min(cold), 3),
        "compile_cached_us": _us(cached),
        "new_matcher_us": _us(new_matcher),
        "mask_first_walk_us": _summary([_us(x) for x in per_walk_mask[0]]),
        "mask_warm_us": _summary(warm_mask) if warm_mask else None,
        "accept_us": _summary(warm_accept) if warm_accept else None,
        "rollback_us_per_token": _us(min(rollback_all)),
        "chain_loop_us_per_row": _summary([_us(x) for x in loop]),
        "chain_native_us_per_row": _summary([_us(x) for x in native]),
    }


def mask_rows_cost(tokenizer, vocab: int, eos: int) -> dict[str, dict]:
    """specdec's ``GrammarState.mask_rows`` as the engine calls it: at each position of the
    walk, a chain of ``CHAIN`` drafts (``CHAIN + 1`` rows of float32 logits, the mask applied
    in place); µs per row, and the compiler's one-time setup."""
    from specdec.config import StructuredOutput
    from specdec.logits.grammar import GrammarCompiler

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    out: dict[str, dict] = {"setup_s": round(time.perf_counter() - t0, 3)}
    logits = torch.zeros(CHAIN + 1, vocab)  # [rows, vocab] float32
    for case, (kind, text, output) in CASES.items():
        spec = StructuredOutput(**{kind: json.loads(text) if kind == "choice" else text})
        state = compiler.new_state(spec)
        ids = list(tokenizer.encode(output, add_special_tokens=False))
        per_row = []
        for p in range(len(ids)):
            drafts = ids[p : p + CHAIN]
            rows = [drafts[:r] for r in range(len(drafts) + 1)]
            t0 = time.perf_counter()
            state.mask_rows(ids[:p], rows, logits[: len(rows)])
            per_row.append((time.perf_counter() - t0) / len(rows))
        out[case] = _summary([_us(x) for x in per_row])
    return out


def apply_cost(vocab: int, rows: int = CHAIN + 1) -> dict[str, dict[str, float]]:
    """The bitmask on ``[rows, vocab]`` float32 logits, µs: xgrammar's CPU kernel, specdec's
    pure-torch ``apply_bitmask`` and its numpy ``apply_bitmask_cpu``; on sparse masks (a few
    hundred allowed ids a row, the usual grammar mask) and on random bits."""
    import xgrammar as xgr

    from specdec.logits.grammar import apply_bitmask, apply_bitmask_cpu

    g = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    ids = torch.randint(0, vocab, (rows, 300), generator=g)  # [rows, 300] allowed ids
    bits = torch.zeros(rows, words * 32, dtype=torch.bool)
    bits[torch.arange(rows).unsqueeze(-1), ids] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))  # [32]
    sparse = (bits.view(rows, words, 32).long() * weights).sum(-1)  # [rows, words] int64
    sparse = torch.where(sparse >= 2**31, sparse - 2**32, sparse).to(torch.int32)
    masks = {
        "sparse": sparse,
        "random": torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g),
    }
    logits = torch.randn(rows, vocab, generator=g)
    out: dict[str, dict[str, float]] = {}
    for kind, bitmask in masks.items():
        for name, fn in (
            ("xgrammar_cpu_kernel", lambda b=bitmask: xgr.apply_token_bitmask_inplace(logits, b, vocab_size=vocab)),
            ("torch_apply_bitmask", lambda b=bitmask: apply_bitmask(logits, b, vocab)),
            ("numpy_apply_bitmask_cpu", lambda b=bitmask: apply_bitmask_cpu(logits, b, vocab)),
        ):
            fn()
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out.setdefault(kind, {})[name] = _us(min(times))
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--walks", type=int, default=4, help="walks per grammar (the first is cold)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (on a busy 2-core machine, 2 threads wait ~8 ms per op)")  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = AutoConfig.from_pretrained(args.tokenizer).vocab_size  # the logits' width
    eos = tokenizer.eos_token_id
    results: dict[str, dict] = {}
    setup: dict[str, float] = {}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        backend = cls(tokenizer, vocab, [eos])
        setup[cls.name] = round(time.perf_counter() - t0, 3)
        for case, (kind, text, output) in CASES.items():
            ids = list(tokenizer.encode(output, add_special_tokens=False))
            results.setdefault(case, {})[cls.name] = measure(backend, kind, text, ids, eos, vocab, args.walks)
    payload = {
        "machine": machine_info(),
        "tokenizer": str(args.tokenizer),
        "vocab_size": vocab,
        "chain_drafts": CHAIN,
        "tokenizer_setup_s": setup,
        "apply_us": apply_cost(vocab),
        "specdec_mask_rows_us_per_row": mask_rows_cost(tokenizer, vocab, eos),
        "cases": {name: {"kind": k, "grammar": g, "output": o} for name, (k, g, o) in CASES.items()},
        "results": results,
    }
    path = write_json("grammar-mask-cost", payload)
    print(table(payload))
    print(f"wrote {path}")
    return path


def table(payload: dict) -> str:
    """Markdown: per grammar and backend, µs per position and ms to compile."""
    head = (
        "| grammar | backend | tokens | mask warm mean / p90 / max µs | mask 1st walk mean µs "
        "| accept µs | rollback µs/tok | chain loop µs/row | chain native µs/row | compile cold ms "
        "| new matcher µs |"
    )
    lines = [head, "|" + "---|" * 11]
    for case, by_backend in payload["results"].items():
        for name, r in by_backend.items():
            w = r["mask_warm_us"] or r["mask_first_walk_us"]
            lines.append(
                f"| {case} | {name} | {r['tokens']} | {w['mean']} / {w['p90']} / {w['max']} "
                f"| {r['mask_first_walk_us']['mean']} | {(r['accept_us'] or {}).get('mean')} "
                f"| {r['rollback_us_per_token']} | {r['chain_loop_us_per_row']['mean']} "
                f"| {r['chain_native_us_per_row']['mean']} | {r['compile_cold_ms']} | {r['new_matcher_us']} |"
            )
    lines.append("")
    rows = payload["specdec_mask_rows_us_per_row"]
    lines.append(f"specdec GrammarState.mask_rows, chain of {CHAIN} drafts, µs per row (mean / p90), "
                 f"mask applied to float32 logits; compiler setup {rows['setup_s']} s:")  # fmt: skip
    lines.append("  " + ", ".join(f"{k} {v['mean']} / {v['p90']}" for k, v in rows.items() if k != "setup_s"))
    lines.append(f"tokenizer setup s: {payload['tokenizer_setup_s']}; apply on [{CHAIN + 1}, "
                 f"{payload['vocab_size']}] float32, µs: {payload['apply_us']}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
