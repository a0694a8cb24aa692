"""Tensor parallelism on this machine: TP=2 (two ranks, one thread each) against TP=1.

One launch of two ranks runs every system, interleaved: the TP=2 generators on both ranks, and
on rank 0 alone (rank 1 waits, blocked, not spinning) the one-process generators with one and
with two threads. ``tp2-plain-replicated-head`` is ``tp2-plain`` with its LM head not split
(the leader computes the logits alone), to measure which is faster. Every system decodes the same prompts (batch 1, greedy, exactly
``--max-new-tokens`` tokens); the turn order rotates from repeat to repeat, and every greedy
output is compared with one-process plain decoding. It also times the collectives alone (an
all-reduce of one hidden row, a step message, a gather of half the vocabulary's logits) and the
LM head, to say what a vocab-parallel head would save.

    python -m benchmarks.tensor_parallel --max-new-tokens 64 --num-prompts 3 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch

# name -> (generator, threads of rank 0); "tp2" generators run on both ranks (1 thread each).
SYSTEMS = {
    "tp1-1t-plain": ("tp1-plain", 1),
    "tp1-2t-plain": ("tp1-plain", 2),
    "tp2-plain": ("tp2-plain", 1),
    "tp2-plain-replicated-head": ("tp2-plain", 1),  # the same shards, the head not split
    "tp1-1t-draft": ("tp1-draft", 1),
    "tp1-2t-draft": ("tp1-draft", 2),
    "tp2-draft": ("tp2-draft", 1),
}


def _schedule(repeats: int) -> list[str]:
    """Every system once per repeat, the order rotated each repeat (drift hits all alike)."""
    names, order = list(SYSTEMS), []
    for r in range(repeats):
        shift = r % len(names)
        order += names[shift:] + names[:shift]
    return order


def _run(args) -> dict | None:
    from benchmarks.common import humaneval_prompts
    from specdec import FixedPolicy, Generator, SamplingParams
    from specdec.proposers import DraftModel

    rank = int(os.environ["RANK"])
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    # One draft model for both speculative systems (they run one after another; each request
    # releases its state): two copies would not fit in memory beside everything else.
    shared = DraftModel.from_pretrained(args.draft, num_speculative_tokens=args.k) if rank == 0 else None

    def draft():
        return shared

    load = time.perf_counter()
    gens = {
        "tp2-plain": Generator.from_pretrained(args.target, tensor_parallel_size=2),
        "tp2-draft": Generator.from_pretrained(
            args.target, tensor_parallel_size=2, proposer=draft(), policy=FixedPolicy(args.k)
        ),
    }
    load_s = time.perf_counter() - load
    if rank == 0:
        plain = Generator.from_pretrained(args.target)
        gens["tp1-plain"] = plain
        gens["tp1-draft"] = plain.with_proposer(draft(), policy=FixedPolicy(args.k))
    prompts = humaneval_prompts(args.num_prompts) if rank == 0 else [None] * args.num_prompts
    encoded = [gens["tp2-plain"].encode(p) for p in prompts] if rank == 0 else prompts
    # Warm-up: one short call of every generator.
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for name in ("tp2-plain", "tp2-draft"):
        gens[name].generate(encoded[0] if rank == 0 else [1], warm)
    if rank == 0:
        gens["tp1-plain"].generate(encoded[0], warm)
        gens["tp1-draft"].generate(encoded[0], warm)
    times = {s: 0.0 for s in SYSTEMS}
    tokens = {s: [] for s in SYSTEMS}
    for system in _schedule(args.repeats):
        name, threads = SYSTEMS[system]
        if name.startswith("tp1") and rank != 0:
            continue
        torch.set_num_threads(threads)
        gen = gens[name]
        # Replicated head: every rank drops its vocab shard for this system's turn, so the
        # leader computes the logits with its whole LM head (which it keeps for proposers).
        shard = gen.target.head_shard if name.startswith("tp2") else None
        if system.endswith("replicated-head"):
            gen.target.head_shard = None
        for prompt in encoded:
            start = time.perf_counter()
            out = gen.generate(prompt if rank == 0 else [1], params)
            times[system] += time.perf_counter() - start
            if out is not None:
                tokens[system].append(out.token_ids)
        if shard is not None:
            gen.target.head_shard = shard
    torch.set_num_threads(1)
    collectives = _time_collectives(gens["tp2-plain"], rank)
    if rank != 0:
        return None
    ref = tokens["tp1-1t-plain"][: args.num_prompts]
    generated = args.num_prompts * args.repeats * args.max_new_tokens
    results = {}
    for s in SYSTEMS:
        outs = tokens[s]
        results[s] = {
            "tokens_per_s": generated / times[s],
            "seconds": times[s],
            "matches_tp1_plain": all(o == ref[i % args.num_prompts] for i, o in enumerate(outs)),
        }
    for s in SYSTEMS:
        kind = "draft" if "draft" in s else "plain"
        rate = results[s]["tokens_per_s"]
        results[s]["vs_tp1_1t_plain"] = rate / results["tp1-1t-plain"]["tokens_per_s"]
        results[s]["vs_tp1_1t_same_kind"] = rate / results[f"tp1-1t-{kind}"]["tokens_per_s"]
        results[s]["vs_tp1_2t_same_kind"] = rate / results[f"tp1-2t-{kind}"]["tokens_per_s"]
    head_s = _time_lm_head(gens["tp1-plain"])
    return {"systems": results, "collectives": collectives, "lm_head_s": head_s, "tp2_load_s": load_s}


def _time_collectives(gen, rank: int, n: int = 300) -> dict:
    """Seconds per all-reduce of one hidden row (fp32, as the row-parallel layers send it),
    per step message of a decode step, per gather of half the vocabulary's logits, and per
    gloo ``all_reduce`` of the same row (what the point-to-point all-reduce replaced)."""
    import torch.distributed as dist

    from specdec.distributed.messages import MessageKind, encode

    group = gen.target.group
    hidden, vocab = gen.target.config.hidden_size, gen.target.config.vocab_size
    row = torch.zeros(1, hidden, dtype=torch.float32)
    message = encode(MessageKind.END_CALL, [list(range(40))])
    half = torch.zeros(1, vocab // 2, dtype=torch.float32)
    out: dict[str, float] = {}
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        group.all_reduce(row)
    out["all_reduce_hidden_row_s"] = (time.perf_counter() - start) / n
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            group.send_message(message)
        else:
            group.receive_message()
    out["step_message_s"] = (time.perf_counter() - start) / n
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n // 3):
        group.gather_to_leader(half)
    out["gather_half_vocab_logits_s"] = (time.perf_counter() - start) / (n // 3)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n // 3):
        dist.all_reduce(row)
    out["gloo_all_reduce_hidden_row_s"] = (time.perf_counter() - start) / (n // 3)
    layers = gen.target.config.num_layers
    out["collectives_per_decode_step"] = 2 * layers + 2  # all-reduces, the message, the gather
    out["est_collective_s_per_decode_step"] = (
        2 * layers * out["all_reduce_hidden_row_s"] + out["step_message_s"] + out["gather_half_vocab_logits_s"]
    )
    return out


def _time_lm_head(gen, n: int = 20) -> float:
    """Seconds of the (replicated) LM head for one row at one thread."""
    torch.set_num_threads(1)
    x = torch.randn(1, gen.target.config.hidden_size, dtype=gen.target.dtype)
    gen.target.logits(x)
    start = time.perf_counter()
    for _ in range(n):
        gen.target.logits(x)
    return (time.perf_counter() - start) / n


def main() -> None:
    from benchmarks.common import machine_info, write_json
    from specdec.distributed import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="tensor-parallel")
    args = parser.parse_args()
    result = launch(_run, 2, args, threads_per_rank=1)
    payload = {"machine": machine_info(), "args": vars(args), **result}
    rows = ["| system | tok/s | vs TP=1 1 thread plain | vs TP=1 1 thread, same proposer | vs TP=1 2 threads, same proposer | greedy = TP=1 plain |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in result["systems"].items():
        rows.append(
            f"| {name} | {r['tokens_per_s']:.2f} | {r['vs_tp1_1t_plain']:.2f}x | "
            f"{r['vs_tp1_1t_same_kind']:.2f}x | {r['vs_tp1_2t_same_kind']:.2f}x | {r['matches_tp1_plain']} |"
        )
    payload["markdown"] = "\n".join(rows)
    path = write_json(args.out, payload)
    print(payload["markdown"])
    print({k: round(v * 1e3, 3) if k.endswith("_s") else v for k, v in result["collectives"].items()}, "ms")
    print(f"lm head {result['lm_head_s'] * 1e3:.1f} ms/row; TP=2 load {result['tp2_load_s']:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
