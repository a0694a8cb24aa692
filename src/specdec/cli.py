"""Command line: ``specdec generate | fetch | demo | train-mtp``."""

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
    demo.add_argument("--adaptive", action="store_true", help="adaptive k (at most -k) instead of a fixed k")

    mtp = sub.add_parser("train-mtp", help="train an MTP head for a target (see docs/mtp.md)")
    mtp.add_argument("--target", required=True, help="HF directory, .gguf file or model name")
    mtp.add_argument("--out", required=True, help="directory for the head, checkpoints and logs")
    mtp.add_argument("--data", action="append", default=[], help="text file, directory or glob (repeatable)")
    mtp.add_argument("--self-distill", type=int, default=0, metavar="N", help="train on N sampled generations of the target")
    mtp.add_argument("--distill-prompt", action="append", default=[], help="prompt for self-distillation (repeatable; default BOS)")
    mtp.add_argument("--distill-tokens", type=int, default=256)
    mtp.add_argument("--chunk-len", type=int, default=256)
    mtp.add_argument("--max-chunks", type=int, default=None)
    mtp.add_argument("--max-bytes", type=int, default=None)
    mtp.add_argument("--val-prompt", action="append", default=[], help="held-out prompt (default: beginnings of held-out chunks)")
    mtp.add_argument("--val-k", type=int, default=1)
    mtp.add_argument("--val-tokens", type=int, default=64)
    mtp.add_argument("--steps", type=int, default=1000)
    mtp.add_argument("--batch-size", type=int, default=8)
    mtp.add_argument("--lr", type=float, default=1e-3)
    mtp.add_argument("--warmup-steps", type=int, default=50)
    mtp.add_argument("--hidden-loss-weight", type=float, default=1.0)
    mtp.add_argument("--no-input-norms", action="store_true", help="drop the head's enorm/hnorm")
    mtp.add_argument("--no-init-from-last-layer", action="store_true")
    mtp.add_argument("--vocab", choices=("data", "full"), default="data")
    mtp.add_argument("--val-every", type=int, default=200)
    mtp.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (saves the head)")
    mtp.add_argument("--seed", type=int, default=0)
    mtp.add_argument("--features", default=None, help="feature cache directory (default OUT/features)")
    mtp.add_argument("--eval-only", action="store_true", help="measure the head in OUT on the held-out prompts")
    mtp.add_argument("--dtype", default="bfloat16")
    mtp.add_argument("--device", default="cpu")
    mtp.add_argument("--threads", type=int, default=None)
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
    if args.command == "train-mtp":
        return _train_mtp(args)
    return 2


def _train_mtp(args: argparse.Namespace) -> int:
    from specdec.training.mtp import MTPTrainConfig
    from specdec.training.pipeline import train_mtp_pipeline

    config = MTPTrainConfig(  # validates every number before any model is loaded
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        hidden_loss_weight=args.hidden_loss_weight,
        use_input_norms=not args.no_input_norms,
        init_from_last_layer=not args.no_init_from_last_layer,
        vocab=args.vocab,
        val_every=args.val_every,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        seed=args.seed,
    )
    train_mtp_pipeline(
        args.target,
        args.out,
        data=args.data,
        self_distill_samples=args.self_distill,
        distill_prompts=args.distill_prompt,
        distill_tokens=args.distill_tokens,
        chunk_len=args.chunk_len,
        max_chunks=args.max_chunks,
        max_bytes=args.max_bytes,
        val_prompts=args.val_prompt,
        val_k=args.val_k,
        val_tokens=args.val_tokens,
        config=config,
        dtype=args.dtype,
        device=args.device,
        features_dir=args.features,
        eval_only=args.eval_only,
    )
    return 0


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
