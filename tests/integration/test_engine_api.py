"""The embedding API (submit / step / cancel / stream) and the engine's failure isolation.

Tiny float64 models on CPU: batch-invariant, so a request's greedy output must be the same
whether it ran alone, in a batch, preempted and recomputed, or next to a failing request.
"""

from __future__ import annotations

import asyncio
import random

import attrs
import pytest
from helpers import perturbed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import CacheConfig, FixedPolicy, Generator, RequestError, RequestHandle, SamplingParams
from specdec.models.loading import load_model
from specdec.proposers import DraftModel

VOCAB = 101  # the tiny "llama" config of conftest
CONTEXT = 256
K = 3




@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    model, _, _ = load_model(tiny_checkpoint("llama"), dtype="float64")
    return model


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target)


@pytest.fixture(scope="module")
def alone(target):
    """(prompt, params) -> greedy output ids of that request run alone on a plain generator."""
    gen = Generator.from_components(target)
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = gen.generate(prompt, params).token_ids
        return cache[key]

    return run


def make_gen(target, draft=None, **cache) -> Generator:
    proposer = None if draft is None else DraftModel.from_model(draft, num_speculative_tokens=K)
    # A fixed k: these tests compare step counts and outputs between generators, and the
    # adaptive policy's choices follow wall-clock timings.
    return Generator.from_components(
        target,
        proposer=proposer,
        cache_config=CacheConfig(**cache) if cache else None,
        policy=None if proposer is None else FixedPolicy(K),
    )


def assert_clean(gen: Generator) -> None:
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert stats["num_sequences"] == 0
    assert not gen.scheduler.has_unfinished()
    proposer = gen.proposer
    if isinstance(proposer, DraftModel):
        assert proposer._computed == {}  # per-sequence proposer state released


def assert_consistent(gen: Generator, handles: list[RequestHandle]) -> None:
    """Every unfinished handle is queued exactly once; only running requests hold pages."""
    queued = [r.seq_id for r in gen.scheduler.requests()]
    assert len(queued) == len(set(queued))  # no duplicates
    assert set(queued) == {h.request_id for h in handles if not h.done}  # none lost
    assert set(gen.kv.seq_ids()) == {r.seq_id for r in gen.scheduler.running}
    held = sum(len(gen.kv.page_table(s)) for s in gen.kv.seq_ids())
    assert held == gen.kv_stats()["num_used_pages"]


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


# --- submit / step / cancel / result ------------------------------------------------------


@pytest.mark.parametrize("with_draft", [False, True])
def test_submit_step_cancel_result(target, draft, alone, with_draft):
    gen = make_gen(target, draft if with_draft else None, page_size=4)
    handles = [gen.submit(p, GREEDY) for p in PROMPTS]
    assert gen.num_steps == 0 and gen.metrics.num_target_forwards == 0  # submit does not step
    assert [h.request_id for h in handles] == [0, 1, 2, 3]
    assert not any(h.done for h in handles)

    out = gen.step()
    assert set(out.seq_ids) == {0, 1, 2, 3} and all(len(t) == 1 for t in out.new_token_ids)
    assert handles[2].cancel() is True  # running: freed at once
    assert handles[2].done and handles[2].finish_reason == "cancelled"
    assert handles[2].cancel() is False  # twice: a no-op
    assert gen.cancel(handles[2].request_id) is False
    assert 2 not in gen.kv.seq_ids()
    assert_consistent(gen, handles)

    assert gen.cancel(handles[3].request_id) is True
    partial = handles[3].result()  # a cancelled request's partial output, not an error
    assert partial.finish_reason == "cancelled"
    assert partial.token_ids == alone(PROMPTS[3], GREEDY)[: len(partial.token_ids)]

    first = handles[0].result()  # steps until request 0 is done (request 1 advances too)
    assert first.token_ids == alone(PROMPTS[0], GREEDY)
    assert first.finish_reason == "length"
    assert handles[1].result().token_ids == alone(PROMPTS[1], GREEDY)
    assert handles[0].cancel() is False  # finished: a no-op
    assert_clean(gen)


def test_generate_and_submitted_requests_share_the_engine(target, draft, alone):
    gen = make_gen(target, draft, page_size=4)
    h = gen.submit(PROMPTS[0], GREEDY)
    outs = gen.generate(PROMPTS[1:], GREEDY)  # steps h along with its own requests
    assert [o.token_ids for o in outs] == [alone(p, GREEDY) for p in PROMPTS[1:]]
    assert h.done
    assert h.result().token_ids == alone(PROMPTS[0], GREEDY)
    assert_clean(gen)


@pytest.mark.parametrize("with_draft", [False, True])
def test_token_chunks_concatenate_to_the_output(target, draft, with_draft):
    gen = make_gen(target, draft if with_draft else None, page_size=4)
    handles = [gen.submit(p, GREEDY) for p in PROMPTS]
    chunks = list(handles[1].tokens())
    assert all(chunks) and len(chunks) > 1
    assert sum(chunks, []) == handles[1].result().token_ids
    for h in handles:
        assert sum(list(h.tokens()), []) == h.result().token_ids  # finished: one whole chunk
    assert_clean(gen)


def test_text_deltas_concatenate_to_the_text(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=24)
    handles = [gen.submit(p, params) for p in ["Once upon a time", "The little dog"]]
    deltas = list(handles[0])
    assert len(deltas) > 1
    assert "".join(deltas) == handles[0].result().text
    assert "".join(handles[1]) == handles[1].result().text
    assert handles[1].result().text == gen.generate("The little dog", params).text
    assert_clean(gen)


@pytest.mark.parametrize("with_draft", [False, True])
def test_async_streams_of_three_concurrent_requests(target, draft, with_draft):
    proposer_model = draft if with_draft else None
    params = [
        GREEDY,
        SamplingParams(max_new_tokens=7, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
    ]
    ref_gen = make_gen(target, proposer_model, page_size=4)
    expected = ref_gen.generate(PROMPTS[:3], params)

    gen = make_gen(target, proposer_model, page_size=4)

    async def consume(handle: RequestHandle) -> list[list[int]]:
        return [chunk async for chunk in handle.tokens_async()]

    async def main():
        handles = [gen.submit(p, sp) for p, sp in zip(PROMPTS[:3], params)]
        return await asyncio.gather(*(consume(h) for h in handles))

    chunks = asyncio.run(main())
    assert [sum(c, []) for c in chunks] == [o.token_ids for o in expected]
    assert all(len(c) > 1 for c in chunks)  # really streamed, step by step
    # One shared stepping loop: three consumers took no more steps than one generate().
    assert gen.num_steps == ref_gen.num_steps
    assert_clean(gen)


def test_async_text_stream(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=16)
    prompts = ["Once upon a time", "The little dog", "Lily went"]
    expected = [o.text for o in gen.generate(prompts, params)]

    async def main():
        handles = [gen.submit(p, params) for p in prompts]

        async def text(h):
            return "".join([d async for d in h.stream_async()])

        return await asyncio.gather(*(text(h) for h in handles))

    assert asyncio.run(main()) == expected
    assert_clean(gen)


# --- invariants under random interleavings ------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.integers(1, 12),  # prompt length
            st.integers(1, 16),  # max_new_tokens
            st.booleans(),  # ignore_eos
            st.integers(0, 2**16),  # prompt seed
        ),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("cancel"), st.integers(0, 63)),
    ),
    min_size=1,
    max_size=24,
)


def _run_interleaving(gen: Generator, ops, alone) -> None:
    handles: list[RequestHandle] = []
    specs: list[tuple[list[int], SamplingParams]] = []
    for op in ops:
        if op[0] == "submit":
            _, n, max_new, ignore_eos, seed = op
            prompt = random_prompt(random.Random(seed), n)
            params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
            handles.append(gen.submit(prompt, params))
            specs.append((prompt, params))
        elif op[0] == "step":
            for _ in range(op[1]):
                out = gen.step()
                assert not out.failed_seq_ids
                assert_consistent(gen, handles)
        elif handles:
            h = handles[op[1] % len(handles)]
            was_done = h.done
            assert h.cancel() is (not was_done)
            assert_consistent(gen, handles)
    while gen.scheduler.has_unfinished():
        assert not gen.step().failed_seq_ids
        assert_consistent(gen, handles)
    assert_clean(gen)
    for h, (prompt, params) in zip(handles, specs):
        assert h.done  # every request ended exactly once (assert_consistent: never twice queued)
        out = h.result()
        ref = alone(prompt, params)
        if out.finish_reason == "cancelled":
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert out.finish_reason in ("length", "stop")
            assert out.token_ids == ref


@pytest.mark.parametrize("with_draft", [False, True])
def test_random_interleavings_keep_every_invariant(target, draft, alone, with_draft):
    # 12 pages of 4 slots: four requests of up to 28 tokens (+ k + 1) cannot all fit.
    preemptions = []

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(ops=OPS)
    def check(ops):
        gen = make_gen(
            target, draft if with_draft else None, page_size=4, num_pages=12, max_batch_size=4
        )
        _run_interleaving(gen, ops, alone)
        preemptions.append(gen.scheduler.num_preemptions)

    check()
    assert sum(preemptions) > 0  # the page budget really forced preemption


# --- load ----------------------------------------------------------------------------------


def test_load_200_concurrent_requests_with_preemption(target, draft, alone):
    rng = random.Random(0)
    specs = [
        (
            random_prompt(rng, rng.randint(1, 20)),
            SamplingParams(max_new_tokens=rng.randint(1, 24), ignore_eos=True),
        )
        for _ in range(200)
    ]
    expected = [alone(p, sp) for p, sp in specs]  # each run one at a time

    gen = make_gen(target, draft, page_size=4, num_pages=64, max_batch_size=16)
    handles = [gen.submit(p, sp) for p, sp in specs]
    while gen.scheduler.has_unfinished():
        assert not gen.step().failed_seq_ids
    # (Its speed is benchmarks/load.py's business; pytest-timeout catches a hang.)
    assert [h.result().token_ids for h in handles] == expected
    assert all(h.finish_reason == "length" for h in handles)
    assert gen.scheduler.num_preemptions > 0
    assert gen.metrics.num_drafted > 0  # speculation happened inside the batches
    assert_clean(gen)


# --- failure isolation ---------------------------------------------------------------------


class PoisonTarget:
    """Wraps the target: from the ``after``-th forward on, the rows of request ``seq_id`` hold
    NaN logits. Everything else is delegated."""

    def __init__(self, inner, scheduler, seq_id: int, after: int = 2) -> None:
        self.inner = inner
        self.scheduler = scheduler
        self.seq_id = seq_id
        self.after = after
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, layout, *args, logits_indices=None, **kwargs):
        out = self.inner(layout, *args, logits_indices=logits_indices, **kwargs)
        self.calls += 1
        ids = [r.seq_id for r in self.scheduler.running]  # the batch, in order
        if self.calls >= self.after and self.seq_id in ids:
            i = ids.index(self.seq_id)
            logits = out.logits.clone()  # the model's output is an inference tensor
            if logits_indices is not None:
                logits[i] = float("nan")
            else:
                indptr = layout.qo_indptr.tolist()
                logits[indptr[i + 1] - 1] = float("nan")  # only the last verify row
            out = attrs.evolve(out, logits=logits)
        return out


@pytest.mark.parametrize("with_draft", [False, True])
def test_nan_logits_fail_only_their_request(target, draft, alone, with_draft):
    gen = make_gen(target, draft if with_draft else None, page_size=4)
    handles = [gen.submit(p, GREEDY) for p in PROMPTS]
    poison = PoisonTarget(target, gen.scheduler, seq_id=1, after=3)
    gen.engine.target = poison
    for h, p in zip(handles, PROMPTS):
        if h.request_id == 1:
            continue
        assert h.result().token_ids == alone(p, GREEDY)
    assert handles[1].done and handles[1].finish_reason == "error"
    with pytest.raises(RequestError, match=r"request 1: target logits are not finite \(NaN or inf\)"):
        handles[1].result()
    assert isinstance(handles[1].error, RequestError)
    partial = handles[1].output_ids  # what it emitted before the NaNs: still plain greedy
    assert 0 < len(partial) < GREEDY.max_new_tokens
    assert partial == alone(PROMPTS[1], GREEDY)[: len(partial)]
    assert_clean(gen)

    # generate() raises for the failed request after the others completed correctly.
    poison.seq_id, poison.calls = 5, 0
    with pytest.raises(RequestError, match="request 5"):
        gen.generate(PROMPTS, GREEDY)
    assert_clean(gen)
    gen.engine.target = target
    assert [o.token_ids for o in gen.generate(PROMPTS, GREEDY)] == [
        alone(p, GREEDY) for p in PROMPTS
    ]


class ExplodingDraft(DraftModel):
    """A draft model whose ``propose`` raises once, on its ``fail_at``-th call."""

    def __init__(self, model, fail_at: int) -> None:
        super().__init__(model, DraftModel.from_model(model, num_speculative_tokens=K).config)
        self.fail_at = fail_at
        self.calls = 0

    def propose(self, ctx):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("proposer exploded")
        return super().propose(ctx)


def test_proposer_exception_fails_its_batch_only(target, draft, alone):
    proposer = ExplodingDraft(draft, fail_at=2)
    gen = Generator.from_components(
        target,
        proposer=proposer,
        cache_config=CacheConfig(page_size=4, max_batch_size=2),
        policy=FixedPolicy(K),  # the proposer must be called on step 2
    )
    handles = [gen.submit(p, GREEDY) for p in PROMPTS]
    while gen.scheduler.has_unfinished():
        gen.step()
    failed = [h for h in handles if h.finish_reason == "error"]
    assert [h.request_id for h in failed] == [0, 1]  # the batch that was running
    for h in failed:
        with pytest.raises(RuntimeError, match="proposer exploded"):
            h.result()
    for h in handles[2:]:  # waiting at the time: untouched, and correct
        assert h.result().token_ids == alone(PROMPTS[h.request_id], GREEDY)
    assert_clean(gen)


class NaNDraftProbs(DraftModel):
    """A draft model whose draft probabilities for request ``seq_id`` turn NaN from its
    ``after``-th proposal on (a broken draft that does not raise)."""

    def __init__(self, model, seq_id: int, after: int = 2) -> None:
        super().__init__(model, DraftModel.from_model(model, num_speculative_tokens=K).config)
        self.seq_id, self.after, self.calls = seq_id, after, 0

    def propose(self, ctx):
        proposal = super().propose(ctx)
        self.calls += 1
        if self.calls >= self.after and self.seq_id in ctx.seq_ids:
            probs = proposal.draft_probs.clone()
            probs[ctx.seq_ids.index(self.seq_id)] = float("nan")
            proposal = attrs.evolve(proposal, draft_probs=probs)
        return proposal


def test_nan_draft_probabilities_fail_only_their_request(target, draft, alone):
    # Request 2 samples (so the draft sends probabilities); the greedy others get one-hot rows.
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    params = [GREEDY, GREEDY, sampled, GREEDY]
    proposer = NaNDraftProbs(draft, seq_id=2)
    gen = Generator.from_components(
        target, proposer=proposer, cache_config=CacheConfig(page_size=4), policy=FixedPolicy(K)
    )
    handles = [gen.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    with pytest.raises(RequestError, match="request 2: draft probabilities are not finite"):
        handles[2].result()
    for i in (0, 1, 3):
        assert handles[i].result().token_ids == alone(PROMPTS[i], GREEDY)
    assert_clean(gen)


def test_raising_stop_string_check_fails_only_its_request(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    params = SamplingParams(max_new_tokens=12, stop=["never-appears-zq"])
    prompts = ["Once upon a time", "The little dog", "Lily went"]
    expected = [o.token_ids for o in gen.generate(prompts, params)]
    handles = [gen.submit(p, params) for p in prompts]
    calls = []

    def broken_decode(ids):
        calls.append(len(ids))
        if len(calls) >= 3:
            raise UnicodeError("decode callback broke")
        return ""

    handles[1]._req.decode = broken_decode  # the request's stop-string decode callback
    with pytest.raises(UnicodeError, match="decode callback broke"):
        handles[1].result()
    assert handles[1].finish_reason == "error"
    assert [handles[0].result().token_ids, handles[2].result().token_ids] == [
        expected[0],
        expected[2],
    ]
    assert_clean(gen)


# --- bad input through the API -------------------------------------------------------------


def _engine_state(gen: Generator):
    return (
        [r.seq_id for r in gen.scheduler.waiting],
        [r.seq_id for r in gen.scheduler.running],
        gen.kv_stats(),
        gen.num_steps,
        gen.metrics.num_target_forwards,
    )


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([1, 2], "greedy", TypeError, "params must be a SamplingParams, got str"),
        ([1, 2], {"max_new_tokens": 3}, TypeError, "params must be a SamplingParams, got dict"),
        ([[1, 2], [3]], GREEDY, TypeError, r"submit\(\) takes one prompt"),
        ([], GREEDY, ValueError, "prompts must not be empty"),
        ([1, VOCAB], GREEDY, ValueError, rf"prompt token ids must be in \[0, {VOCAB}\)"),
        # 24 pages of 4 slots hold 95 tokens of one sequence (one slot for the bonus row)
        ([1] * CONTEXT, GREEDY, ValueError, rf"prompt has {CONTEXT} tokens, but the maximum sequence length is 95"),
        (
            [1] * 10,
            SamplingParams(max_new_tokens=200),
            ValueError,
            r"max_new_tokens must be at most 85 .*KV cache's 24 pages of 4 slots.*num_pages",
        ),
        ([1] * 10, SamplingParams(max_new_tokens=10**8), ValueError, r"max_new_tokens must be at most 85 "),
        ("hello", GREEDY, ValueError, "no tokenizer"),
        ([1], SamplingParams(stop=["x"]), ValueError, "params.stop needs a tokenizer"),
    ],
    ids=[
        "params-str",
        "params-dict",
        "several-prompts",
        "empty",
        "past-vocab",
        "over-context",
        "over-cache",
        "over-context-new-tokens",
        "text-no-tokenizer",
        "stop-no-tokenizer",
    ],
)
def test_bad_submit_changes_nothing(target, prompt, params, error, match):
    gen = make_gen(target, page_size=4, num_pages=24, max_batch_size=2)
    queued = [gen.submit(p, GREEDY) for p in PROMPTS]
    gen.step()  # two running (holding pages), two waiting
    before = _engine_state(gen)
    with pytest.raises(error, match=match):
        gen.submit(prompt, params)
    assert _engine_state(gen) == before
    assert [len(h.result().token_ids) for h in queued] == [GREEDY.max_new_tokens] * 4
    assert_clean(gen)


def test_bad_cancel_changes_nothing(target):
    gen = make_gen(target, page_size=4)
    done = gen.submit(PROMPTS[0], GREEDY)
    done.result()
    live = gen.submit(PROMPTS[1], GREEDY)
    gen.step()
    before = _engine_state(gen)
    with pytest.raises(KeyError, match="request_id 99 is not a request of this generator"):
        gen.cancel(99)
    with pytest.raises(KeyError, match="request_id -1"):
        gen.cancel(-1)
    with pytest.raises(TypeError, match="request_id must be an int, got bool"):
        gen.cancel(True)
    with pytest.raises(TypeError, match="request_id must be an int, got str"):
        gen.cancel("1")
    assert gen.cancel(done.request_id) is False  # finished: a no-op
    assert done.cancel() is False
    assert done.result().finish_reason == "length"
    assert _engine_state(gen) == before
    assert live.result().finish_reason == "length"
    assert_clean(gen)


def test_streamed_text_never_shows_the_start_of_a_stop_string(stories_path):
    """Streaming with a stop string yields exactly the text generate() returns: an end of the
    text that a stop string may yet complete is held back until it cannot (or the request
    ends). Stops are cut from the plain output at several places, so each spans tokens."""
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    prompt = "Once upon a time"
    full = gen.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)).text
    checked = 0
    for start in range(6, len(full) - 12, 7):
        stop = full[start : start + 9]
        if full.index(stop) != start:  # cut at its first occurrence only
            continue
        params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
        want = gen.generate(prompt, params)
        assert want.finish_reason == "stop" and want.text == full[:start]
        deltas = list(gen.stream(prompt, params))
        assert "".join(deltas) == want.text, stop
        checked += 1
    assert checked >= 5
