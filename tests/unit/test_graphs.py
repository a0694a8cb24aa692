"""specdec.graphs on the CPU: bucket choice, padding, and the replay logic with EagerCapture
(each replay re-runs the forward on the bucket's buffers and fresh plan). CUDA capture itself
runs in benchmarks/gpu/check.py on a GPU."""

from __future__ import annotations

import pytest

from specdec import Generator, SamplingParams
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.graphs import BUCKETS, DecodeGraphs, EagerCapture, bucket_for, pad_decode_layout


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 32)] == [1, 2, 4, 8, 16, 32]
    assert bucket_for(33) is None and bucket_for(3, (2, 8)) == 8


def _graphed(gen: Generator) -> DecodeGraphs:
    graphs = DecodeGraphs(
        gen.target, gen.engine.target_kv, {b: TorchAttentionBackend() for b in BUCKETS}, EagerCapture()
    )
    gen.engine.graphs = graphs
    return graphs


def test_padded_layout_keeps_the_real_rows(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    kv = gen.engine.target_kv
    for s, n in ((0, 5), (1, 9), (2, 2)):
        kv.manager.add_sequence(s)
        kv.manager.reserve(s, n)
    layout = kv.layout([0, 1, 2], [[7], [8], [9]], [4, 8, 1])
    padded = pad_decode_layout(layout, 8, pad_page=11)
    assert padded.batch_size == 8 and padded.token_ids[:3].tolist() == [7, 8, 9]
    assert padded.slot_mapping[:3].tolist() == layout.slot_mapping.tolist()
    assert padded.slot_mapping[3:].tolist() == [11 * layout.page_size] * 5
    host = padded.host
    assert list(host.kv_page_indptr) == padded.kv_page_indptr.tolist()
    assert list(host.kv_page_indices) == padded.kv_page_indices.tolist()
    assert list(host.kv_last_page_len) == padded.kv_last_page_len.tolist()
    assert padded.kv_page_indices[-5:].tolist() == [11] * 5
    with pytest.raises(ValueError, match="at most 2 rows"):
        pad_decode_layout(layout, 2, pad_page=11)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_replayed_decode_equals_eager(stories_path, batch, monkeypatch):
    """Greedy and seeded output through the bucket graphs (padded to 1, 4, 8 rows) equals the
    eager run; every decode step went through them; afterwards every page but the padding
    rows' own is free."""
    prompts = ["Once upon a time", "The cat sat", "Lily", "A big dog ran to the", "Tom"][:batch]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=3)]  # fmt: skip
    eager = Generator.from_pretrained(stories_path, dtype="float32")
    want = [[o.token_ids for o in eager.generate(prompts, p)] for p in params]
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    graphs = _graphed(gen)
    runs = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda layout: runs.append(layout.batch_size) or real_run(layout))
    got = [[o.token_ids for o in gen.generate(prompts, p)] for p in params]
    assert got == want
    assert len(runs) >= 2 * 9 and max(runs) == batch
    allocator = gen.kv.allocator
    assert allocator.num_free_pages == allocator.num_total_pages - 1


def test_speculative_generation_with_graphs_equals_plain(stories_path):
    """Plain decode steps of a speculative generator (the adaptive policy's k = 0 steps, and
    prefill's neighbours) use the graphs; verification stays eager; output equals plain."""
    from specdec.proposers import DraftModel

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    want = [o.token_ids for o in plain.generate(["Once upon a time", "The cat"], params)]
    draft = DraftModel.from_pretrained(stories_path, dtype="float32")
    spec = plain.with_proposer(draft, policy=2)
    _graphed(spec)
    assert [o.token_ids for o in spec.generate(["Once upon a time", "The cat"], params)] == want


def test_cuda_graphs_argument_is_checked(stories_path):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA target"):
        Generator.from_pretrained(stories_path, dtype="float32", cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        Generator.from_pretrained(stories_path, dtype="float32", cuda_graphs="yes")
