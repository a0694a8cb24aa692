"""The grid: every system at every grid point, warm-up, repeats in rotating turns, timing.

Inside every repeat the systems take turns on each prompt batch (and the turn order rotates
from repeat to repeat), so machine drift hits all of them alike. Every system generates
exactly ``max_new_tokens`` tokens from the same prompt token ids.
"""

from __future__ import annotations

import itertools
import sys
import time

import attrs
import torch

from benchmarks.common import machine_info
from benchmarks.harness.aggregate import ratios, summarize
from benchmarks.harness.bounds import PROBE_GIB, close_bound, open_bound, rate_against_bounds
from benchmarks.harness.checks import check_against_plain
from benchmarks.harness.config import HarnessConfig
from benchmarks.harness.pool import ModelPool
from benchmarks.harness.prompts import PROMPT_SETS, Prompt, tokenize_prompts
from benchmarks.harness.runners import Runner
from benchmarks.harness.systems import REFERENCE, all_systems, check_systems, grid_ks

HF_SETTINGS = {
    "all": "generate(input_ids, attention_mask, max_new_tokens=n, do_sample, repetition_penalty=1.0, "
    "pad_token_id); model.generation_config.eos_token_id=None so EOS neither stops nor is masked "
    "(specdec: SamplingParams(ignore_eos=True)); sampling: temperature=T, top_k=0, top_p=1.0",
    "hf-assisted": "generate(assistant_model=draft); on the assistant's generation_config: "
    "num_assistant_tokens=k, num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0.0",
    "hf-lookup": "generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)",
    "counters": "target forwards by a forward pre-hook on the transformers target; assisted drafted "
    "tokens = query tokens fed - prompt - (forwards - 1), accepted = new tokens - forwards",
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_grid(cfg: HarnessConfig) -> dict:
    """Run the whole grid and return the JSON payload (without writing it)."""
    check_systems(cfg)  # before any model loads
    pool, prompts = _load(cfg)
    systems = all_systems()
    instances = [
        (systems[name], k)
        for name in cfg.systems
        for k in grid_ks(systems[name], cfg.system_ks.get(name, cfg.ks))
    ]
    runners = {}
    for system, k in instances:
        _log(f"building {system.name}" + (f" k={k}" if k else ""))
        runners[system.name, k] = system.build(pool, k)
    probe = _plain_probe(cfg)

    runs, skipped, bounds = [], [], []
    for threads, set_name, temperature, batch in itertools.product(
        cfg.threads, cfg.prompt_sets, cfg.temperatures, cfg.batch_sizes
    ):
        if not bounds or bounds[-1]["threads"] != threads:
            if bounds:
                close_bound(bounds[-1])  # sets its own thread count: open the next bound after
            torch.set_num_threads(threads)
            bounds.append(open_bound(threads, pool))
        group = dict(threads=threads, prompt_set=set_name, temperature=temperature, batch_size=batch)
        active = [(s, k) for s, k in instances if s.max_batch_size is None or batch <= s.max_batch_size]
        skipped += [
            dict(group, system=s.name, k=k, reason=f"batch size > {s.max_batch_size} unsupported")
            for s, k in instances
            if (s, k) not in active
        ]
        batches = [prompts[set_name][i : i + batch] for i in range(0, len(prompts[set_name]), batch)]
        turns = [(s.name, k, runners[s.name, k]) for s, k in active]
        runs += _run_group(cfg, group, turns, batches, probe)
    close_bound(bounds[-1])
    check_against_plain(runs)
    summary = summarize(runs)
    rate_against_bounds(summary, bounds)
    return _payload(cfg, pool, skipped=skipped, bounds=bounds, runs=runs, summary=summary)


def _load(cfg: HarnessConfig) -> tuple[ModelPool, dict[str, list[Prompt]]]:
    """The model pool (nothing loaded yet) and every prompt set's token ids, by the target's
    tokenizer; the KV cache fits the largest batch of the longest prompt, without prefix
    caching."""
    from transformers import AutoTokenizer

    from specdec import CacheConfig
    from specdec.hub import resolve_model

    target_path, draft_path = resolve_model(cfg.target), resolve_model(cfg.draft)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    prompts = {
        name: tokenize_prompts(tokenizer, PROMPT_SETS[name], cfg.num_prompts)
        for name in cfg.prompt_sets
    }
    longest = max(len(p.token_ids) for ps in prompts.values() for p in ps)
    # No prefix caching: every system prefills every prompt (transformers' generate does). The
    # warm-up runs the first timed batch, so with caching every warmed generator found that
    # batch's pages cached while a system rebuilt fresh every repeat (the adaptive policy's)
    # prefilled it in full: 3.6 s of a 20 s run on the first prompt, read as a cold-start loss.
    cache = CacheConfig(
        max_batch_size=max(cfg.batch_sizes),
        max_model_len=longest + cfg.max_new_tokens,
        prefix_caching=False,
    )
    return ModelPool(cfg, target_path, draft_path, cache, tokenizer), prompts


def _plain_probe(cfg: HarnessConfig):
    """The bandwidth probe read around every specdec-plain run (``None`` if it does not run)."""
    if REFERENCE not in cfg.systems:
        return None
    from benchmarks.bandwidth import BandwidthProbe

    return BandwidthProbe(PROBE_GIB)


def _payload(cfg: HarnessConfig, pool: ModelPool, **results) -> dict:
    """The result JSON: machine, versions, configuration and models, then ``results``."""
    return {
        "machine": machine_info(),
        "threads": cfg.threads,
        "dtype": cfg.dtype,
        "versions": _versions(),
        "config": attrs.asdict(cfg),
        "models": {"target": str(pool.target_path), "draft": str(pool.draft_path),
                   "draft_quantization": cfg.draft_quantization, "mtp_head": cfg.mtp_head,
                   "draft_confidence": cfg.draft_confidence,
                   "mtp_draft_vocab": cfg.mtp_draft_vocab, "draft_vocab": cfg.draft_vocab,
                   "eagle_head": cfg.eagle_head, "head_quantization": cfg.head_quantization,
                   "llamacpp_target": cfg.llamacpp_target,
                   "tree_top_k": cfg.tree_top_k, "tree_depth": cfg.tree_depth,
                   "tree_min_prob": cfg.tree_min_prob},  # fmt: skip
        "hf_settings": HF_SETTINGS,
        "skipped": results["skipped"],
        "bounds": results["bounds"],
        "runs": results["runs"],
        "summary": results["summary"],
    }


def _versions() -> dict[str, str]:
    import transformers

    import specdec

    versions = {
        "specdec": specdec.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:  # the optional llama.cpp peer
        import llama_cpp

        versions["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    return versions


def _run_group(cfg: HarnessConfig, group: dict, active: list, batches: list, probe) -> list[dict]:
    """Warm up, then repeats in which the systems take turns on every prompt batch.

    The turn order rotates by one system per repeat, so no system always runs first (right
    after another system's cache-cold start) or always last.
    """
    if not active:
        return []
    temperature = group["temperature"]
    for _, _, runner in active:
        for _ in range(cfg.warmup):
            runner.run([p.token_ids for p in batches[0]], cfg.warmup_tokens, temperature, cfg.seed)
    runs = []
    for repeat in range(cfg.repeats):
        shift = repeat % len(active)
        for _, _, runner in active:
            runner.start_repeat()
        for b_index, prompt_batch in enumerate(batches):
            for name, k, runner in active[shift:] + active[:shift]:
                if name == REFERENCE:
                    row = _timed_plain_run(runner, prompt_batch, cfg, temperature, b_index, probe)
                else:
                    row = _timed_run(runner, prompt_batch, cfg, temperature, b_index)
                row.update(group, system=name, k=k, repeat=repeat)
                _log(
                    f"{name:15s} k={k!s:4s} T={temperature:g} b={group['batch_size']} r={repeat} "
                    f"{row['prompt_id']:24s} {row['tokens_per_s']:8.2f} tok/s"
                )
                runs.append(row)
    return runs


def _timed_plain_run(
    runner: Runner,
    prompt_batch: list[Prompt],
    cfg: HarnessConfig,
    temperature: float,
    b_index: int,
    probe,
) -> dict:
    """A specdec-plain run, then the same prompts for one token: the prefill (and one step),
    timed apart so the plain decode rate can be set against the weight-read bound; the read
    bandwidth probed just before and just after, so the bound is the machine's at the time of
    this run (the better probe: the tighter bound)."""
    before = probe(repeats=3)
    row = _timed_run(runner, prompt_batch, cfg, temperature, b_index)
    row["prefill_seconds"] = _timed_prefill(runner, prompt_batch, temperature, cfg.seed)
    row["read_bandwidth_probes"] = [before, probe(repeats=3)]
    return row


def _timed_run(
    runner: Runner, prompt_batch: list[Prompt], cfg: HarnessConfig, temperature: float, b_index: int
) -> dict:
    ids = [p.token_ids for p in prompt_batch]
    start = time.perf_counter()
    stats = runner.run(ids, cfg.max_new_tokens, temperature, cfg.seed + b_index * len(ids))
    seconds = time.perf_counter() - start
    new = sum(len(o) for o in stats.outputs)
    steps = stats.num_verify_steps
    return {
        "prompt_id": "+".join(p.prompt_id for p in prompt_batch),
        "prompt_tokens": [len(p.token_ids) for p in prompt_batch],
        "seconds": seconds,
        "num_new_tokens": new,
        "tokens_per_s": new / seconds,
        "target_forwards": stats.target_forwards,
        "num_verify_steps": steps,
        "num_drafted": stats.num_drafted,
        "num_accepted": stats.num_accepted,
        "num_emitted_in_verify": stats.num_emitted_in_verify,
        "mean_accepted_length": stats.num_emitted_in_verify / steps if steps else None,
        "acceptance_rate": stats.num_accepted / stats.num_drafted if stats.num_drafted else None,
        "accepted_per_position": stats.accepted_per_position,
        "drafted_per_position": stats.drafted_per_position,
        "per_position_acceptance": ratios(stats.accepted_per_position, stats.drafted_per_position),
        "k_histogram": stats.k_histogram,
        "output_token_ids": stats.outputs,
    }


def _timed_prefill(runner: Runner, prompt_batch: list[Prompt], temperature: float, seed: int) -> float:
    ids = [p.token_ids for p in prompt_batch]
    start = time.perf_counter()
    runner.run(ids, 1, temperature, seed)
    return time.perf_counter() - start

