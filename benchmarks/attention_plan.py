"""Host time of one step's attention plan: the batched functions against a loop over sequences.

Every CPU step plans each model's attention once (per window): the KV gather indices and the
visibility mask the kernel reads. ``TorchAttentionBackend.plan_one`` builds them for the whole
batch at once (:mod:`specdec.attention.batched_plan`; one sequence by the per-sequence rule);
the baseline here is what it did before, a few tensor operations per sequence
(:func:`per_sequence_tensors`, built from the same per-sequence rule
:func:`~specdec.attention.torch_backend.visibility_mask`). Both are timed in turn in one
process, on causal steps (decode rows or k + 1 verify rows) and on tree steps, and checked equal
first. One thread.

    python -m benchmarks.attention_plan [--repeats 31]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common import machine_info, write_json
from specdec.attention.torch_backend import TorchAttentionBackend, split_tree_mask, visibility_mask
from specdec.interfaces import AttentionSpec
from specdec.types import BatchLayout, LayoutHost

SETTINGS = [  # (batch, kv_len, q_len, tree)
    (1, 500, 1, False), (1, 500, 5, False), (4, 500, 5, False), (16, 500, 1, False),
    (16, 500, 5, False), (64, 500, 5, False), (64, 2000, 1, False), (256, 300, 1, False),
    (1, 500, 12, True), (16, 500, 12, True), (64, 500, 12, True),
]  # fmt: skip
PAGE_SIZE = 16


def per_sequence_tensors(layout: BatchLayout, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loop ``plan_one`` ran before: gather ``[batch, max_kv]`` and mask ``[batch, 1, max_q,
    max_kv]``, a few tensor operations per sequence; no mask where every slot is visible (one
    causal decode row), as ``plan_one`` then and now."""
    q_lens, kv_lens, host = layout.q_lens, layout.kv_lens, layout.host
    batch, max_q, max_kv = len(q_lens), max(q_lens), max(kv_lens)
    pages, indptr = host.kv_page_indices, host.kv_page_indptr
    gather = torch.zeros(batch, max_kv, dtype=torch.int64)
    offsets = torch.arange(PAGE_SIZE, dtype=torch.int64)
    for i, kv_len in enumerate(kv_lens):
        seq_pages = torch.tensor(pages[indptr[i] : indptr[i + 1]], dtype=torch.int64)
        gather[i, :kv_len] = (seq_pages.unsqueeze(1) * PAGE_SIZE + offsets).flatten()[:kv_len]
    if batch == 1 and max_q == 1 and host.tree_mask is None and (sliding_window is None or max_kv <= sliding_window):
        return gather, None
    mask = torch.zeros(batch, 1, max_q, max_kv, dtype=torch.bool)
    for i, (q_len, kv_len, tree) in enumerate(zip(q_lens, kv_lens, split_tree_mask(host.tree_mask, q_lens))):
        mask[i, 0, :q_len, :kv_len] = visibility_mask(q_len, kv_len, tree, sliding_window)
        mask[i, 0, q_len:, 0] = True
    return gather, mask


def random_tree(n: int, rng: random.Random) -> torch.Tensor:  # [n, n] bool
    """Row 0 the root; every later row a child of an earlier one; a row sees its ancestors."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for r in range(n):
        if r:
            mask[r] = mask[rng.randrange(r)]
        mask[r, r] = True
    return mask


def make_layout(batch: int, kv: int, q: int, tree: bool, rng: random.Random) -> BatchLayout:
    """A step's layout over shuffled pages (the plan reads only its host copies and lengths)."""
    per = -(-kv // PAGE_SIZE)
    pool = list(range(batch * per))
    rng.shuffle(pool)
    indptr = tuple(range(0, batch * per + 1, per))
    flat = torch.cat([random_tree(q, rng).flatten() for _ in range(batch)]) if tree else None
    host = LayoutHost(indptr, tuple(pool), (kv - (per - 1) * PAGE_SIZE,) * batch, flat)
    rows = batch * q
    return BatchLayout(
        token_ids=torch.zeros(rows, dtype=torch.int64),
        positions=torch.zeros(rows, dtype=torch.int64),
        qo_indptr=torch.arange(0, rows + 1, q, dtype=torch.int32),
        kv_page_indptr=torch.tensor(indptr, dtype=torch.int32),
        kv_page_indices=torch.tensor(pool, dtype=torch.int32),
        kv_last_page_len=torch.tensor(host.kv_last_page_len, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        q_lens=(q,) * batch,
        kv_lens=(kv,) * batch,
        page_size=PAGE_SIZE,
        tree_mask=flat,
        host=host,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--out-dir", default=None, help="default: benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = AttentionSpec(num_qo_heads=12, num_kv_heads=2, head_dim=128, sm_scale=128**-0.5)
    backend, rng, rows = TorchAttentionBackend(), random.Random(0), []
    for batch, kv, q, tree in SETTINGS:
        layout = make_layout(batch, kv, q, tree, rng)
        plan = backend.plan_one(layout, spec)
        gather, mask = per_sequence_tensors(layout, None)
        assert torch.equal(plan.kv_gather, gather)
        assert (plan.mask is None and mask is None) or torch.equal(plan.mask, mask)
        batched, looped = [], []
        for _ in range(args.repeats):  # in turn, so drift hits both alike
            start = time.perf_counter()
            backend.plan_one(layout, spec)
            batched.append(time.perf_counter() - start)
            start = time.perf_counter()
            per_sequence_tensors(layout, None)
            looped.append(time.perf_counter() - start)
        row = dict(batch=batch, kv_len=kv, q_len=q, tree=tree,
                   per_sequence_ms=round(1e3 * statistics.median(looped), 4),
                   plan_one_ms=round(1e3 * statistics.median(batched), 4))  # fmt: skip
        row["speedup"] = round(row["per_sequence_ms"] / row["plan_one_ms"], 2)
        rows.append(row)
        print(row, flush=True)
    payload = {"machine": machine_info(), "settings": {"repeats": args.repeats, "page_size": PAGE_SIZE,
               "threads": 1}, "results": rows}  # fmt: skip
    print(f"wrote {write_json('attention-plan', payload, args.out_dir)}")


if __name__ == "__main__":
    main()
