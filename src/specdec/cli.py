"""Command line: ``specdec generate | serve | fetch | cache | demo | train-mtp | train-eagle``.

``specdec generate --proposer NAME`` (and ``specdec serve``) speculates with an entry of the proposer registry
(:mod:`specdec.proposers.registry`: the built-ins and installed plug-ins), its options
generated from the entry; ``--draft PATH``, ``--mtp-head DIR``, ``--eagle-head DIR`` and
``--prompt-lookup`` select their entries alone. Errors print one line (``specdec: error: ...``)
and exit with status 2; ``--debug`` shows the traceback instead. An option that does nothing
where it is given (``--tree-top-k`` without the EAGLE proposer, ``-k`` without any) is such an
error too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specdec.cache_command import add_cache_parser, run_cache
from specdec.config import MAX_ADDITIVE_PENALTY, MAX_LOGIT_BIAS
from specdec.proposers.registry import (
    BuildContext,
    ProposerEntry,
    ProposerOption,
    ProposerRegistry,
    load_registry,
)
from specdec.proposers.registry import positive_int_arg as _positive_int

__all__ = ["main"]

BUNDLED_MODEL = "stories260K"


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_positive_int, default=None, help="torch threads (>= 1)")


def _add_max_model_len_arg(p: argparse.ArgumentParser, default: str = "the model's context") -> None:
    p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help=f"tokens one request may reach, prompt + output (default: {default}); a longer "
                   "request is an error, never cut short")


def _add_model_impl_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto",
                   help="auto (default): a native family natively, any other transformers causal LM on "
                   "the transformers adapter (exact, slower); native: refuse others; transformers: "
                   "always the adapter (docs/models.md)")


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", help="dtype of the weights (default bfloat16)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt, at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this much probability (1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest one's probability")
    p.add_argument("--seed", type=int, default=None, help="seed of sampled requests: the same output every run")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="stop at this token id, >= 0 (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past end-of-sequence up to --max-new-tokens")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no end-of-sequence or --stop-token-id before N new tokens (0..--max-new-tokens; default 0)")
    p.add_argument("--n", type=int, default=1, metavar="N",
                   help="samples per prompt, >= 1 (default 1; more than 1 needs --temperature > 0)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="log-probabilities of each new token and its N likeliest alternatives (N >= 0)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="log-probabilities of each prompt token and its N likeliest alternatives (N >= 0)")
    logits = p.add_argument_group("logits", "change the target's logits before sampling (speculation keeps "
                                  "the output of the changed target exactly)")
    logits.add_argument("--repetition-penalty", type=float, default=1.0, metavar="F",
                        help="divide a positive logit of a token already in the prompt or output by F, "
                        "multiply a negative one (F > 0; 1 is off, the default)")
    logits.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                        help=f"subtract F times a token's count in the output from its logit "
                        f"(-{MAX_ADDITIVE_PENALTY:g}..{MAX_ADDITIVE_PENALTY:g}; default 0)")
    logits.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                        help=f"subtract F from the logit of every token already in the output "
                        f"(-{MAX_ADDITIVE_PENALTY:g}..{MAX_ADDITIVE_PENALTY:g}; default 0)")
    logits.add_argument("--logit-bias", action="append", type=_logit_bias, default=[], metavar="ID=BIAS",
                        help=f"add BIAS (-{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}) to token ID's logit "
                        "(repeatable, one token each)")
    logits.add_argument("--allowed-token-ids", type=_int_list, default=None, metavar="I,J,K",
                        help="sample only these token ids, >= 0 (default: every token)")
    logits.add_argument("--bad-word", action="append", default=[], metavar="WORD",
                        help="never generate this word or phrase, with or without a leading space (repeatable)")
    structured = p.add_argument_group("structured output", "constrain the output to one of these (at most one)")
    one = structured.add_mutually_exclusive_group()
    one.add_argument("--json-schema", type=_json_schema, default=None, metavar="FILE_OR_JSON",
                     help="JSON that follows this schema: a .json file or inline JSON text ('{...}')")
    one.add_argument("--regex", default=None, metavar="R", help="text that matches this regular expression")
    one.add_argument("--choice", action="append", default=None, metavar="C",
                     help="exactly one of these strings (repeatable: one choice each)")
    one.add_argument("--grammar", type=_read_text, default=None, metavar="FILE",
                     help="text in the language of this EBNF grammar file")
    one.add_argument("--json-object", action="store_true", help="any JSON object")


def _sampling_params(args: argparse.Namespace):
    """The ``SamplingParams`` of the sampling flags; its validators check every value (a
    ``ValueError`` naming the field, reported like any other error)."""
    from specdec import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=_logit_bias_map(args.logit_bias),
        allowed_token_ids=args.allowed_token_ids,
        bad_words=tuple(args.bad_word),
        min_tokens=args.min_tokens,
        structured_output=_structured_output(args),
        n=args.n,
        prompt_logprobs=args.prompt_logprobs,
    )


def _logit_bias(text: str) -> tuple[int, float]:
    """argparse type: ``ID=BIAS`` (``50256=-100``)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be ID=BIAS (an int token id = a number), got {text!r}") from None


def _logit_bias_map(pairs: list[tuple[int, float]]) -> dict[int, float]:
    """``--logit-bias`` pairs as a mapping; a token biased twice is an error, not a silent pick."""
    bias: dict[int, float] = {}
    for token, value in pairs:
        if token in bias:
            raise ValueError(f"--logit-bias gives token {token} twice ({bias[token]:g} and {value:g})")
        bias[token] = value
    return bias


def _read_text(path: str, hint: str = "") -> str:
    """argparse type: the text of a file (an EBNF grammar, a JSON schema)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {reason}{hint}") from None


def _json_schema(text: str) -> dict:
    """argparse type: a JSON schema object, inline (``'{"type": "object"}'``) or the path of a
    JSON file. Text that starts with ``{`` is inline JSON; anything else is a path."""
    inline = text.lstrip().startswith("{")
    source = text if inline else _read_text(text, " (inline JSON starts with '{')")
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        where = "" if inline else f" in {text!r}"
        raise argparse.ArgumentTypeError(f"invalid JSON{where}: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return schema


def _structured_output(args: argparse.Namespace):
    """The ``StructuredOutput`` of the one structured-output flag given (argparse refuses two),
    or ``None``."""
    from specdec.config import StructuredOutput

    given = {
        name: value
        for name, value in (("json_schema", args.json_schema), ("regex", args.regex),
                            ("choice", args.choice), ("grammar", args.grammar))
        if value is not None
    }  # fmt: skip
    if args.json_object:
        given["json_object"] = True
    return StructuredOutput(**given) if given else None


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
    p.add_argument("--distill-temperature", type=float, default=1.0, help="sampling temperature of self-distillation")
    p.add_argument("--distill-batch-size", type=int, default=None, help="generations run at once (default 64; 16 for a CPU model of 100M parameters or more)")
    p.add_argument("--distill-stop-at-eos", action="store_true",
                   help="end a generation at end-of-sequence and join them before cutting chunks")
    p.add_argument("--chunk-len", type=int, default=256, help="tokens per training chunk")
    p.add_argument("--max-chunks", type=int, default=None, help="use at most this many chunks of the text files")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text files")
    p.add_argument("--val-prompt", action="append", default=[], help="held-out prompt (default: beginnings of held-out chunks)")
    p.add_argument("--val-tokens", type=int, default=64, help="tokens generated per held-out prompt when measuring acceptance")
    p.add_argument("--steps", type=int, default=1000, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=8, help="chunks per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps of linear learning-rate warm-up")
    p.add_argument("--hidden-loss-weight", type=float, default=1.0, help="weight of the loss on predicted hidden states")
    p.add_argument("--val-every", type=int, default=200, help="validate every this many steps")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long (saves the head)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation, data order and the held-out split")
    p.add_argument("--features", default=None, help="feature cache directory (default OUT/features)")
    p.add_argument("--eval-only", action="store_true", help="measure the head in OUT on the held-out prompts")
    _add_device_args(p)
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


def build_parser(registry: ProposerRegistry) -> argparse.ArgumentParser:
    """The ``specdec`` parser; ``generate`` takes the options of ``registry``'s entries."""
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, help="what to do")
    _add_generate(sub.add_parser("generate", help="generate text for a prompt"), registry)
    _add_serve(sub.add_parser("serve", help="serve a model over the OpenAI API (docs/serving.md)"), registry)
    fetch = sub.add_parser("fetch", help="download and convert a known model into the cache")
    fetch.add_argument("model", help="known model name")
    cache = sub.add_parser("cache", help="list or clear what specdec keeps on disk (packed weights, kernel builds, models)")
    add_cache_parser(cache)
    _add_demo(sub.add_parser("demo", help="run the demo on the default model pair"))
    mtp = sub.add_parser("train-mtp", help="train an MTP head for a target (see docs/mtp.md)")
    _add_training_args(mtp)
    _add_train_mtp(mtp)
    eagle = sub.add_parser("train-eagle", help="train an EAGLE-1/2 or EAGLE-3 head for a target (see docs/eagle.md)")
    _add_training_args(eagle)
    _add_train_eagle(eagle)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The command parsers by name (argparse keeps them on its private subparsers action)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _add_generate(gen: argparse.ArgumentParser, registry: ProposerRegistry) -> None:
    gen.add_argument("--target", required=True, help="HF directory, .gguf file or model name")
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    _add_device_args(gen)
    gen.add_argument(
        "--quantization",
        choices=("int8", "q4"),
        default=None,
        help="store the target's linear layers as int8 or 4-bit (CPU; a smaller, faster model "
        "with its own output, which speculation reproduces exactly)",
    )
    _add_max_model_len_arg(gen)
    _add_model_impl_arg(gen)
    _add_threads_arg(gen)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    _add_sampling_args(gen)
    _add_proposer_args(gen, registry)


def _add_serve(serve: argparse.ArgumentParser, registry: ProposerRegistry) -> None:
    serve.add_argument("model", help="HF directory, .gguf file or model name")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (repeatable: several keys; each key's "
                       "requests share cached prefixes only with the same key's)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients send (default: MODEL as given)")
    serve.add_argument("--max-pending", type=_positive_int, default=256, metavar="N",
                       help="requests running or queued at most; more get 429 with Retry-After (default 256)")
    serve.add_argument("--max-batch-size", type=_positive_int, default=None, metavar="N",
                       help="requests decoded together at most (default: CacheConfig's, 8)")
    _add_max_model_len_arg(serve)
    serve.add_argument("--num-pages", type=_positive_int, default=None, metavar="N",
                       help="KV pages of the cache (default: sized from the model and batch)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="recompute every prompt (automatic prefix caching is on by default)")
    serve.add_argument("--chat-template", type=_read_text, default=None, metavar="FILE",
                       help="Jinja chat template replacing the tokenizer's")
    serve.add_argument("--drain-timeout", type=float, default=300.0, metavar="S",
                       help="on SIGINT/SIGTERM, seconds in-flight requests may still run (default 300)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="uvicorn's log level (default info)")
    _add_device_args(serve)
    serve.add_argument("--quantization", choices=("int8", "q4"), default=None,
                       help="store the target's linear layers as int8 or 4-bit (CPU)")
    _add_model_impl_arg(serve)
    _add_threads_arg(serve)
    _add_proposer_args(serve, registry)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {value}")
    return value


def _add_proposer_args(gen: argparse.ArgumentParser, registry: ProposerRegistry) -> None:
    """``--proposer``, ``-k``, ``--policy`` and, per registry entry, a group of its options."""
    group = gen.add_argument_group("speculation", "without a proposer, generate decodes plainly")
    group.add_argument("--proposer", choices=registry.names(), default=None,
                       help="speculate with this proposer of the registry (its options below)")
    widths = ", ".join(f"{e.name} {e.num_speculative_tokens}" for e in registry.entries)
    group.add_argument("--num-speculative-tokens", "-k", type=_positive_int, default=None, metavar="K",
                       help=f"the proposer's width: drafts per step, or a tree's nodes verified "
                       f"(default: {widths})")
    group.add_argument("--policy", choices=("adaptive", "fixed"), default=None,
                       help="adaptive: k per request and step, at most -k (default); fixed: always -k")
    for entry in registry.entries:
        options = gen.add_argument_group(f"--proposer {entry.name}", _escape(entry.help))
        for option in entry.options:
            _add_option(options, entry, option)


def _add_option(group, entry: ProposerEntry, option: ProposerOption) -> None:
    """One entry option as a flag. Its default is applied when the proposer is built, so the
    flag's own default (None) tells whether it was given."""
    help = f"{option.help} (--proposer {entry.name}"
    if option.selects:
        help += "; alone selects it"
    if option.default is not None and option.type is not bool:
        help += f"; default {option.default}"
    kwargs = {"action": "store_true"} if option.type is bool else {
        "type": option.type, "choices": option.choices, "metavar": option.metavar}
    try:
        group.add_argument(option.flag, dest=option.name, default=None, help=_escape(help + ")"), **kwargs)
    except argparse.ArgumentError:
        raise ValueError(f"option {option.flag} of proposer {entry.name!r} ({entry.origin}) "
                         "clashes with a flag of specdec generate") from None


def _escape(help: str) -> str:
    return help.replace("%", "%%")  # argparse formats help with %-style placeholders


def _add_demo(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--target", default=None, help="target model (default: the demo pair's)")
    demo.add_argument("--draft", default=None, help="draft model (default: the demo pair's)")
    demo.add_argument("--prompt", action="append", default=None,
                      help="prompt (repeatable; default: three code prompts)")
    demo.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    demo.add_argument("--num-speculative-tokens", "-k", type=_positive_int, default=None,
                      help="drafts per step (default: 6 adaptive, 4 fixed)")
    demo.add_argument("--dtype", default="bfloat16", help="dtype of the weights (default bfloat16)")
    _add_max_model_len_arg(demo, default="2048, or the target's context if shorter")
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


def _add_train_mtp(mtp: argparse.ArgumentParser) -> None:
    mtp.add_argument("--val-k", type=int, default=1, help="drafts per step when measuring acceptance")
    mtp.add_argument("--no-input-norms", action="store_true", help="drop the head's enorm/hnorm")
    mtp.add_argument("--no-init-from-last-layer", action="store_true",
                     help="start the head's layer fresh, not from the target's last layer")
    mtp.add_argument("--vocab", choices=("data", "full"), default="data",
                     help="the LM-head rows trained against: the tokens in the data (default) or all")


def _add_train_eagle(eagle: argparse.ArgumentParser) -> None:
    eagle.add_argument("--kind", choices=("eagle1", "eagle3"), default="eagle1",
                       help="eagle1: an EAGLE-1/2 head on the last hidden state (default); eagle3: "
                       "on three target layers")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (2 for any error, after a one-line message)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        registry = load_registry()  # a broken or clashing plug-in: one line naming it
        parser = build_parser(registry)
    except Exception as exc:  # noqa: BLE001 - a plug-in's failure, reported like any other
        return _report(exc, debug="--debug" in argv)  # not parsed yet: the parser needs the registry
    args = parser.parse_args(argv)  # usage errors: argparse prints them and exits 2
    selection = None
    if args.command in ("generate", "serve"):
        try:
            selection = _select_proposer(args, registry)
        except _ContextError as exc:  # a usage error too: usage, one line, exit 2
            _subparsers(parser)[args.command].error(str(exc))
    try:
        return _run(args, registry, selection)
    except Exception as exc:  # noqa: BLE001 - the command line reports every failure alike
        return _report(exc, debug=args.debug)


def _report(exc: Exception, *, debug: bool) -> int:
    if debug:
        raise exc
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"specdec: error: {message} (--debug shows the traceback)", file=sys.stderr)
    return 2


class _ContextError(Exception):
    """An option given where it does nothing; reported as a usage error."""


_Selection = tuple["ProposerEntry | None", dict]  # the entry chosen (None: plain) and its options


def _select_proposer(args: argparse.Namespace, registry: ProposerRegistry) -> _Selection:
    """The entry the flags select (``None``: plain decoding) and the options given to it.
    Two proposers at once, or an option of another proposer (or of none), is an error."""
    given = [(e, o) for e in registry.entries for o in e.options if getattr(args, o.name) is not None]
    choosers = [(o.flag, e) for e, o in given if o.selects]
    if args.proposer is not None:
        choosers.insert(0, (f"--proposer {args.proposer}", registry.entry(args.proposer)))
    first_flag, entry = choosers[0] if choosers else (None, None)
    for flag, other in choosers:
        if other is not entry:
            raise _ContextError(f"argument {flag}: not allowed with argument {first_flag} (one proposer at a time)")
    for other, option in given:
        if other is not entry:
            where = f", not with {first_flag}" if entry else " (no proposer is chosen)"
            raise _ContextError(f"argument {option.flag}: only with --proposer {other.name}{where}")
    if entry is None:
        for flag, value in (("-k/--num-speculative-tokens", args.num_speculative_tokens), ("--policy", args.policy)):
            if value is not None:  # plain decoding has no width and no policy
                raise _ContextError(f"argument {flag}: not allowed without a proposer (--proposer NAME)")
        return None, {}
    for option in entry.options:
        if option.required and getattr(args, option.name) is None:
            raise _ContextError(f"--proposer {entry.name} needs {option.flag} {option.metavar or option.name.upper()}")
    options = {o.name: getattr(args, o.name) for o in entry.options}
    options["num_speculative_tokens"] = args.num_speculative_tokens
    return entry, options


def _run(args: argparse.Namespace, registry: ProposerRegistry, selection: _Selection | None) -> int:
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "generate":
        return _generate(args, registry, selection)
    if args.command == "serve":
        return _serve(args, registry, selection)
    if args.command == "fetch":
        from specdec.hub import fetch

        print(fetch(args.model))
        return 0
    if args.command == "cache":
        return run_cache(args)
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
    from specdec.models.eagle_head import EagleKind
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


def _generate(args: argparse.Namespace, registry: ProposerRegistry, selection: _Selection) -> int:
    from specdec import CacheConfig, Generator

    params = _sampling_params(args)  # validated before any model is loaded
    if args.stream and params.n > 1:
        raise ValueError(f"--stream streams one sample per prompt; got --n {params.n} (drop --stream)")
    context = BuildContext(target=args.target, device=args.device, dtype=args.dtype, quantization=args.quantization)
    entry, options = selection
    proposer = None if entry is None else registry.build(entry.name, options, context, parsed=True)
    fixed = proposer is not None and args.policy == "fixed"
    policy = proposer.num_speculative_tokens if fixed else None
    gen = Generator.from_pretrained(
        args.target, proposer=proposer, dtype=args.dtype, device=args.device, policy=policy,
        quantization=args.quantization, cache_config=CacheConfig(max_model_len=args.max_model_len),
        model_impl=args.model_impl,
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
            for i, sample in enumerate(out if isinstance(out, list) else [out]):
                label = f" (sample {i + 1} of {params.n})" if params.n > 1 else ""
                print(f"--- {prompt!r}{label}\n{sample.text}\n")
    elapsed = time.perf_counter() - start
    m = gen.metrics
    summary = f"{m.num_generated_tokens} tokens in {elapsed:.2f}s, {m.num_generated_tokens / elapsed:.1f} tok/s"
    if proposer is not None:
        summary += f", drafted {m.num_drafted}, accepted {m.num_accepted}"
        summary += f", acceptance {m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}"
    print(f"[{summary}]")
    return 0


def _serve(args: argparse.Namespace, registry: ProposerRegistry, selection: _Selection) -> int:
    try:
        from specdec.server import ServerConfig, serve
    except ImportError as exc:
        raise ValueError(f"specdec serve needs the serve extra: pip install 'specdec[serve]' ({exc})") from None
    from specdec import CacheConfig, Generator

    config = ServerConfig(model_name=args.served_model_name or args.model, api_keys=tuple(args.api_key),
                          max_pending=args.max_pending, chat_template=args.chat_template,
                          drain_timeout_s=args.drain_timeout)  # fmt: skip
    cache = {"prefix_caching": not args.no_prefix_cache, "max_model_len": args.max_model_len}
    if args.max_batch_size is not None:
        cache["max_batch_size"] = args.max_batch_size
    if args.num_pages is not None:
        cache["num_pages"] = args.num_pages
    context = BuildContext(target=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    entry, options = selection
    proposer = None if entry is None else registry.build(entry.name, options, context, parsed=True)
    policy = proposer.num_speculative_tokens if proposer is not None and args.policy == "fixed" else None
    gen = Generator.from_pretrained(args.model, proposer=proposer, dtype=args.dtype, device=args.device,
                                    policy=policy, quantization=args.quantization,
                                    cache_config=CacheConfig(**cache), model_impl=args.model_impl)  # fmt: skip
    serve(gen, config, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def bundled_model_path() -> Path:
    """The stories260K model shipped with the repository for tests and the offline example."""
    return Path(__file__).resolve().parent / "data" / BUNDLED_MODEL


if __name__ == "__main__":
    raise SystemExit(main())
