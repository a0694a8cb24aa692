"""Continuous batching under load: 200 requests of random lengths submitted at once to one
generator with a tight page budget (preemption happens), against the same requests run one at
a time, in one run. Both use stories260K (float32) with a draft model (a noisy copy) at a fixed
k = 3; every output is checked equal between the two, so the work is the same.

    python -m benchmarks.load [--requests 200] [--threads 1]
    -> benchmarks/results/load-<stamp>.json
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import machine_info, noisy_copy, write_json
from specdec import CacheConfig, Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.models.loading import load_model
from specdec.proposers import DraftModel


def _requests(n: int, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    return [
        ([rng.randrange(1, vocab) for _ in range(rng.randint(1, 20))],
         SamplingParams(max_new_tokens=rng.randint(1, 24), ignore_eos=True))
        for _ in range(n)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _, _ = load_model(bundled_model_path(), dtype="float32")
    draft = noisy_copy(target, 0.2, 3)

    def generator(**cache) -> Generator:
        return Generator.from_components(
            target, proposer=DraftModel.from_model(draft, num_speculative_tokens=3), policy=3,
            cache_config=CacheConfig(**cache) if cache else None,
        )

    specs = _requests(args.requests, target.config.vocab_size)
    alone_gen = generator()
    start = time.perf_counter()
    alone = [alone_gen.generate(p, sp).token_ids for p, sp in specs]
    alone_s = time.perf_counter() - start

    gen = generator(page_size=4, num_pages=64, max_batch_size=16)
    start = time.perf_counter()
    handles = [gen.submit(p, sp) for p, sp in specs]
    steps = 0
    while gen.scheduler.has_unfinished():
        gen.step()
        steps += 1
    batched_s = time.perf_counter() - start
    outputs = [h.result().token_ids for h in handles]
    assert outputs == alone, "batched outputs differ from the requests run alone"
    tokens = sum(len(o) for o in outputs)
    result = {
        "machine": machine_info(), "threads": args.threads, "requests": args.requests,
        "tokens": tokens, "one_at_a_time_s": alone_s, "batched_s": batched_s,
        "batched_speedup": alone_s / batched_s, "batched_steps": steps,
        "preemptions": gen.scheduler.num_preemptions,
        "acceptance_rate": gen.metrics.acceptance_rate,
    }
    print({k: v for k, v in result.items() if k != "machine"})
    print(write_json("load", result))


if __name__ == "__main__":
    main()
