"""Constrained speculative decoding against constrained plain decoding, and what the mask costs.

The Qwen pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, the harness's ``specdec-draft``
settings: int8 draft, fixed k = 4, bf16 target, one thread) decodes chat prompts that ask for a
JSON description of a HumanEval function under JSON schemas (nested objects, enums, arrays,
numbers, optional fields), one regex (a semantic version) and one choice, greedy. Plain and
speculative decoding take turns on every request (which one goes first alternates), so the
drift of a shared machine hits both; the greedy outputs must be identical.

``GrammarState.mask_rows`` (and its two parts: ``_fill``, the grammar's bitmask, and
``_apply``, writing ``-inf`` into the logits) is wrapped to add up its wall time and the rows
it masked, per run and per side: target rows (the verified positions: k + 1 a speculative
step, 1 a plain step) and draft rows (one per draft step, called through the proposer's
logits transform). ``RequestLogits.apply`` (the whole per-row transform: a float32 copy, the
masks, a dead-row check) and the draft proposer's ``propose`` are timed the same way.

Every finished output is checked: JSON with ``jsonschema``, the regex with ``re.fullmatch``,
the choice by membership; outputs cut by ``max_new_tokens`` are counted.

Writes ``benchmarks/results/structured-output-<UTC stamp>.json`` (and ``-latest``) and prints a
markdown table; about 8-10 minutes on two shared cores.

    python -m benchmarks.structured_output [--k 4] [--max-new-tokens 160] [--requests 8]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import attrs
import torch

from benchmarks.common import humaneval_prompts, machine_info, timed, write_json

# ------------------------------------------------------------------------------- the tasks

TYPES = ["int", "float", "str", "bool", "list", "dict", "tuple", "Any"]
FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "args": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "type": {"enum": TYPES},
                    "default": {"type": "string", "maxLength": 20},
                },
                "required": ["name", "type"],
            },
        },
        "returns": {"enum": [*TYPES[:-1], "None"]},
        "complexity": {
            "type": "object",
            "properties": {
                "time": {"type": "string", "maxLength": 12},
                "space": {"type": "string", "maxLength": 12},
            },
            "required": ["time", "space"],
        },
        "lines": {"type": "integer", "minimum": 1, "maximum": 200},
    },
    "required": ["name", "args", "returns", "complexity", "lines"],
}
TESTS_SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string", "maxLength": 40},
        "examples": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "call": {"type": "string", "maxLength": 60},
                    "expected": {"type": "string", "maxLength": 30},
                },
                "required": ["call", "expected"],
            },
        },
        "difficulty": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["function", "examples", "difficulty"],
}
REVIEW_SCHEMA = {
    "type": "object",
    "properties": {
        "has_docstring": {"type": "boolean"},
        "has_examples": {"type": "boolean"},
        "issues": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "severity": {"enum": ["low", "medium", "high"]},
                    "line": {"type": "integer", "minimum": 1},
                    "note": {"type": "string", "maxLength": 50},
                },
                "required": ["severity", "note"],
            },
        },
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
    },
    "required": ["has_docstring", "issues", "rating"],
}
SEMVER = r"(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})"
COMPLEXITIES = ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)", "O(2^n)"]


@attrs.frozen(kw_only=True)
class Task:
    """One request: an instruction about HumanEval prompt ``problem`` and its constraint, one of
    ``schema`` (JSON), ``regex`` or ``choice``."""

    name: str
    problem: int
    instruction: str
    schema: dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def structured_output(self):
        from specdec import StructuredOutput

        if self.schema is not None:
            return StructuredOutput(json_schema=self.schema)
        if self.regex is not None:
            return StructuredOutput(regex=self.regex)
        return StructuredOutput(choice=list(self.choice))

    def valid(self, text: str) -> tuple[bool, str]:
        """Whether a finished output meets the constraint, and why not."""
        if self.regex is not None:
            ok = re.fullmatch(self.regex, text) is not None
            return ok, "" if ok else "no regex match"
        if self.choice is not None:
            ok = text in self.choice
            return ok, "" if ok else "not one of the choices"
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), self.schema)
        except (ValueError, jsonschema.ValidationError) as err:
            return False, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        return True, ""


DESCRIBE = (
    "Return a JSON object describing the Python function below: its name, its arguments "
    "(name, type, default if any), its return type, its time and space complexity and how many "
    "lines its body would take. Answer with JSON only."
)
TASKS = [
    *(Task(name=f"describe-{i}", problem=i, instruction=DESCRIBE, schema=FUNCTION_SCHEMA) for i in range(4)),
    Task(name="tests-4", problem=4, schema=TESTS_SCHEMA,
         instruction="Return a JSON object with the function's name, up to three example calls "
                     "with their expected results, and a difficulty from 0 to 10. JSON only."),
    Task(name="review-5", problem=5, schema=REVIEW_SCHEMA,
         instruction="Review the Python function stub below as JSON: does it have a docstring and "
                     "examples, up to three issues (severity, line, note), and a rating from 0 "
                     "to 5. JSON only."),
    Task(name="semver-6", problem=6, regex=SEMVER,
         instruction="What semantic version (MAJOR.MINOR.PATCH) would you give the first stable "
                     "release of the function below? Answer with the version only."),
    Task(name="choice-7", problem=7, choice=tuple(COMPLEXITIES),
         instruction="What is the time complexity of the function below? Answer with one of: "
                     + ", ".join(COMPLEXITIES) + "."),
]  # fmt: skip


def prompt_ids(tokenizer, task: Task, code: str) -> list[int]:
    """The chat template around the instruction and the code, with the generation prompt."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{task.instruction}\n\n```python\n{code}```"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------- the meter

SIDES = ("target", "draft")
PARTS = ("mask_rows", "fill", "apply", "transform")


class Meter:
    """Wall time and rows of the grammar mask per side, the draft's ``propose`` and every engine
    step, added up between :meth:`reset` calls. :meth:`install` wraps the library's methods
    for the life of the process (a benchmark's own process)."""

    def __init__(self) -> None:
        self.side = "target"
        self.reset()

    def reset(self) -> None:
        self.seconds = {side: dict.fromkeys(PARTS, 0.0) for side in SIDES}
        self.rows = dict.fromkeys(SIDES, 0)
        self.calls = dict.fromkeys(SIDES, 0)
        self.propose_s = 0.0
        self.steps: list[float] = []

    def install(self) -> None:
        from specdec.engine import Engine
        from specdec.logits import batch
        from specdec.logits.grammar import GrammarState
        from specdec.logits.request_logits import RequestLogits
        from specdec.proposers import DraftModel

        def timing(cls, name, part, count_rows=False):
            inner = getattr(cls, name)

            def wrapper(obj, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return inner(obj, *args, **kwargs)
                finally:
                    self.seconds[self.side][part] += time.perf_counter() - t0
                    if count_rows:  # mask_rows(output_ids, extensions, logits)
                        self.rows[self.side] += len(args[1])
                        self.calls[self.side] += 1

            setattr(cls, name, wrapper)

        timing(GrammarState, "mask_rows", "mask_rows", count_rows=True)
        timing(GrammarState, "_fill", "fill")
        timing(GrammarState, "_apply", "apply")
        timing(RequestLogits, "apply", "transform")

        draft_transform = batch._draft_transform

        def marked_draft_transform(req):
            fn = draft_transform(req)

            def apply(extensions, logits):
                self.side = "draft"
                try:
                    return fn(extensions, logits)
                finally:
                    self.side = "target"

            return apply

        batch._draft_transform = marked_draft_transform

        propose = DraftModel.propose

        def timed_propose(proposer, ctx):
            t0 = time.perf_counter()
            try:
                return propose(proposer, ctx)
            finally:
                self.propose_s += time.perf_counter() - t0

        DraftModel.propose = timed_propose

        step = Engine.step

        def timed_step(engine):
            t0 = time.perf_counter()
            try:
                return step(engine)
            finally:
                self.steps.append(time.perf_counter() - t0)

        Engine.step = timed_step

    def record(self) -> dict:
        return {
            "mask": {
                side: {
                    "calls": self.calls[side],
                    "rows": self.rows[side],
                    **{f"{p}_s": round(self.seconds[side][p], 4) for p in PARTS},
                }
                for side in SIDES
            },
            "propose_s": round(self.propose_s, 4),
            "steps": len(self.steps),
            "first_step_s": round(self.steps[0], 4) if self.steps else 0.0,
        }


# ------------------------------------------------------------------------------- the run


def run_one(gen, ids: list[int], task: Task, max_new_tokens: int, meter: Meter) -> dict:
    from specdec import SamplingParams

    params = SamplingParams(
        max_new_tokens=max_new_tokens, structured_output=task.structured_output()
    )
    meter.reset()
    wall, out = timed(lambda: gen.generate(ids, params))
    n = len(out.token_ids)
    rec = meter.record()
    valid, why = task.valid(out.text) if out.finish_reason == "stop" else (None, "")
    m = out.metrics
    return {
        "tokens": n,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(n / wall, 3),
        "decode_tokens_per_s": round((n - 1) / (wall - rec["first_step_s"]), 3) if n > 1 else None,
        "finish_reason": out.finish_reason,
        "cut_by_max_new_tokens": out.finish_reason == "length",
        "valid": valid,
        "invalid_reason": why,
        "text": out.text,
        "token_ids": list(out.token_ids),
        "verify_steps": m.num_verify_steps,
        "drafted": m.num_drafted,
        "accepted": m.num_accepted,
        "acceptance_rate": round(m.acceptance_rate, 4),
        "mean_accepted_length": round(m.mean_accepted_length, 4),
        **rec,
    }


def build(args):
    from specdec import CacheConfig, FixedPolicy, Generator
    from specdec.hub import resolve_model
    from specdec.proposers import DraftModel

    target_path, draft_path = resolve_model(args.target), resolve_model(args.draft)
    # No prefix caching: the warm-up runs the first timed prompt; every run prefills in full.
    cache = CacheConfig(
        max_batch_size=1, max_model_len=1024 + args.max_new_tokens, prefix_caching=False
    )
    target = Generator.from_pretrained(target_path, dtype=args.dtype, cache_config=cache)
    # As the harness's specdec-plain and specdec-draft: each its own KV on the shared target.
    plain = target.with_proposer(None, cache_config=cache)
    draft = DraftModel.from_pretrained(
        draft_path,
        num_speculative_tokens=args.k,
        dtype=args.dtype,
        quantization=args.draft_quantization,
    )
    spec = target.with_proposer(draft, cache_config=cache, policy=FixedPolicy(args.k))
    return target.tokenizer, {"plain": plain, "spec": spec}, (str(target_path), str(draft_path))


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--k", type=int, default=4, help="drafts per step (FixedPolicy)")
    ap.add_argument("--draft-quantization", default="int8", help="'none' for the draft in --dtype")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--requests", type=int, default=len(TASKS), help="the first N tasks")
    ap.add_argument("--out", default="structured-output")
    args = ap.parse_args(argv)
    if args.draft_quantization == "none":
        args.draft_quantization = None
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    tokenizer, systems, paths = build(args)
    load_s = time.perf_counter() - t0
    meter = Meter()
    meter.install()
    tasks = TASKS[: args.requests]
    codes = humaneval_prompts(max(t.problem for t in tasks) + 1)
    prompts = [prompt_ids(tokenizer, t, codes[t.problem]) for t in tasks]
    for gen in systems.values():  # warm-up: kernels, first grammar compile, lazy caches
        run_one(gen, prompts[0], tasks[0], 8, meter)

    rows = []
    for i, (task, ids) in enumerate(zip(tasks, prompts)):
        order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
        runs = {
            name: run_one(systems[name], ids, task, args.max_new_tokens, meter) for name in order
        }
        same = runs["plain"]["token_ids"] == runs["spec"]["token_ids"]
        if not same:
            print(f"!!! GREEDY MISMATCH on {task.name}: plain {runs['plain']['text']!r} "
                  f"spec {runs['spec']['text']!r}")  # fmt: skip
        rows.append({
            "task": task.name,
            "kind": task.structured_output().kind,
            "prompt_tokens": len(ids),
            "order": list(order),
            "same_greedy_tokens": same,
            "ratio_tokens_per_s": round(runs["spec"]["tokens_per_s"] / runs["plain"]["tokens_per_s"], 4),
            **runs,
        })  # fmt: skip
        print(f"{task.name}: {runs['plain']['tokens']} tokens, plain {runs['plain']['tokens_per_s']:.2f} "
              f"spec {runs['spec']['tokens_per_s']:.2f} tok/s ({rows[-1]['ratio_tokens_per_s']:.2f}x), "
              f"same={same}, {runs['plain']['finish_reason']}, valid={runs['plain']['valid']}", flush=True)  # fmt: skip

    payload = {
        "machine": machine_info(),
        "settings": {
            "target": paths[0],
            "draft": paths[1],
            "k": args.k,
            "policy": "FixedPolicy",
            "draft_quantization": args.draft_quantization,
            "dtype": args.dtype,
            "threads": args.threads,
            "max_new_tokens": args.max_new_tokens,
            "greedy": True,
            "load_s": round(load_s, 2),
        },
        "tasks": [attrs.asdict(t) for t in tasks],
        "summary": summary(rows),
        "requests": rows,
    }
    path = write_json(args.out, payload)
    print(table(payload))
    print(f"wrote {path}")
    return path


def summary(rows: list[dict]) -> dict:
    out: dict[str, object] = {}
    for name in ("plain", "spec"):
        runs = [r[name] for r in rows]
        tokens = sum(r["tokens"] for r in runs)
        wall = sum(r["wall_s"] for r in runs)
        first = sum(r["first_step_s"] for r in runs)
        mask = {
            side: {
                "calls": sum(r["mask"][side]["calls"] for r in runs),
                "rows": sum(r["mask"][side]["rows"] for r in runs),
                **{f"{p}_s": round(sum(r["mask"][side][f"{p}_s"] for r in runs), 4) for p in PARTS},
            }
            for side in SIDES
        }
        for m in mask.values():
            m["us_per_row"] = round(1e6 * m["mask_rows_s"] / m["rows"], 1) if m["rows"] else None
            m["fill_us_per_row"] = round(1e6 * m["fill_s"] / m["rows"], 1) if m["rows"] else None
            m["apply_us_per_row"] = round(1e6 * m["apply_s"] / m["rows"], 1) if m["rows"] else None
            m["fraction_of_wall"] = round(m["mask_rows_s"] / wall, 4)
            m["transform_fraction_of_wall"] = round(m["transform_s"] / wall, 4)
        drafted = sum(r["drafted"] for r in runs)
        steps = sum(r["verify_steps"] for r in runs)
        out[name] = {
            "tokens": tokens,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 3),
            "decode_tokens_per_s": round((tokens - len(runs)) / (wall - first), 3),
            "first_step_s": round(first, 3),
            "propose_s": round(sum(r["propose_s"] for r in runs), 3),
            "cut_by_max_new_tokens": sum(r["cut_by_max_new_tokens"] for r in runs),
            "invalid": sum(r["valid"] is False for r in runs),
            "acceptance_rate": round(sum(r["accepted"] for r in runs) / drafted, 4) if drafted else None,
            "mean_accepted_length": round(
                sum(r["mean_accepted_length"] * r["verify_steps"] for r in runs) / steps, 4
            ) if steps else None,
            "mask": mask,
        }  # fmt: skip
    ratios = [r["ratio_tokens_per_s"] for r in rows]
    out["ratio_overall"] = round(out["spec"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 4)
    out["ratio_decode_overall"] = round(
        out["spec"]["decode_tokens_per_s"] / out["plain"]["decode_tokens_per_s"], 4
    )
    out["ratio_median_per_request"] = round(statistics.median(ratios), 4)
    out["all_greedy_identical"] = all(r["same_greedy_tokens"] for r in rows)
    out["meets_1_3x"] = out["ratio_overall"] >= 1.3
    return out


def table(payload: dict) -> str:
    """Markdown: one row per request, then the totals and the mask's cost per row."""
    lines = [
        "| task | kind | prompt tok | new tok | finish | valid | plain tok/s | spec tok/s | spec / plain "
        "| acc. rate | mean acc. len | same greedy |",
        "|" + "---|" * 12,
    ]
    for r in payload["requests"]:
        p, s = r["plain"], r["spec"]
        lines.append(
            f"| {r['task']} | {r['kind']} | {r['prompt_tokens']} | {p['tokens']} | {p['finish_reason']} "
            f"| {p['valid']} | {p['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} | {r['ratio_tokens_per_s']:.2f}x "
            f"| {s['acceptance_rate']:.2f} | {s['mean_accepted_length']:.2f} | {'yes' if r['same_greedy_tokens'] else '**NO**'} |"
        )  # fmt: skip
    sm = payload["summary"]
    lines += [
        "",
        "| system | tokens | wall s | tok/s | decode tok/s | cut | invalid | acc. rate | mean acc. len "
        "| target mask rows | µs/row (fill + apply) | draft mask rows | µs/row (fill + apply) | mask % of wall |",
        "|" + "---|" * 14,
    ]
    for name in ("plain", "spec"):
        x = sm[name]
        t, d = x["mask"]["target"], x["mask"]["draft"]
        share = 100 * (t["fraction_of_wall"] + d["fraction_of_wall"])
        lines.append(
            f"| {name} | {x['tokens']} | {x['wall_s']:.1f} | {x['tokens_per_s']:.2f} | {x['decode_tokens_per_s']:.2f} "
            f"| {x['cut_by_max_new_tokens']} | {x['invalid']} | {x['acceptance_rate'] or '-'} "
            f"| {x['mean_accepted_length'] or '-'} | {t['rows']} | {t['us_per_row']} ({t['fill_us_per_row']} + "
            f"{t['apply_us_per_row']}) | {d['rows']} | {d['us_per_row'] or '-'} ({d['fill_us_per_row'] or '-'} + "
            f"{d['apply_us_per_row'] or '-'}) | {share:.1f}% |"
        )  # fmt: skip
    lines.append("")
    lines.append(
        f"spec / plain tok/s: overall {sm['ratio_overall']:.3f}x, decode only {sm['ratio_decode_overall']:.3f}x, "
        f"median per request {sm['ratio_median_per_request']:.3f}x; >= 1.3x: {sm['meets_1_3x']}; "
        f"greedy outputs identical: {sm['all_greedy_identical']}"
    )  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
