"""Command line: ``specdec generate | fetch | demo``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

BUNDLED_MODEL = "stories260K"


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from specdec import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("--target", required=True, help="HF directory, .gguf file or model name")
    gen.add_argument("--draft", default=None, help="draft model for speculation")
    gen.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--stream", action="store_true")
    _add_sampling_args(gen)

    fetch = sub.add_parser("fetch", help="download and convert a known model into the cache")
    fetch.add_argument("model", help="known model name")

    demo = sub.add_parser("demo", help="run the demo on the default model pair")
    demo.add_argument("--target", default=None)
    demo.add_argument("--draft", default=None)
    demo.add_argument("--prompt", action="append", default=None)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--num-speculative-tokens", "-k", type=int, default=None)
    demo.add_argument("--dtype", default="bfloat16")
    demo.add_argument("--threads", type=int, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "generate":
        return _generate(args)
    if args.command == "fetch":
        from specdec.hub import fetch

        print(fetch(args.model))
        return 0
    if args.command == "demo":
        from specdec.demo import run_demo

        return run_demo(args)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from specdec import Generator

    proposer = None
    if args.draft:
        from specdec.proposers import DraftModel

        proposer = DraftModel.from_pretrained(
            args.draft, num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype, device=args.device
        )
    gen = Generator.from_pretrained(args.target, proposer=proposer, dtype=args.dtype, device=args.device)
    params = _sampling_params(args)
    if args.stream and len(args.prompt) == 1:
        for delta in gen.stream(args.prompt[0], params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    start = time.perf_counter()
    outs = gen.generate(list(args.prompt), params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outs):
        print(f"--- {prompt!r}\n{out.text}\n")
    m = gen.metrics
    print(
        f"[{m.num_generated_tokens} tokens in {elapsed:.2f}s, {m.num_generated_tokens / elapsed:.1f} tok/s"
        + (f", acceptance {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}]" if args.draft else "]")
    )
    return 0


def bundled_model_path() -> Path:
    """The stories260K model shipped with the repository for tests and the offline example."""
    return Path(__file__).resolve().parent / "data" / BUNDLED_MODEL


if __name__ == "__main__":
    raise SystemExit(main())
