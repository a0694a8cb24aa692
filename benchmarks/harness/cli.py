"""The benchmark harness: specdec and transformers, plain and speculative, side by side.

One entry point runs a grid of systems x prompt sets x k x temperature x batch size, with a
warm-up and repeats. Inside every repeat the systems take turns on each prompt batch (and the
turn order rotates from repeat to repeat), so machine drift hits all of them alike. Every
system generates exactly ``--max-new-tokens`` tokens from the same prompt token ids; greedy
outputs are checked token for token against specdec-plain (``matches_plain``).

    python -m benchmarks.harness                                  # the README table
    python -m benchmarks.harness --preset cpu                     # the CPU speed table (issue 12)
    python -m benchmarks.harness --preset quant                   # bf16 / int8 / 4-bit targets (issue 17)
    python -m benchmarks.harness --systems specdec-plain,specdec-draft --k 2,4,8 --num-prompts 5
    python -m benchmarks.plots benchmarks/results/harness-latest.json   # re-plot a result

Systems:
    specdec-plain   Generator without a proposer (the baseline every ratio refers to)
    specdec-draft   Generator + DraftModel(draft, k)
    specdec-draft-vocab  the same drafting from --draft-vocab tokens only (the most frequent in
                    Python's standard library sources): a cheaper LM head, the same output
    specdec-draft-unquantized  the same with the draft's weights in --dtype even when
                    --draft-quantization is set (int8 against bf16 drafting in one run)
    specdec-draft-adaptive  the same with the default AdaptivePolicy (k at most the grid's k),
                    a fresh Generator at the start of every repeat: it learns its costs
                    from that repeat's first prompt on (the warm-up does not teach it)
    specdec-lookup  Generator + PromptLookup(k)                  (max_ngram 3)
    specdec-mtp     Generator + MTPHead(--mtp-head, k)           (a head trained for --target)
    specdec-mtp-confident  the same, k a ceiling: a chain ends after a draft of head
                    probability below --draft-confidence
    specdec-eagle   Generator + EAGLETree(--eagle-head) as a chain of k drafts
    specdec-eagle-tree  the same with EAGLE-2's dynamic tree (--tree-top-k, --tree-depth), the
                    k best nodes verified every step (k = tree size)
    specdec-eagle-tree-confident  the dynamic tree, k a ceiling: only nodes whose path
                    probability under the head reaches --tree-min-prob (the best node always)
    specdec-eagle-adaptive  the dynamic tree under the default AdaptivePolicy (at most k nodes),
                    a fresh Generator at the start of every repeat
    specdec-int8-plain, specdec-q4-plain  the target's linear layers stored as int8 / 4-bit
                    (another model: its greedy output is checked against its own plain decoder)
    specdec-int8-draft, specdec-q4-draft  the same target with a draft model stored in the
                    same format, fixed k; ``-draft-adaptive``: the default AdaptivePolicy;
                    ``-draft-confident``: fixed k as a ceiling, each chain ending after a draft
                    token of draft probability below --draft-confidence; ``-draft-adaptive-
                    confident``: both; ``-draft-confident-vocab``: confident, from --draft-vocab
                    tokens only
    llamacpp-plain  llama.cpp through llama-cpp-python on --llamacpp-target (a GGUF file, e.g.
                    the Q4_K_M the known models come from), batch 1, greedy; its own stack
    llamacpp-lookup the same with llama-cpp-python's speculation (LlamaPromptLookupDecoding,
                    k tokens, max_ngram 3; its only proposer: it has no draft-model path)
    hf-plain        transformers ``model.generate``
    hf-assisted     ``generate(assistant_model=draft)``, exactly k drafted tokens per step
    hf-lookup       ``generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)``

Per thread count (``--threads 1,2``) the run also measures the memory read bandwidth (before
and after, the better of the two) and states the plain decoding bound: a batch-1 decode step
reads every target weight once, so ``bandwidth / weight bytes`` steps per second at most.
specdec-plain's decode rate (its time less a separately timed 1-token run of the same prompts,
i.e. without the prefill) is reported as a fraction of that bound, and as a fraction of the
bound at the bandwidth probed right before and after each of its runs (the better probe), which
the machine's drift over a long run does not skew.

Output: ``<out-dir>/<out>-<stamp>.json`` (+ ``<out>-latest.json``), three PNG plots next to
it, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import write_json
from benchmarks.harness.config import HarnessConfig
from benchmarks.harness.grid import run_grid
from benchmarks.harness.prompts import PROMPT_SETS
from benchmarks.harness.report import bounds_markdown, markdown_table
from benchmarks.harness.systems import all_systems, check_systems


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"takes KEY=VALUE, got {text!r}")
    return key.replace("-", "_"), value


def _csv(cast):
    return lambda text: tuple(cast(x) for x in text.split(",") if x.strip())


def _system_ks(text: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, sep, ks = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=K[,K...], got {item!r}")
        out[name.strip()] = _csv(int)(ks)
    return out


PRESETS = {
    # Issue 12's table: every way to decode on the CPU, batch 1, one and two threads.
    "cpu": dict(
        systems=("specdec-plain", "specdec-draft", "specdec-draft-adaptive",
                 "specdec-draft-unquantized", "specdec-lookup", "hf-plain", "hf-assisted"),
        ks=(1, 2, 3, 4, 5, 6),
        # One k where the k grid would cost an hour of transformers' decoding per k: the best
        # fixed k of the int8 draft on one thread (2026-12-01).
        system_ks={"specdec-draft-unquantized": (4,), "specdec-lookup": (4,), "hf-assisted": (4,)},
        threads=(1, 2),
        draft_quantization="int8",
        num_prompts=10,
        max_new_tokens=128,
        repeats=1,
    ),
    # Issue 17's table: bf16, int8 and 4-bit targets, plain and with a draft of the same format
    # (add llamacpp-plain to --systems with --llamacpp-target FILE.gguf for the llama.cpp peer).
    "quant": dict(
        systems=("specdec-plain", "specdec-int8-plain", "specdec-int8-draft", "specdec-q4-plain",
                 "specdec-q4-draft", "specdec-q4-draft-adaptive"),
        ks=(3, 4),
        system_ks={"specdec-int8-draft": (4,), "specdec-q4-draft-adaptive": (6,)},
        threads=(1, 2),
        num_prompts=10,
        max_new_tokens=128,
        repeats=1,
    ),
}


def parse_args(argv: Sequence[str] | None = None) -> HarnessConfig:
    """The run's configuration: a ``--preset``'s values (if one is named), then the flags.

    Bad values raise ``ValueError`` (from :class:`HarnessConfig`) before any model loads.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=sorted(PRESETS))
    known, _ = pre.parse_known_args(argv)
    args = vars(_parser(HarnessConfig(**PRESETS.get(known.preset, {}))).parse_args(argv))
    args.pop("preset")
    args["proposer_options"] = dict(args["proposer_options"] or ())
    cfg = HarnessConfig(**args)
    check_systems(cfg)
    return cfg


def _parser(d: HarnessConfig) -> argparse.ArgumentParser:
    """The harness's flags, with ``d``'s values as their defaults."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="defaults for a named table (cpu: plain, int8 draft k=1..6 and adaptive, bf16 draft, "
        "lookup, transformers plain and assisted (k=4 for the last three); HumanEval 0-9 x 128 tokens; 1 and 2 threads; "
        "add specdec-mtp with --systems and --mtp-head); other flags override them",
    )
    ap.add_argument(
        "--systems", type=_csv(str), default=d.systems, help=f"comma list of {','.join(all_systems())}"
    )
    ap.add_argument(
        "--prompt-sets",
        type=_csv(str),
        default=d.prompt_sets,
        help=f"comma list of {','.join(PROMPT_SETS)}",
    )
    ap.add_argument(
        "--num-prompts", type=int, default=d.num_prompts, help="first N prompts of each set"
    )
    ap.add_argument(
        "--k", dest="ks", type=_csv(int), default=d.ks, help="num_speculative_tokens, comma list"
    )
    ap.add_argument(
        "--system-ks",
        type=_system_ks,
        default=d.system_ks,
        help="per-system k lists replacing --k, e.g. 'hf-assisted=4;specdec-lookup=2,4'",
    )
    ap.add_argument("--temperatures", type=_csv(float), default=d.temperatures)
    ap.add_argument("--batch-sizes", type=_csv(int), default=d.batch_sizes)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument(
        "--warmup", type=int, default=d.warmup, help="warm-up runs per system and group"
    )
    ap.add_argument("--warmup-tokens", type=int, default=d.warmup_tokens)
    ap.add_argument(
        "--threads", type=_csv(int), default=d.threads, help="torch.set_num_threads, comma list"
    )
    ap.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--target", default=d.target, help="known model name or HF directory")
    ap.add_argument("--draft", default=d.draft, help="known model name or HF directory")
    ap.add_argument(
        "--draft-quantization", choices=("int8",), default=d.draft_quantization,
        help="specdec draft systems: the draft's linear layers as int8",
    )
    ap.add_argument(
        "--draft-confidence", type=float, default=d.draft_confidence,
        help="the -draft-confident and -mtp-confident systems: a chain ends after a draft token of lower draft probability",
    )
    ap.add_argument("--mtp-head", default=d.mtp_head, help="MTP head directory for specdec-mtp")
    ap.add_argument("--mtp-draft-vocab", type=int, default=d.mtp_draft_vocab, help="draft vocabulary size for specdec-mtp")
    ap.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                    help="the -vocab systems: the draft model drafts from this many tokens (most frequent in stdlib code)")
    ap.add_argument("--eagle-head", default=d.eagle_head, help="EAGLE head directory for specdec-eagle*")
    ap.add_argument(
        "--head-quantization", choices=("int8", "q4"), default=d.head_quantization,
        help="specdec-mtp and specdec-eagle*: the heads' linear layers in this format",
    )
    ap.add_argument("--llamacpp-target", default=d.llamacpp_target,
                    help="the target as a GGUF file, for llamacpp-plain (llama-cpp-python)")  # fmt: skip
    ap.add_argument("--tree-top-k", type=int, default=d.tree_top_k, help="specdec-eagle-tree: children per node")
    ap.add_argument("--tree-depth", type=int, default=d.tree_depth, help="specdec-eagle-tree: depth")
    ap.add_argument("--tree-min-prob", type=float, default=d.tree_min_prob,
                    help="specdec-eagle-tree-confident: verify only nodes of at least this path probability")  # fmt: skip
    ap.add_argument(
        "--proposer-option", dest="proposer_options", type=_key_value, action="append",
        help="KEY=VALUE: an option of a plug-in proposer's system specdec-<name> (repeatable)",
    )
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out, help="result name: <out-dir>/<out>-<stamp>.json")
    ap.add_argument("--out-dir", default=d.out_dir)
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    return ap


def main(argv: Sequence[str] | None = None) -> Path:
    """Run the grid of the command line ``argv``; write the JSON (and plots); its path."""
    cfg = parse_args(argv)
    payload = run_grid(cfg)
    payload["markdown"] = markdown_table(payload["summary"])
    payload["bounds_markdown"] = bounds_markdown(payload["bounds"], payload["summary"])
    path = write_json(cfg.out, payload, out_dir=cfg.out_dir)
    print(payload["markdown"])
    print()
    print(payload["bounds_markdown"])
    print(f"\nwrote {path}")
    if cfg.plots:
        from benchmarks.plots import plot_all

        for png in plot_all(path):
            print(f"wrote {png}")
    return path

