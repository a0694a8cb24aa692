"""A consumer that stops listening cancels its request: its pages are free within one step.

Breaking out of ``stream_async()`` or ``tokens()``, closing them, or cancelling the asyncio task
that iterates: the request ends as cancelled, holds no page, and is never stepped again, while
the requests beside it run on to their normal output.
"""

from __future__ import annotations

import asyncio

import pytest

from specdec import CacheConfig, Generator, SamplingParams

LONG = SamplingParams(max_new_tokens=200, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(stories_path):
    # No prefix cache: every page a finished request leaves is then simply free.
    return Generator.from_pretrained(stories_path, dtype="float32", cache_config=CacheConfig(prefix_caching=False))


def _no_pages_held(gen: Generator) -> bool:
    stats = gen.kv_stats()
    return stats["num_used_pages"] == 0 and stats["num_sequences"] == 0


def _assert_cancelled_within_one_step(gen: Generator, handle) -> None:
    if not handle.done:  # a step was running when the consumer left: the next one cancels
        gen.step()
    assert handle.done and handle.finish_reason == "cancelled"
    assert len(handle.output_ids) < LONG.max_new_tokens


def test_breaking_out_of_sync_iterators_cancels(gen):
    for make in (lambda h: h.tokens(), lambda h: iter(h)):
        handle = gen.submit("Once upon a time", LONG)
        for _ in make(handle):
            break
        _assert_cancelled_within_one_step(gen, handle)
        assert _no_pages_held(gen)


def test_breaking_out_of_stream_async_cancels(gen):
    async def main():
        handle = gen.submit("Once upon a time", LONG)
        other = gen.submit("The little dog", SHORT)
        async for _ in handle.stream_async():
            break
        for _ in range(3):  # the abandoned generator is closed by the event loop's finalizer
            await asyncio.sleep(0)
        _assert_cancelled_within_one_step(gen, handle)
        return await asyncio.to_thread(other.result)

    alone = gen.generate("The little dog", SHORT)
    assert asyncio.run(main()).token_ids == alone.token_ids
    assert _no_pages_held(gen)


def test_aclose_cancels(gen):
    async def main():
        handle = gen.submit("Once upon a time", LONG)
        stream = handle.tokens_async()
        await stream.__anext__()
        await stream.aclose()
        _assert_cancelled_within_one_step(gen, handle)

    asyncio.run(main())
    assert _no_pages_held(gen)


def test_cancelling_the_consuming_task_cancels(gen):
    async def main():
        handle = gen.submit("Once upon a time", LONG)
        first = asyncio.Event()

        async def consume():
            async for _ in handle.stream_async():
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker thread of the cancelled wait may still be taking one step.
        await asyncio.to_thread(lambda: None)
        return handle

    handle = asyncio.run(main())
    _assert_cancelled_within_one_step(gen, handle)
    assert _no_pages_held(gen)


def test_a_finished_stream_is_not_cancelled(gen):
    async def main():
        handle = gen.submit("Once upon a time", SHORT)
        text = "".join([d async for d in handle.stream_async()])
        return handle, text

    handle, text = asyncio.run(main())
    assert handle.finish_reason == "length" and text == gen.generate("Once upon a time", SHORT).text
