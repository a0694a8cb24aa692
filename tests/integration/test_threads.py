"""One Generator shared by many threads and asyncio tasks at once.

Every caller must get exactly the output its request gets alone (greedy and seeded sampled
requests alike), nothing may raise, concurrent callers must share batches, and every KV page
must be free at the end. The model is the real stories260K (float64, so batch composition
cannot flip a near-tie), with no proposer, a draft model (a noisy copy) and the bundled MTP
head, under the default adaptive policy, whose k choices follow wall-clock timings and so
differ from run to run: outputs must not depend on them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from helpers import perturbed

from specdec import CacheConfig, Generator, SamplingParams
from specdec.models.loading import load_model
from specdec.proposers import DraftModel, MTPHead

MTP_HEAD = Path(__file__).resolve().parents[2] / "src" / "specdec" / "data" / "stories260K-mtp"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a bird",
    "The sun was",
    "Tim had a red ball.",
]
NUM_THREADS = 8
ROUNDS = 3


def _params(i: int) -> SamplingParams:
    """Greedy, T = 1.0 and T = 0.7 with top-p, with different lengths (so requests end at
    different steps and newcomers join running batches)."""
    n = 12 + 5 * (i % 5)
    kind = i % 3
    if kind == 0:
        return SamplingParams(max_new_tokens=n)
    if kind == 1:
        return SamplingParams(max_new_tokens=n, temperature=1.0, seed=1000 + i)
    return SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=2000 + i)


@pytest.fixture(scope="module")
def stories(stories_path):
    target, _, _ = load_model(stories_path, dtype="float64")
    plain = Generator.from_pretrained(stories_path, dtype="float64")
    return target, plain


def _shared(stories, kind: str, max_batch_size: int = 8) -> Generator:
    target, plain = stories
    cache = CacheConfig(max_batch_size=max_batch_size)
    if kind == "plain":
        return Generator.from_components(target, plain.tokenizer, cache_config=cache)
    if kind == "draft":
        proposer = DraftModel.from_model(perturbed(target, 0.2, seed=3), num_speculative_tokens=3)
    else:
        proposer = MTPHead.from_pretrained(MTP_HEAD, num_speculative_tokens=2)
    return plain.with_proposer(proposer, cache_config=cache)


class _Alone:
    """Each (prompt, params) run alone through plain decoding, memoised."""

    def __init__(self, plain: Generator) -> None:
        self.plain = plain
        self.cache: dict[tuple[str, SamplingParams], object] = {}

    def __call__(self, prompt: str, params: SamplingParams):
        key = (prompt, params)
        if key not in self.cache:
            self.cache[key] = self.plain.generate(prompt, params)
        return self.cache[key]


def _batch_sizes(gen: Generator) -> list[int]:
    """Record the size of every engine step's batch."""
    sizes: list[int] = []
    step = gen.engine.step

    def recording_step():
        out = step()
        sizes.append(len(out.seq_ids))
        return out

    gen.engine.step = recording_step
    return sizes


def _one_round(gen: Generator, alone: _Alone, t: int, r: int) -> None:
    """One caller's operation; asserts its output equals the request alone."""
    i = t * ROUNDS + r
    prompt, params = PROMPTS[i % len(PROMPTS)], _params(i)
    op = (t + r) % 4
    if op == 0:  # generate, two prompts in one call
        other, other_params = PROMPTS[(i + 1) % len(PROMPTS)], _params(i + 1)
        outs = gen.generate([prompt, other], [params, other_params])
        assert outs[0].token_ids == alone(prompt, params).token_ids
        assert outs[1].token_ids == alone(other, other_params).token_ids
    elif op == 1:  # stream text
        assert "".join(gen.stream(prompt, params)) == alone(prompt, params).text
    elif op == 2:  # submit, then result()
        handle = gen.submit(prompt, params)
        out = handle.result()
        assert out.token_ids == alone(prompt, params).token_ids
        assert out.text == alone(prompt, params).text
    else:  # submit, follow a few steps, cancel
        handle = gen.submit(prompt, params)
        seen: list[int] = []
        for chunk in handle.tokens():
            seen.extend(chunk)
            if len(seen) >= 3:
                break
        handle.cancel()
        out = handle.result()
        expected = alone(prompt, params).token_ids
        assert out.finish_reason in ("cancelled", "length", "stop")
        assert out.token_ids == expected[: len(out.token_ids)]
        assert seen == expected[: len(seen)]


def _run_threads(target_fn, n: int) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(t: int) -> None:
        try:
            barrier.wait()
            target_fn(t)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    return errors


def _assert_clean(gen: Generator) -> None:
    stats = gen.kv_stats()
    assert stats["num_free_pages"] == stats["num_total_pages"]
    assert not gen.scheduler.has_unfinished()


@pytest.mark.parametrize("kind", ["plain", "draft", "mtp"])
def test_eight_threads_share_one_generator(stories, kind):
    gen = _shared(stories, kind)
    alone = _Alone(stories[1])
    sizes = _batch_sizes(gen)
    errors = _run_threads(lambda t: [_one_round(gen, alone, t, r) for r in range(ROUNDS)], NUM_THREADS)
    if errors:
        raise errors[0]
    _assert_clean(gen)
    assert max(sizes) >= 4, "concurrent callers did not share batches"
    if kind != "plain":
        assert gen.metrics.num_drafted > 0


def test_asyncio_tasks_and_threads_at_once(stories):
    gen = _shared(stories, "draft", max_batch_size=64)
    alone = _Alone(stories[1])
    for i in range(60):  # the references first, so the shared run is all concurrent
        alone(PROMPTS[i % len(PROMPTS)], _params(i))
    sizes = _batch_sizes(gen)

    async def task(i: int) -> None:
        prompt, params = PROMPTS[i % len(PROMPTS)], _params(i)
        handle = gen.submit(prompt, params)
        if i % 2:
            text = "".join([d async for d in handle.stream_async()])
            assert text == alone(prompt, params).text
        else:
            ids = [t async for chunk in handle.tokens_async() for t in chunk]
            assert ids == alone(prompt, params).token_ids

    async def tasks() -> None:
        await asyncio.gather(*(task(i) for i in range(50)))

    def thread(t: int) -> None:
        if t == 0:
            asyncio.run(tasks())
        else:
            for r in range(ROUNDS):
                _one_round(gen, alone, t, r)

    errors = _run_threads(thread, 5)  # the event loop's thread + 4 others
    if errors:
        raise errors[0]
    _assert_clean(gen)
    assert max(sizes) >= 16, "concurrent callers did not share batches"


def test_metrics_and_kv_stats_are_consistent_snapshots(stories):
    gen = _shared(stories, "draft")
    snapshot = gen.metrics
    gen.generate(PROMPTS[0], _params(0))
    assert snapshot.num_generated_tokens == 0  # a copy, not the live totals
    assert gen.metrics.num_generated_tokens > 0
