"""specdec.graphs on the CPU: bucket choice, padding, and the replay logic with EagerCapture
(each replay re-runs the forward on the pair's buffers and fresh plan). CUDA capture itself
runs in benchmarks/gpu/check.py on a GPU."""

from __future__ import annotations

import pytest

from specdec import FixedPolicy, Generator, SamplingParams
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.graphs import EagerCapture, PassGraphs, bucket_for, pad_uniform_layout


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 32)] == [1, 2, 4, 8, 16, 32]
    assert bucket_for(33) is None and bucket_for(3, (2, 8)) == 8


def _graphed(gen: Generator) -> PassGraphs:
    backend = TorchAttentionBackend()
    graphs = PassGraphs(gen.target, gen.engine.target_kv, lambda b, r: backend, EagerCapture())
    gen.engine.graphs = graphs
    return graphs


def _spy(graphs: PassGraphs, monkeypatch) -> list[tuple[int, int]]:
    """(sequences, rows per sequence) of every pass that replayed a graph."""
    runs = []
    real = graphs.run
    monkeypatch.setattr(
        graphs, "run", lambda layout: runs.append((layout.batch_size, layout.q_lens[0])) or real(layout)
    )
    return runs


@pytest.mark.parametrize("rows", [1, 3])
def test_padded_layout_keeps_the_real_rows(stories_path, rows):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    kv = gen.engine.target_kv
    for s, n in ((0, 5), (1, 9), (2, 2)):
        kv.manager.add_sequence(s)
        kv.manager.reserve(s, n + rows)
    layout = kv.layout([0, 1, 2], [[7] * rows, [8] * rows, [9] * rows], [4, 8, 1])
    padded = pad_uniform_layout(layout, 8, pad_pages=(11, 12))
    n = 3 * rows
    assert padded.batch_size == 8 and padded.q_lens == (rows,) * 8
    assert padded.token_ids[:n].tolist() == layout.token_ids.tolist()
    assert padded.slot_mapping[:n].tolist() == layout.slot_mapping.tolist()
    assert padded.slot_mapping[n:].tolist() == [11 * layout.page_size + r for r in range(rows)] * 5
    assert padded.positions[n:].tolist() == list(range(rows)) * 5
    host = padded.host
    assert list(host.kv_page_indptr) == padded.kv_page_indptr.tolist()
    assert list(host.kv_page_indices) == padded.kv_page_indices.tolist()
    assert list(host.kv_last_page_len) == padded.kv_last_page_len.tolist()
    assert padded.kv_page_indices[-5:].tolist() == [11] * 5
    assert padded.qo_indptr.tolist() == [rows * i for i in range(9)]
    with pytest.raises(ValueError, match="at most 2 sequences"):
        pad_uniform_layout(layout, 2, pad_pages=(11,))


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_replayed_decode_equals_eager(stories_path, batch, monkeypatch):
    """Greedy and seeded output through the bucket graphs (padded to 1, 4, 8 sequences) equals
    the eager run; every decode step went through them; afterwards every page but the padding
    sequences' own is free."""
    prompts = ["Once upon a time", "The cat sat", "Lily", "A big dog ran to the", "Tom"][:batch]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=3)]  # fmt: skip
    eager = Generator.from_pretrained(stories_path, dtype="float32")
    want = [[o.token_ids for o in eager.generate(prompts, p)] for p in params]
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    graphs = _graphed(gen)
    runs = _spy(graphs, monkeypatch)
    got = [[o.token_ids for o in gen.generate(prompts, p)] for p in params]
    assert got == want
    assert len(runs) >= 2 * 9 and max(runs) == (batch, 1)
    allocator = gen.kv.allocator
    assert allocator.num_free_pages == allocator.num_total_pages - len(graphs.pad_pages)


@pytest.mark.parametrize(("mode", "vocab"), [("greedy", None), ("seeded", None), ("greedy", "even ids")])
def test_speculative_generation_with_graphs_equals_plain(stories_path, mode, vocab, monkeypatch):
    """Chain verify passes, padded to the step's width (requests drafting fewer tokens than
    others, some none), replay graphs of k + 1 rows per sequence, decode steps graphs of one,
    the draft model's uniform passes its own graphs (with its draft vocabulary's LM head when
    it has one); the output equals plain decoding."""
    from specdec.proposers import DraftModel

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    if mode == "seeded":
        params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=5)
    prompts = ["Once upon a time", "The cat", "Lily and Tom went"]
    plain = Generator.from_pretrained(stories_path, dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    draft_vocab = None if vocab is None else list(range(0, 512, 2))
    draft = DraftModel.from_pretrained(stories_path, dtype="float32", num_speculative_tokens=3,
                                       draft_vocab=draft_vocab)  # fmt: skip

    class Uneven(FixedPolicy):  # request i drafts 3 - i tokens: ragged chains in one pass
        def choose(self, ctx):
            return tuple(min(c, max(0, 3 - i)) for i, c in enumerate(ctx.caps))

    spec = plain.with_proposer(draft, policy=Uneven(3))
    runs = _spy(_graphed(spec), monkeypatch)
    backend = TorchAttentionBackend()
    draft_graphs = PassGraphs(draft.model, spec.engine.proposer_kv, lambda b, r: backend, EagerCapture(),
                              head=draft.head)  # as Generator(cuda_graphs=True) builds them
    spec.engine.proposer_graphs = draft_graphs
    draft_runs = _spy(draft_graphs, monkeypatch)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert (3, 4) in runs  # verify passes of 3 sequences padded to 4 rows each
    assert draft_runs and all(rows >= 1 for _, rows in draft_runs)  # the draft's steps too
    # The draft proposed exactly what it proposes eagerly (verification would hide a wrong
    # draft from the output, not from the acceptance counts).
    eager = plain.with_proposer(DraftModel.from_pretrained(stories_path, dtype="float32",
                                num_speculative_tokens=3, draft_vocab=draft_vocab), policy=Uneven(3))  # fmt: skip
    eager.generate(prompts, params)
    assert (spec.metrics.num_drafted, spec.metrics.num_accepted) == (
        eager.metrics.num_drafted, eager.metrics.num_accepted)
    allocator = spec.kv.allocator  # the draft's graphs share the target's padding pages
    assert allocator.num_free_pages == allocator.num_total_pages - len(draft_graphs.pad_pages)


def test_cuda_graphs_argument_is_checked(stories_path):
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA target"):
        Generator.from_pretrained(stories_path, dtype="float32", cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        Generator.from_pretrained(stories_path, dtype="float32", cuda_graphs="yes")
