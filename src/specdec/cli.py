"""Command line: ``specdec generate | fetch | demo | train-mtp | train-eagle``.

Errors print one line (``specdec: error: ...``) and exit with status 2; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

BUNDLED_MODEL = "stories260K"


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--threads 0`` is refused, not taken as 'all')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (>= 1)")


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


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated ints (``2,4,5``)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {text!r}") from None


def _add_training_args(p: argparse.ArgumentParser) -> None:
    """Flags every head trainer shares (data, features, optimisation, budget)."""
    p.add_argument("--target", required=True, help="HF directory, .gguf file or model name")
    p.add_argument("--out", required=True, help="directory for the head, checkpoints and logs")
    p.add_argument("--data", action="append", default=[], help="text file, directory or glob (repeatable)")
    p.add_argument("--self-distill", type=int, default=0, metavar="N", help="train on N sampled generations of the target")
    p.add_argument("--distill-prompt", action="append", default=[], help="prompt for self-distillation (repeatable; default BOS)")
    p.add_argument("--distill-prompts", default=None, metavar="FILE",
                   help="JSON-lines file of self-distillation prompts (strings, token-id lists or {\"prompt\": ...})")
    p.add_argument("--distill-tokens", type=int, default=256, help="new tokens per generation (at most, with --distill-stop-at-eos)")
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--distill-batch-size", type=int, default=None, help="generations run at once (default 64; 16 for a CPU model of 100M parameters or more)")
    p.add_argument("--distill-stop-at-eos", action="store_true",
                   help="end a generation at end-of-sequence and join them before cutting chunks")
    p.add_argument("--chunk-len", type=int, default=256)
    p.add_argument("--max-chunks", type=int, default=None)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--val-prompt", action="append", default=[], help="held-out prompt (default: beginnings of held-out chunks)")
    p.add_argument("--val-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--hidden-loss-weight", type=float, default=1.0)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (saves the head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--features", default=None, help="feature cache directory (default OUT/features)")
    p.add_argument("--eval-only", action="store_true", help="measure the head in OUT on the held-out prompts")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    _add_threads_arg(p)


def _training_args(args: argparse.Namespace) -> tuple[dict, dict]:
    """``(config fields, pipeline keywords)`` the shared training flags map to; the data flags
    become one ``TrainData`` (validated here, before any model is loaded)."""
    from specdec.training.data import TrainData, read_prompts

    config = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        hidden_loss_weight=args.hidden_loss_weight,
        val_every=args.val_every,
        max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        seed=args.seed,
    )
    data = TrainData(
        files=args.data,
        self_distill_samples=args.self_distill,
        distill_prompts=[*args.distill_prompt, *(read_prompts(args.distill_prompts) if args.distill_prompts else [])],
        distill_tokens=args.distill_tokens,
        distill_temperature=args.distill_temperature,
        distill_batch_size=args.distill_batch_size,
        distill_stop_at_eos=args.distill_stop_at_eos,
        chunk_len=args.chunk_len,
        max_chunks=args.max_chunks,
        max_bytes=args.max_bytes,
        val_prompts=args.val_prompt,
        val_tokens=args.val_tokens,
    )
    pipeline = dict(
        data=data,
        dtype=args.dtype,
        device=args.device,
        features_dir=args.features,
        eval_only=args.eval_only,
    )
    return config, pipeline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt")
    gen.add_argument("--target", required=True, help="HF directory, .gguf file or model name")
    proposer = gen.add_mutually_exclusive_group()
    proposer.add_argument("--draft", default=None, help="speculate with this draft model")
    proposer.add_argument("--mtp-head", default=None, help="speculate with this MTP head directory")
    proposer.add_argument(
        "--prompt-lookup", action="store_true", help="speculate by prompt lookup (n-grams)"
    )
    proposer.add_argument(
        "--eagle-head", default=None, help="speculate with a tree drafted by this EAGLE head directory"
    )
    gen.add_argument(
        "--num-speculative-tokens",
        "-k",
        type=_positive_int,
        default=None,
        help="drafts per step (default 4); with --eagle-head: tree nodes verified (default 16)",
    )
    gen.add_argument("--tree-top-k", type=_positive_int, default=4, help="--eagle-head: children per expanded node")
    gen.add_argument("--tree-depth", type=_positive_int, default=5, help="--eagle-head: tree depth")
    gen.add_argument(
        "--draft-quantization",
        choices=("int8", "q4"),
        default=None,
        help="store the draft model's linear layers as int8 or 4-bit (CPU; faster drafting, "
        "same output)",
    )
    gen.add_argument(
        "--draft-confidence",
        type=float,
        default=0.0,
        help="--draft: end a chain after a draft token the draft gives less than this "
        "probability (0 <= c < 1; -k is then a ceiling; 0, the default, always drafts -k)",
    )
    gen.add_argument(
        "--quantization",
        choices=("int8", "q4"),
        default=None,
        help="store the target's linear layers as int8 or 4-bit (CPU; a smaller, faster model "
        "with its own output, which speculation reproduces exactly)",
    )
    gen.add_argument(
        "--policy",
        choices=("adaptive", "fixed"),
        default="adaptive",
        help="adaptive: k per request and step, at most -k (default); fixed: always -k",
    )
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--device", default="cpu")
    _add_threads_arg(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
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
    demo.add_argument(
        "--quantization",
        choices=("int8", "q4", "none"),
        default="none",
        help="the target's linear layers as int8 or 4-bit (a smaller model with its own output; "
        "plain and speculative decoding both use it) or as --dtype (default)",
    )
    demo.add_argument(
        "--draft-quantization",
        choices=("int8", "q4", "none"),
        default=None,
        help="the draft's linear layers (default: --quantization when set, else int8: fewer "
        "bytes to read per draft token; the output is the target's either way)",
    )
    _add_threads_arg(demo)
    demo.add_argument(
        "--policy",
        choices=("adaptive", "fixed"),
        default="adaptive",
        help="adaptive: k per request and step, at most -k (default 6); fixed: always -k "
        "(default 4)",
    )

    mtp = sub.add_parser("train-mtp", help="train an MTP head for a target (see docs/mtp.md)")
    _add_training_args(mtp)
    mtp.add_argument("--val-k", type=int, default=1)
    mtp.add_argument("--no-input-norms", action="store_true", help="drop the head's enorm/hnorm")
    mtp.add_argument("--no-init-from-last-layer", action="store_true")
    mtp.add_argument("--vocab", choices=("data", "full"), default="data")

    eagle = sub.add_parser("train-eagle", help="train an EAGLE-1/2 or EAGLE-3 head for a target (see docs/eagle.md)")
    _add_training_args(eagle)
    eagle.add_argument("--kind", choices=("eagle1", "eagle3"), default="eagle1")
    eagle.add_argument("--target-layers", type=_int_list, default=None, metavar="I,J,K",
                       help="target layers the head feeds on (EAGLE-3; default 2,N//2,N-3)")
    eagle.add_argument("--draft-vocab-size", type=_positive_int, default=None,
                       help="EAGLE-3: draft over the N most frequent training tokens (default min(vocab, 32000))")
    eagle.add_argument("--ttt-steps", type=_positive_int, default=None,
                       help="draft steps unrolled in the loss (default: 1 for eagle1, 7 for eagle3)")
    eagle.add_argument("--token-loss-weight", type=float, default=0.1, help="EAGLE-1 cross-entropy weight")
    eagle.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise on input features")
    eagle.add_argument("--init-from-last-layer", action="store_true", help="start the layer from the target's last layer")
    eagle.add_argument("--freeze-lm-head", action="store_true",
                       help="EAGLE-3: keep the head's LM head and norm (the target's) fixed")
    eagle.add_argument("--top-k", type=_positive_int, default=4, help="validation tree: children per node")
    eagle.add_argument("--depth", type=_positive_int, default=5, help="validation tree: depth")
    eagle.add_argument("--num-verify-tokens", type=_positive_int, default=16, help="validation tree: nodes verified")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (2 for any error, after a one-line message)."""
    args = _parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    try:
        return _run(args)
    except Exception as exc:  # noqa: BLE001 - the command line reports every failure alike
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"specdec: error: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "threads", None) is not None:
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
    if args.command == "train-eagle":
        return _train_eagle(args)
    return 2


def _train_mtp(args: argparse.Namespace) -> int:
    from specdec.training.mtp import MTPTrainConfig
    from specdec.training.pipeline import train_mtp_pipeline

    fields, pipeline = _training_args(args)
    # The config validates every number before any model is loaded.
    config = MTPTrainConfig(use_input_norms=not args.no_input_norms, vocab=args.vocab,
                            init_from_last_layer=not args.no_init_from_last_layer, **fields)
    train_mtp_pipeline(args.target, args.out, val_k=args.val_k, config=config, **pipeline)
    return 0


def _train_eagle(args: argparse.Namespace) -> int:
    from specdec.models.eagle import EagleKind
    from specdec.training.eagle import EagleTrainConfig
    from specdec.training.pipeline import train_eagle_pipeline

    fields, pipeline = _training_args(args)
    config = EagleTrainConfig(
        kind=EagleKind(args.kind),
        target_layers=args.target_layers,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        token_loss_weight=args.token_loss_weight,
        noise=args.noise,
        init_from_last_layer=args.init_from_last_layer,
        freeze_lm_head=args.freeze_lm_head,
        **fields,
    )
    train_eagle_pipeline(args.target, args.out, top_k=args.top_k, depth=args.depth,
                         num_verify_tokens=args.num_verify_tokens, config=config, **pipeline)
    return 0


def _proposer(args: argparse.Namespace):
    """The proposer the flags name (``None``: plain decoding)."""
    if args.eagle_head:
        from specdec.proposers import EAGLETree

        return EAGLETree.from_pretrained(
            args.eagle_head,
            top_k=args.tree_top_k,
            depth=args.tree_depth,
            num_verify_tokens=args.num_speculative_tokens or 16,
        )
    k = args.num_speculative_tokens or 4
    if args.draft:
        from specdec.proposers import DraftModel

        return DraftModel.from_pretrained(
            args.draft,
            num_speculative_tokens=k,
            dtype=args.dtype,
            device=args.device,
            quantization=args.draft_quantization,
            confidence_threshold=args.draft_confidence,
        )
    if args.mtp_head:
        from specdec.proposers import MTPHead

        return MTPHead.from_pretrained(args.mtp_head, num_speculative_tokens=k)
    if args.prompt_lookup:
        from specdec.proposers import PromptLookup

        return PromptLookup(num_speculative_tokens=k)
    return None


def _generate(args: argparse.Namespace) -> int:
    from specdec import Generator

    params = _sampling_params(args)  # validated before any model is loaded
    proposer = _proposer(args)
    fixed = proposer is not None and args.policy == "fixed"
    policy = proposer.num_speculative_tokens if fixed else None
    gen = Generator.from_pretrained(
        args.target, proposer=proposer, dtype=args.dtype, device=args.device, policy=policy,
        quantization=args.quantization,
    )  # fmt: skip
    start = time.perf_counter()
    if args.stream:  # each prompt in turn, its text as it comes
        for prompt in args.prompt:
            print(f"--- {prompt!r}")
            for delta in gen.stream(prompt, params):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n\n")
    else:
        outs = gen.generate(list(args.prompt), params)
        for prompt, out in zip(args.prompt, outs):
            print(f"--- {prompt!r}\n{out.text}\n")
    elapsed = time.perf_counter() - start
    m = gen.metrics
    summary = f"{m.num_generated_tokens} tokens in {elapsed:.2f}s, {m.num_generated_tokens / elapsed:.1f} tok/s"
    if proposer is not None:
        summary += f", acceptance {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}"
    print(f"[{summary}]")
    return 0


def bundled_model_path() -> Path:
    """The stories260K model shipped with the repository for tests and the offline example."""
    return Path(__file__).resolve().parent / "data" / BUNDLED_MODEL


if __name__ == "__main__":
    raise SystemExit(main())
