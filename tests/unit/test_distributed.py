"""Tensor parallelism's pure parts: shard slices, step messages, the page-operation journal."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model

from specdec.distributed.journal import JournaledKVCacheManager, replay
from specdec.distributed.messages import (
    MessageKind,
    decode,
    encode,
    layout_fields,
    layout_from_fields,
)
from specdec.distributed.sharding import read_shard, shard_config, shard_slice
from specdec.kv.allocator import OutOfPages, PageAllocator
from specdec.kv.paged import KVCacheManager, KVSpec
from specdec.models.llama import ModelConfig
from specdec.models.loading import safetensors_files


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_shards_put_together_are_the_checkpoint(tiny_checkpoint, kind):
    """Row slices of q/k/v/gate/up and column slices of o/down, concatenated over the ranks,
    give back every tensor; replicated tensors are whole on every rank."""
    path = tiny_checkpoint(kind)
    hf = make_hf_model(kind, 0)
    full = {n.removeprefix("model."): t for n, t in hf.state_dict().items()}
    cfg = ModelConfig.from_hf_config(hf.config)
    files = safetensors_files(path)
    shards = [dict(read_shard(files, cfg, rank, 2)) for rank in range(2)]
    for raw_name in shards[0]:
        name = raw_name.removeprefix("model.")
        axis, _ = shard_slice(name, cfg, 0, 2)
        parts = [s[raw_name] for s in shards]
        if axis == "rows":
            torch.testing.assert_close(torch.cat(parts, 0), full[name], rtol=0, atol=0)
        elif axis == "cols":
            torch.testing.assert_close(torch.cat(parts, 1), full[name], rtol=0, atol=0)
        elif axis == "once":
            torch.testing.assert_close(parts[0] + parts[1], full[name], rtol=0, atol=0)
        else:
            assert all(torch.equal(p, full[name]) for p in parts), name
    assert shard_slice("layers.1.self_attn.k_proj.weight", cfg, 1, 2) == (
        "rows", slice(cfg.head_dim, 2 * cfg.head_dim)
    )  # fmt: skip
    assert shard_slice("layers.0.mlp.down_proj.weight", cfg, 1, 2)[0] == "cols"
    assert shard_slice("embed_tokens.weight", cfg, 1, 2) == ("all", None)
    assert shard_config(cfg, 2).num_kv_heads == cfg.num_kv_heads // 2


def test_a_layout_survives_its_message():
    kv = KVCacheManager(PageAllocator(16), page_size=4)
    for seq in (3, 8):
        kv.add_sequence(seq)
        kv.reserve(seq, 11)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = kv.build_layout([8, 3], [[5, 6, 7], [9]], [4, 9], positions=[[4, 5, 5], None], tree_masks=[mask, None])
    message = encode(MessageKind.FORWARD, [[1, 2, 3], *layout_fields(layout)])
    decoded = decode(message)
    assert decoded.kind is MessageKind.FORWARD and decoded.fields[0].tolist() == [1, 2, 3]
    back = layout_from_fields(decoded.fields[1:], torch.device("cpu"))
    for name in ("token_ids", "positions", "qo_indptr", "kv_page_indptr", "kv_page_indices",
                 "kv_last_page_len", "slot_mapping", "tree_mask"):  # fmt: skip
        a, b = getattr(layout, name), getattr(back, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (back.q_lens, back.kv_lens, back.page_size, back.seq_ids) == (
        layout.q_lens, layout.kv_lens, layout.page_size, (8, 3)
    )  # fmt: skip
    with pytest.raises(ValueError, match="malformed"):
        decode(message[:-1])


def _spec():
    return KVSpec(name="target", num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float64)


def test_replaying_the_journal_gives_the_same_tables_and_kv():
    """Random add/reserve/truncate/fork/ensure_writable/compact/free sequences (with refused
    reservations, which must not be journaled): the replica's tables, free pages and pool
    contents equal the leader's."""
    rng = random.Random(0)
    leader = JournaledKVCacheManager(PageAllocator(12), page_size=2)
    replica = KVCacheManager(PageAllocator(12), page_size=2)
    pools = [m.add_pool(_spec()).pool for m in (leader, replica)]
    for pool in pools:
        pool.cache.copy_(torch.arange(pool.cache.numel(), dtype=torch.float64).view_as(pool.cache))
    live, next_id = [], 0
    for _ in range(400):
        op = rng.choice(["add", "reserve", "truncate", "fork", "compact", "free"])
        if op == "add" or not live:
            leader.add_sequence(next_id)
            live.append(next_id)
            next_id += 1
        elif op == "reserve":
            try:
                leader.reserve(rng.choice(live), rng.randint(0, 10))
            except OutOfPages:
                pass
        elif op == "truncate":
            seq = rng.choice(live)
            leader.truncate(seq, rng.randint(0, leader.capacity(seq)))
        elif op == "fork" and leader.capacity(live[-1]) > 0:
            leader.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
            try:
                leader.ensure_writable(next_id - 1, 0)
            except OutOfPages:
                pass
        elif op == "compact":
            seq = rng.choice(live)
            cap = leader.capacity(seq)
            shared = any(leader.allocator.refcount(p) > 1 for p in leader.page_table(seq))
            if cap >= 2 and not shared:
                leader.compact(seq, rng.sample(range(cap), 2), rng.randint(0, cap - 2))
        elif op == "free":
            leader.free(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.2:
            replay(replica, leader.take_journal())
            assert {s: leader.page_table(s) for s in live} == {s: replica.page_table(s) for s in live}
            assert leader.allocator.free_page_ids() == replica.allocator.free_page_ids()
            assert torch.equal(pools[0].cache, pools[1].cache)
    assert next_id > 50


def test_a_refused_reservation_is_not_journaled():
    leader = JournaledKVCacheManager(PageAllocator(2), page_size=4)
    leader.add_sequence(0)
    leader.take_journal()
    with pytest.raises(OutOfPages):
        leader.reserve(0, 100)
    assert leader.take_journal() == []
