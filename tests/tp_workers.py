"""Rank functions for the tensor-parallel tests: importable by name, so spawned ranks find them.

``run_suite`` builds one generator per case on every rank (rank 0 with the case's proposer)
and returns, on rank 0, each case's token ids and KV stats; ranks >0 assert their own pages
are all free after each call (a failed assertion fails the launch, naming the rank).
"""

from __future__ import annotations

import os
import signal

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.proposers import DraftModel, EAGLETree, MTPHead, PromptLookup


def build_proposer(spec):
    """``(proposer, policy)`` of a picklable case spec (``None`` for plain decoding)."""
    if spec is None:
        return None, None
    kind, *rest = spec
    if kind == "draft":
        path, dtype, k = rest
        return DraftModel.from_pretrained(path, num_speculative_tokens=k, dtype=dtype), FixedPolicy(k)
    if kind == "mtp":
        path, k = rest
        return MTPHead.from_pretrained(path, num_speculative_tokens=k), FixedPolicy(k)
    if kind == "lookup":
        (k,) = rest
        return PromptLookup(num_speculative_tokens=k), FixedPolicy(k)
    if kind == "eagle":
        path, tree = rest
        eagle = EAGLETree.from_pretrained(path, tree)
        return eagle, FixedPolicy(eagle.num_speculative_tokens)
    raise ValueError(f"unknown case {spec!r}")


def run_case(path, dtype, spec, prompts, params, tensor_parallel_size, cache_config=None):
    """One generator, one generate call: ``(token ids per prompt, kv stats, (drafted, accepted,
    preemptions))`` on rank 0 (or in one process); ``None`` on the other ranks, after checking
    their pages."""
    leader = int(os.environ.get("RANK", "0")) == 0
    proposer, policy = build_proposer(spec) if leader else (None, None)
    gen = Generator.from_pretrained(
        path,
        dtype=dtype,
        proposer=proposer,
        policy=policy,
        tensor_parallel_size=tensor_parallel_size,
        cache_config=cache_config,
    )
    outs = gen.generate(prompts, params)
    stats = gen.kv_stats()
    if outs is None:
        assert stats["num_free_pages"] == stats["num_total_pages"], f"rank {gen.tensor_parallel_rank}: {stats}"
        assert stats["num_sequences"] == 0, stats
        return None
    m = gen.metrics
    return [o.token_ids for o in outs], stats, (m.num_drafted, m.num_accepted, gen.scheduler.num_preemptions)


def run_suite(path, dtype, cases, prompts, params):
    """``{name: run_case(...)}`` for every ``(name, spec, params or None, cache config or
    None)`` of ``cases``."""
    results = {}
    for name, spec, case_params, cache in cases:
        results[name] = run_case(path, dtype, spec, prompts, case_params or params, 2, cache)
    return results


def fail_mid_generation(path, how):
    """Rank 1 fails at its third step (``how``: "raise" or "kill"); rank 0 generates."""
    if int(os.environ["RANK"]) == 1:
        from specdec.distributed.follower import Follower

        original, calls = Follower._forward, []

        def failing(self, *args):
            calls.append(1)
            if len(calls) == 3:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError("injected failure in rank 1's forward")
            return original(self, *args)

        Follower._forward = failing
    gen = Generator.from_pretrained(path, dtype="float64", tensor_parallel_size=2)
    return gen.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=200, ignore_eos=True))


def serve_and_stream(path, prompt):
    """Rank 0 streams and then closes; the other ranks serve until then."""
    gen = Generator.from_pretrained(path, dtype="float64", tensor_parallel_size=2)
    if gen.tensor_parallel_rank != 0:
        for leader_only in (gen.step, lambda: gen.metrics, lambda: gen.submit([1])):
            try:
                leader_only()
            except RuntimeError as err:
                assert "is rank 0's under tensor parallelism" in str(err), err
            else:
                raise AssertionError("a leader-only call ran on another rank")
        gen.serve()
        stats = gen.kv_stats()
        assert stats["num_free_pages"] == stats["num_total_pages"], stats
        return None
    text = list(gen.stream(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    handle = gen.submit(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    result = handle.result().token_ids
    gen.close()
    return text, result


def pause_between_calls(path, pause_s):
    """Rank 0 works alone for ``pause_s`` (longer than the collective timeout) between two
    calls; the other ranks wait for it."""
    import time

    gen = Generator.from_pretrained(path, dtype="float64", tensor_parallel_size=2)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    first = gen.generate([1, 2, 3], params)
    if gen.tensor_parallel_rank == 0:
        time.sleep(pause_s)
    second = gen.generate([1, 2, 3], params)
    return None if first is None else (first.token_ids, second.token_ids, gen.target.group.timeout_s)


def torchrun_main() -> None:
    """Entry point of ``torchrun --nproc-per-node 2 tp_workers.py <model dir>``: rank 0
    prints its greedy token ids."""
    import sys

    gen = Generator.from_pretrained(sys.argv[1], dtype="float64", tensor_parallel_size=2)
    out = gen.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=10, ignore_eos=True))
    if out is not None:
        print("TOKENS", [o.token_ids for o in out])


if __name__ == "__main__":
    torchrun_main()
