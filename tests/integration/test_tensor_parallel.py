"""Tensor parallelism over 2 CPU ranks (gloo): the same output as one process, for plain
decoding and every proposer, greedy and seeded sampling; every page free on every rank; a
failing or killed rank ends the group with an error naming it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import STORIES, make_hf_model
from tp_workers import (
    fail_mid_generation,
    pause_between_calls,
    run_case,
    run_suite,
    serve_and_stream,
)

from specdec import CacheConfig, Generator, SamplingParams
from specdec.distributed import RankFailedError, launch
from specdec.models.eagle_checkpoints import save_eagle_head
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.models.loading import load_model
from specdec.models.mtp_head import save_mtp_head

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _seeded(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=100 + i)
        for i in range(n)
    ]


def _with_options(n: int) -> list[SamplingParams]:
    """Options that transform logits with the history, greedy and seeded (picklable: no user
    processors, which the rank processes could not receive)."""
    options = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3, logit_bias={5: 2.0})
    return [
        SamplingParams(max_new_tokens=24, ignore_eos=True, **options, **({} if i % 2 else dict(temperature=0.9, seed=7 + i)))
        for i in range(n)
    ]


def _perturbed_checkpoint(kind_or_path, directory, dtype, scale=0.3):
    """A draft checkpoint: the target's weights plus noise (it agrees often, not always)."""
    from transformers import AutoModelForCausalLM

    if kind_or_path in ("qwen2", "llama"):
        hf = make_hf_model(kind_or_path, 0)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(kind_or_path), dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    hf.save_pretrained(directory, safe_serialization=True)
    return directory


def _random_heads(target_path, directory, dtype):
    """An MTP and an EAGLE-3 head with random weights, saved for from_pretrained."""
    from helpers import random_head

    target, _, _ = load_model(target_path, dtype=dtype)
    mtp = save_mtp_head(random_head(target, seed=3), directory / "mtp")
    layers = (0, 1, target.config.num_layers)
    torch.manual_seed(4)
    cfg = EagleHeadConfig.for_target(target.config, EagleKind.EAGLE3, target_layers=layers)
    head = EagleHeadModel(target, cfg).to(target.dtype).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    eagle = save_eagle_head(head, directory / "eagle")
    return mtp, eagle


def _cases(target_path, tmp, dtype, prompts):
    draft = _perturbed_checkpoint(target_path if dtype == "float32" else tmp.name.split("-")[0], tmp / "draft", dtype)
    mtp, eagle = _random_heads(target_path, tmp, dtype)
    # 2-slot pages, too few for every request with 16-node trees in flight: preemptions free
    # and re-take pages mid-generation (the journal must carry them to rank 1).
    tight = CacheConfig(max_batch_size=4, max_model_len=64, page_size=2, num_pages=40)
    return [
        ("plain", None, None, None),
        ("draft", ("draft", str(draft), dtype, 3), None, None),
        ("mtp", ("mtp", str(mtp), 2), None, None),
        ("lookup", ("lookup", 3), None, None),
        ("eagle", ("eagle", str(eagle), None), None, None),
        ("eagle-preempted", ("eagle", str(eagle), None), None, tight),
        ("plain-seeded", None, _seeded(len(prompts)), None),
        ("draft-seeded", ("draft", str(draft), dtype, 3), _seeded(len(prompts)), None),
        ("plain-options", None, _with_options(len(prompts)), None),
        ("eagle-options", ("eagle", str(eagle), None), _with_options(len(prompts)), None),
    ]


def _check_suite(path, dtype, tmp, prompts):
    cases = _cases(path, tmp, dtype, prompts)
    start = time.monotonic()
    got = launch(run_suite, 2, str(path), dtype, cases, prompts, GREEDY, timeout_s=600)
    elapsed = time.monotonic() - start
    plain = got["plain"][0]
    for name, spec, params, cache in cases:
        tokens, stats, (drafted, _, preemptions) = got[name]
        ref_tokens, _, _ = run_case(str(path), dtype, spec, prompts, params or GREEDY, 1, cache)
        assert tokens == ref_tokens, name  # the same output as one process
        if params is None:
            assert tokens == plain, name  # and speculation changes nothing
        if spec is not None:
            assert drafted > 0, name
        assert stats["num_free_pages"] == stats["num_total_pages"] and stats["num_sequences"] == 0
        assert (preemptions > 0) == (cache is not None), (name, preemptions)
    assert got["plain-seeded"][0] != plain  # sampling really sampled
    # Request options under tensor parallelism: speculation changes nothing, and they act.
    assert got["eagle-options"][0] == got["plain-options"][0] != plain
    return elapsed


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_two_ranks_match_one_process_tiny_float64(tiny_checkpoint, tmp_path_factory, kind):
    path = tiny_checkpoint(kind)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [12], [3] * 20]
    _check_suite(path, "float64", tmp_path_factory.mktemp(f"{kind}-tp"), prompts)


def test_two_ranks_match_one_process_stories_float32(tmp_path):
    prompts = [[1, 403, 407, 261, 378], [1, 1094, 1548, 2], [1, 365, 1860, 322, 1094, 1548, 29889]]
    prompts = [[t % 512 for t in p] for p in prompts]
    _check_suite(STORIES, "float32", tmp_path, prompts)


def test_stream_submit_and_serve(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    deltas, ids = launch(serve_and_stream, 2, str(path), [1, 2, 3], timeout_s=300)
    ref = Generator.from_pretrained(path, dtype="float64")
    assert ids == ref.generate([1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True)).token_ids
    assert len(deltas) == 12 or deltas == [""] * len(deltas)  # no tokenizer: empty deltas


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_rank_ends_every_rank_with_an_error_naming_it(tiny_checkpoint, how):
    path = tiny_checkpoint("qwen2")
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 2 failed") as info:
        launch(fail_mid_generation, 2, str(path), how, timeout_s=120, grace_s=20)
    assert time.monotonic() - start < 60  # bounded: the peer's collective failed at once
    assert info.value.rank == 1
    message = str(info.value)
    assert ("injected failure" in message) if how == "raise" else ("SIGKILL" in message)
    # Rank 0's own error named rank 1 too (it failed because rank 1 did).
    rank0 = message.partition("\n  rank 0: ")[2].splitlines()[0]
    assert rank0.startswith("TensorParallelError: tensor-parallel rank 0: rank 1 failed"), message


def test_other_ranks_wait_for_the_leader_longer_than_the_collective_timeout(tiny_checkpoint, monkeypatch):
    """Between calls the leader may work alone (a one-process generator, the user's code) for
    longer than the collective timeout; the other ranks must still be there afterwards."""
    monkeypatch.setenv("SPECDEC_TP_TIMEOUT_S", "2")
    first, second, timeout = launch(pause_between_calls, 2, str(tiny_checkpoint("qwen2")), 5.0, timeout_s=120)
    assert timeout == 2.0 and first == second


def test_heads_that_do_not_divide_are_refused_before_loading(tiny_checkpoint, monkeypatch):
    from specdec.distributed import group

    def no_group(*args, **kwargs):
        raise AssertionError("the group formed before the check")

    monkeypatch.setattr(group.TensorParallelGroup, "initialize", no_group)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide .* 4 attention heads, 2 KV heads"):
        Generator.from_pretrained(tiny_checkpoint("qwen2"), dtype="float64", tensor_parallel_size=3)


def test_tensor_parallel_arguments_are_checked(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("qwen2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1, got 0"):
        Generator.from_pretrained(path, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization='int8' is not supported with tensor_parallel_size > 1"):
        Generator.from_pretrained(path, quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        Generator.from_pretrained(path, dtype="float64", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        launch(print, 0)


def test_torchrun_launches_the_same_generator(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    workers = Path(__file__).resolve().parents[1] / "tp_workers.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(workers.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
         str(_free_port()), str(workers), str(path)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = next(line for line in proc.stdout.splitlines() if line.startswith("TOKENS"))
    ref = Generator.from_pretrained(path, dtype="float64").generate(
        [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_new_tokens=10, ignore_eos=True)
    )
    assert tokens == f"TOKENS {[o.token_ids for o in ref]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bf16_with_the_packed_kernel_sums_partials_in_float32(kernel):
    """bf16 shards on the packed CPU kernel: o_proj/down_proj partial products are summed in
    float32 and rounded once, so greedy output equals one process over 3 x 100 tokens (summing
    bf16-rounded partials instead diverged at tokens 16 and 55 of two of these prompts)."""
    prompts = [[1, 403, 407, 261, 378], [1, 109, 154, 2], [1, 365, 186, 322, 109, 154, 29]]
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    got, stats, _ = launch(run_case, 2, str(STORIES), "bfloat16", None, prompts, params, 2, timeout_s=300)  # noqa: E501
    ref, _, _ = run_case(str(STORIES), "bfloat16", None, prompts, params, 1)
    assert got == ref
    assert stats["num_free_pages"] == stats["num_total_pages"]
