"""The proposer's per-request lifecycle: ``TracksRequests`` hooks and ``ProposeContext.prompt_lens``.

A recording proposer (a model-free chain proposer with the optional hooks) sees one start when
a request is admitted (again after a preemption) and one end per start with the right reason:
finished, cancelled, failed (its own stop check raising, or its batch's proposer raising) and
preempted; ``release`` still follows every end.
"""

from __future__ import annotations

from collections import Counter

import pytest

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.interfaces import TracksRequests
from specdec.models.loading import load_model
from specdec.proposers import TokenListProposer
from specdec.types import RequestEnd

K = 2
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


class Recording(TokenListProposer):
    """Drafts the last token again; records every lifecycle call and every context's prompts."""

    def __init__(self, fail_at_propose: int | None = None) -> None:
        super().__init__(num_speculative_tokens=K)
        self.events: list[tuple] = []  # ("start", seq_id, prompt) | ("end", seq_id, reason) | ...
        self.contexts: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
        self.fail_at_propose = fail_at_propose

    def draft(self, token_ids, k):
        return [token_ids[-1]] * k

    def propose(self, ctx):
        self.contexts.append((ctx.seq_ids, ctx.prompt_lens, tuple(len(t) for t in ctx.token_ids)))
        if self.fail_at_propose is not None and len(self.contexts) >= self.fail_at_propose:
            raise RuntimeError("proposer broke")
        return super().propose(ctx)

    def on_request_start(self, seq_id, prompt_ids):
        self.events.append(("start", seq_id, tuple(prompt_ids)))

    def on_request_end(self, seq_id, reason):
        self.events.append(("end", seq_id, reason))

    def release(self, seq_id):
        self.events.append(("release", seq_id))

    def of(self, seq_id: int) -> list[tuple]:
        """This sequence's events, without its id."""
        return [(e[0], *e[2:]) for e in self.events if e[1] == seq_id]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    model, _, _ = load_model(tiny_checkpoint("llama"), dtype="float64")
    return model


def make_gen(target, proposer: Recording, **cache) -> Generator:
    return Generator.from_components(
        target,
        proposer=proposer,
        cache_config=CacheConfig(page_size=4, **cache),
        policy=FixedPolicy(K),
    )


def run_all(gen: Generator) -> None:
    while gen.scheduler.has_unfinished():
        gen.step()


def test_the_recording_proposer_tracks_requests():
    assert isinstance(Recording(), TracksRequests)
    assert not isinstance(TokenListProposer(2), TracksRequests)


def test_a_finished_request_starts_once_and_ends_finished(target):
    proposer = Recording()
    gen = make_gen(target, proposer)
    handle = gen.submit([1, 2, 3], GREEDY)
    run_all(gen)
    assert handle.result().finish_reason == "length"
    assert proposer.of(handle.request_id) == [
        ("start", (1, 2, 3)),
        ("end", RequestEnd.FINISHED),
        ("release",),
    ]


def test_a_cancelled_request_ends_cancelled(target):
    proposer = Recording()
    gen = make_gen(target, proposer)
    running = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    gen.step()
    gen.step()
    waiting = gen.submit([4, 5], GREEDY)  # cancelled before it is ever admitted
    assert running.cancel() and waiting.cancel()
    run_all(gen)
    assert proposer.of(running.request_id) == [
        ("start", (1, 2, 3)),
        ("end", RequestEnd.CANCELLED),
        ("release",),
    ]
    # Never admitted: no start, so no end; release is called on every end as before.
    assert [e for e in proposer.of(waiting.request_id) if e[0] != "release"] == []


def test_a_failing_proposer_ends_its_batch_failed(target):
    proposer = Recording(fail_at_propose=2)
    gen = make_gen(target, proposer)
    handles = [gen.submit(p, GREEDY) for p in ([1, 2, 3], [4, 5, 6, 7])]
    run_all(gen)
    for h, prompt in zip(handles, ([1, 2, 3], [4, 5, 6, 7])):
        with pytest.raises(RuntimeError, match="proposer broke"):
            h.result()
        assert proposer.of(h.request_id) == [
            ("start", tuple(prompt)),
            ("end", RequestEnd.FAILED),
            ("release",),
        ]


def test_a_raising_stop_check_ends_its_request_failed_alone(stories_path):
    proposer = Recording()
    gen = Generator.from_pretrained(
        stories_path, dtype="float32", proposer=proposer, policy=FixedPolicy(K)
    )
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=["never-appears-zq"])
    handles = [gen.submit(p, params) for p in ("Once upon a time", "The little dog")]
    gen.step()  # both admitted (prefill)
    calls = []

    def broken_decode(ids):
        calls.append(len(ids))
        if len(calls) >= 2:
            raise UnicodeError("decode callback broke")
        return ""

    gen.scheduler.find(handles[1].request_id).decode = broken_decode  # its stop-string check
    run_all(gen)
    with pytest.raises(UnicodeError):
        handles[1].result()
    assert handles[0].result().finish_reason == "length"
    assert proposer.of(handles[0].request_id)[1:] == [("end", RequestEnd.FINISHED), ("release",)]
    assert proposer.of(handles[1].request_id)[1:] == [("end", RequestEnd.FAILED), ("release",)]


def test_a_preempted_request_ends_preempted_and_starts_again(target):
    proposer = Recording()
    gen = make_gen(target, proposer, num_pages=12, max_batch_size=4)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    handles = [gen.submit(p, params) for p in prompts]
    run_all(gen)
    assert gen.scheduler.num_preemptions > 0  # the page budget really forced preemption
    ends = Counter()
    for h, prompt in zip(handles, prompts):
        assert len(h.result().token_ids) == 20
        events = [e for e in proposer.of(h.request_id) if e[0] != "release"]
        # start, end, start, end, ...: every start with this prompt, only the last end finished
        assert [e[0] for e in events] == ["start", "end"] * (len(events) // 2)
        assert all(e[1] == tuple(prompt) for e in events[::2])
        reasons = [e[1] for e in events[1::2]]
        assert reasons[-1] is RequestEnd.FINISHED
        assert set(reasons[:-1]) <= {RequestEnd.PREEMPTED}
        ends.update(reasons)
        assert proposer.of(h.request_id).count(("release",)) == len(reasons)
    assert ends[RequestEnd.PREEMPTED] == gen.scheduler.num_preemptions


def test_prompt_lens_follow_each_sequence_of_a_batch(target):
    proposer = Recording()
    gen = make_gen(target, proposer)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    handles = [gen.submit(p, GREEDY) for p in prompts]
    run_all(gen)
    prompt_len = {h.request_id: len(p) for h, p in zip(handles, prompts)}
    assert any(len(seq_ids) > 1 for seq_ids, _, _ in proposer.contexts)
    for seq_ids, prompt_lens, history_lens in proposer.contexts:
        assert prompt_lens == tuple(prompt_len[s] for s in seq_ids)
        assert all(p < n for p, n in zip(prompt_lens, history_lens))  # the rest was emitted


class BrokenEndHook(Recording):
    """Its end hook raises every time: each request's state must be freed all the same."""

    def on_request_end(self, seq_id, reason):
        super().on_request_end(seq_id, reason)
        raise RuntimeError(f"end hook broke: {reason.value}")


def _all_pages_free(gen: Generator) -> bool:
    stats = gen.kv_stats()
    return stats["num_free_pages"] == stats["num_total_pages"] and stats["num_sequences"] == 0


def test_a_raising_end_hook_frees_every_request_all_the_same(target):
    proposer = BrokenEndHook()
    gen = make_gen(target, proposer, num_pages=12, max_batch_size=4)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    handles = [gen.submit(p, params) for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14])]
    run_all(gen)  # preempted, finished and failed requests alike: the hook raised every time
    assert gen.scheduler.num_preemptions > 0
    assert all(h.done for h in handles) and _all_pages_free(gen)
    for h in handles:
        events = proposer.of(h.request_id)
        assert events.count(("release",)) >= sum(e[0] == "end" for e in events) >= 1

    # A cancel: the hook's error reaches the caller, after the request was freed.
    handle = gen.submit([1, 2, 3], params)
    gen.step()
    with pytest.raises(RuntimeError, match="end hook broke: cancelled"):
        handle.cancel()
    assert handle.done and _all_pages_free(gen)

    # generate() cancels what is left of all its requests even when a cancel raises.
    with pytest.raises(RuntimeError, match="end hook broke"):
        gen.generate([[1, 2, 3], [4, 5, 6]], params)
    assert _all_pages_free(gen)


def test_a_sampled_chain_refuses_draft_vocabulary_columns():
    import torch

    from specdec.proposers.chain_drafting import draft_chain
    from specdec.sampling import SamplingTensors

    def step(j, previous):
        return torch.zeros(1, 2), torch.tensor([7, 9])

    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0)], torch.device("cpu"))
    with pytest.raises(ValueError, match="sampled drafts need full-vocabulary logits"):
        draft_chain(step, 2, greedy=False, sampling=sampling, generators=[None])


def test_removed_module_paths_warn_and_resolve():
    import importlib

    from specdec.policy.tree import TreeSizer
    from specdec.verify.kernel_choice import check_kernel_choice

    with pytest.warns(DeprecationWarning, match="specdec.policy.tree.TreeSizer"):
        assert importlib.import_module("specdec.tree_policy").TreeSizer is TreeSizer
    with pytest.warns(DeprecationWarning, match="kernel_choice.check_kernel_choice"):
        assert importlib.import_module("specdec.verify.device").check_kernel_choice is check_kernel_choice
    with pytest.warns(DeprecationWarning, match="use specdec.proposers.chain_drafting.ChainProposerConfig"):
        legacy = importlib.import_module("specdec.proposers.mtp").MTPHeadProposerConfig
    assert legacy().num_speculative_tokens == 1  # the old default, kept
