"""Where a speculative step of a head proposer goes: the target pass, drafting, following the
target, the rest, in ms per engine step, for MTP chains and EAGLE chains and trees side by side.

Batch 1, greedy, HumanEval prompts one at a time; the configurations take turns in every
repeat (the machines drift). Timers wrap the engine's and the heads' methods in this process
only. Every output is checked against plain decoding. Writes
``benchmarks/results/head-step-*.json``.

    python -m benchmarks.head_step --mtp-head DIR --mtp-draft-vocab 4174 --eagle-head DIR \
        [--head-quantization int8] [--threads 1] [--prompts 3] [--tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch

from benchmarks.common import humaneval_prompts, machine_info, write_json

# name -> (proposer, k, options): "mtp" / "eagle-chain" / "eagle-tree"
CONFIGS = {
    "plain": (None, 0, {}),
    "mtp-1": ("mtp", 1, {}),
    "mtp-2": ("mtp", 2, {}),
    "mtp-confident-3": ("mtp", 3, {"confidence_threshold": 0.5}),
    "eagle-chain-1": ("eagle-chain", 1, {}),
    "eagle-tree-2": ("eagle-tree", 2, {}),
    "eagle-tree-3": ("eagle-tree", 3, {}),
}
PARTS = ("step", "target_pass", "target_lm_head", "draft", "follow", "head_layer", "head_lm_head")


@contextlib.contextmanager
def timers(totals: dict[str, float]):
    """Wrap the timed methods; restore them on exit."""
    from specdec.engine import Engine
    from specdec.models.eagle_head import EagleHeadModel
    from specdec.models.llama import LlamaModel
    from specdec.proposers import EAGLETree, MTPHead

    targets = [
        (Engine, "step", "step"), (Engine, "_target_pass", "target_pass"), (Engine, "_draft", "draft"),
        (LlamaModel, "logits", "target_lm_head"), (MTPHead, "on_target_step", "follow"),
        (EAGLETree, "on_target_step", "follow"), (EagleHeadModel, "forward", "head_layer"),
        (EagleHeadModel, "draft_logits", "head_lm_head"),
    ]  # fmt: skip
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in targets]

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start

        return wrapper

    try:
        for (cls, name, label), (_, _, fn) in zip(targets, originals):
            setattr(cls, name, timed(fn, label))
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def _proposer(kind: str | None, k: int, options: dict, args):
    from specdec.proposers import EAGLETree, MTPHead
    from specdec.training.eagle import chain_tree

    if kind == "mtp":
        return MTPHead.from_pretrained(
            args.mtp_head, num_speculative_tokens=k, draft_vocab_size=args.mtp_draft_vocab,
            quantization=args.head_quantization, **options,
        )  # fmt: skip
    if kind in ("eagle-chain", "eagle-tree"):
        tree = chain_tree(k) if kind == "eagle-chain" else None
        return EAGLETree.from_pretrained(
            args.eagle_head, tree, top_k=4, depth=5, num_verify_tokens=15, quantization=args.head_quantization,
            **options,
        )  # fmt: skip
    return None


def main(argv: list[str] | None = None) -> dict[str, object]:
    from specdec import FixedPolicy, Generator, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--mtp-head", required=True)
    parser.add_argument("--mtp-draft-vocab", type=int, default=None)
    parser.add_argument("--eagle-head", required=True)
    parser.add_argument("--head-quantization", choices=("int8", "q4"), default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    base = Generator.from_pretrained(args.target)
    prompts = [base.tokenizer.encode(p) for p in humaneval_prompts(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    gens = {}
    for name, (kind, k, options) in CONFIGS.items():
        proposer = _proposer(kind, k, options, args)
        gens[name] = base if proposer is None else base.with_proposer(proposer, policy=FixedPolicy(k))
        gens[name].generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True))  # warm-up
    reference = [o.token_ids for o in base.generate(prompts, params)]
    rows: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.repeats):
        for name, gen in gens.items():
            totals: dict[str, float] = defaultdict(float)
            before = gen.metrics.snapshot()
            with timers(totals):
                start = time.perf_counter()
                outs = [gen.generate([p], params)[0].token_ids for p in prompts]
                seconds = time.perf_counter() - start
            m = gen.metrics
            steps = m.num_target_forwards - before.num_target_forwards
            verify = m.num_verify_steps - before.num_verify_steps
            emitted = m.num_emitted_in_verify - before.num_emitted_in_verify
            row = {
                "tokens_per_s": len(prompts) * args.tokens / seconds,
                "steps": steps,
                "tokens_per_verify_step": emitted / verify if verify else None,
                "matches_plain": outs == reference,
                **{f"{part}_ms": 1000 * totals[part] / steps for part in PARTS},
            }
            row["rest_ms"] = row["step_ms"] - row["target_pass_ms"] - row["draft_ms"] - row["follow_ms"]
            rows[name].append(row)
            print(f"{name:16s} {row['tokens_per_s']:6.2f} tok/s  " + "  ".join(
                f"{p}={row[f'{p}_ms']:.2f}" for p in (*PARTS, "rest")) + f"  = plain: {row['matches_plain']}",
                flush=True)  # fmt: skip
    payload = {"machine": machine_info(), "args": vars(args), "configs": {n: list(c[:2]) + [c[2]] for n, c in CONFIGS.items()},
               "runs": rows}  # fmt: skip
    path = write_json("head-step", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
