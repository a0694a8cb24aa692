"""Triton kernels against their torch references, on the CPU under ``TRITON_INTERPRET=1``
(float32 and bf16 data; on a GPU the same tests run compiled)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")

from specdec.kv.paged import KVSpec, PagePool  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_kv_move_equals_copy_slots_with_overlaps(dtype, seed):
    """Random moves, including a tree path compacted onto the slots it came from (sources
    overwritten by earlier destinations): bitwise equal to PagePool.copy_slots."""
    from specdec.kernels.triton.kv_move import move_slots

    g = torch.Generator().manual_seed(seed)
    spec = KVSpec(name="t", num_layers=3, num_kv_heads=2, head_dim=24, dtype=dtype)
    pools = [PagePool(spec, num_pages=6, page_size=4) for _ in range(2)]
    values = torch.randn(pools[0].cache.shape, generator=g).to(dtype)
    for pool in pools:
        pool.cache.copy_(values)
    num_slots = 6 * 4
    start = int(torch.randint(0, 8, (1,), generator=g))
    path = sorted(torch.randperm(10, generator=g)[:5].tolist())  # kept rows of a verify pass
    moves = [
        (torch.tensor([start + r for r in path]), torch.arange(start, start + len(path))),
        (torch.randperm(num_slots, generator=g)[:7], torch.randperm(num_slots, generator=g)[:7]),
    ]
    for src, dst in moves:
        pools[0].copy_slots(src, dst)
        move_slots(pools[1]._slots, src, dst)
        assert torch.equal(pools[0].cache, pools[1].cache)
    assert not torch.equal(pools[0].cache, values)  # something moved


def test_kv_move_of_nothing_is_a_no_op():
    from specdec.kernels.triton.kv_move import move_slots

    spec = KVSpec(name="t", num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    pool = PagePool(spec, num_pages=2, page_size=4)
    empty = torch.empty(0, dtype=torch.int64)
    move_slots(pool._slots, empty, empty)
    assert not pool.cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_chain_verify_equals_the_reference(dtype):
    """Random batches (counts 0..width, drafts that follow the argmax for a while), logits with
    exact ties across vocabulary blocks (the lowest id wins, as torch.argmax), a vocabulary
    that is not a multiple of the block: the same accepted counts and emitted tokens."""
    from specdec.kernels.triton.verify import greedy_chain_verify
    from specdec.verify.chain import greedy_verify

    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        batch, width, vocab = 5, 4, 2500
        logits = torch.randn(batch, width + 1, vocab, generator=g).to(dtype)
        logits[0, 1, [7, 1500, 2499]] = 50.0  # a tie spread over three blocks
        logits[1, 0, [1024, 1025]] = 60.0  # a tie at a block boundary
        best = logits.float().argmax(dim=-1)  # [batch, width + 1]
        drafts = best[:, :width].clone()
        for i in range(batch):  # break each chain somewhere (or never)
            cut = int(torch.randint(0, width + 1, (1,), generator=g))
            if cut < width:
                drafts[i, cut] = (drafts[i, cut] + 1) % vocab
        counts = torch.randint(0, width + 1, (batch,), generator=g)
        drafts = torch.where(torch.arange(width) < counts[:, None], drafts, -1)
        want_accepted, want_emitted = greedy_verify(logits.float(), drafts, counts.tolist())
        got_accepted, got_emitted = greedy_chain_verify(logits, drafts, counts)
        assert torch.equal(got_accepted, want_accepted), trial
        assert torch.equal(got_emitted, want_emitted), trial
