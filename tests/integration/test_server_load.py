"""A bounded load test of the server: 64 concurrent streaming clients, 10% of them dropping
mid-stream. Nothing is lost (every other client gets its whole answer), no KV page leaks,
every finished output equals the offline Generator's, and p50/p99 TTFT and throughput are
reported (printed; ``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import openai
import pytest
from helpers import running_server

from specdec import Generator, SamplingParams
from specdec.proposers import MTPHead
from specdec.server import ServerConfig

NUM_CLIENTS = 64
DROP_EVERY = 10  # clients 0, 10, 20, ... leave after their second chunk: 7 of 64 (~10%)
MAX_TOKENS = 24
STARTS = ["Once upon a time", "The little dog", "One day, a girl", "Tom and Sue", "The sun was", "A big red"]


def _request(i: int) -> tuple[str, dict, SamplingParams]:
    """Client ``i``'s prompt and options: greedy or seeded, with a varied prompt."""
    prompt = f"{STARTS[i % len(STARTS)]} {'and ' * (i % 5)}".strip()
    if i % 2:
        return prompt, {"temperature": 0.8, "seed": i}, SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.8, seed=i)
    return prompt, {"temperature": 0.0}, SamplingParams(max_new_tokens=MAX_TOKENS)


async def _client(client: openai.AsyncOpenAI, i: int) -> dict:
    prompt, api, _ = _request(i)
    start = time.perf_counter()
    ttft = None
    text, reason = "", None
    if i % DROP_EVERY == 0:  # a long answer, so that the client leaves long before its end
        api = api | {"max_tokens": 400, "extra_body": {"ignore_eos": True}}
    api = {"max_tokens": MAX_TOKENS} | api
    stream = await client.completions.create(model="stories", prompt=prompt, stream=True, **api)
    chunks = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        chunks += 1
        if i % DROP_EVERY == 0 and chunks == 2:
            await stream.close()  # the client leaves mid-stream
            return {"i": i, "dropped": True}
    return {"i": i, "dropped": False, "text": text, "reason": reason, "ttft": ttft}


@pytest.mark.timeout(300)
def test_64_streaming_clients_with_drops(stories_path):
    head = MTPHead.from_pretrained(stories_path.parent / "stories260K-mtp", num_speculative_tokens=2)
    gen = Generator.from_pretrained(stories_path, dtype="float32", proposer=head)
    want = {i: gen.generate(_request(i)[0], _request(i)[2]) for i in range(NUM_CLIENTS)}
    server = running_server(gen, ServerConfig(model_name="stories"))
    with server as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)

        async def run_all():
            return await asyncio.gather(*(_client(client, i) for i in range(NUM_CLIENTS)))

        start = time.perf_counter()
        results = asyncio.run(run_all())
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 20
        while server_busy(gen):  # the dropped clients' requests end within a step or two
            assert time.monotonic() < deadline, gen.kv_stats()
            time.sleep(0.01)
    finished = [r for r in results if not r["dropped"]]
    assert len(results) == NUM_CLIENTS and len(finished) == NUM_CLIENTS - len(range(0, NUM_CLIENTS, DROP_EVERY))
    for r in finished:  # nothing lost, nothing changed
        assert r["text"] == want[r["i"]].text, r["i"]
        assert r["reason"] == want[r["i"]].finish_reason
    cancelled = server.state.metrics.finished.labels("stories", "cancelled")._value.get()
    assert cancelled == NUM_CLIENTS - len(finished)  # every client that left cancelled its request
    stats = gen.kv_stats()
    assert stats["num_used_pages"] == 0 and stats["num_sequences"] == 0  # no page leaked
    ttfts = sorted(r["ttft"] for r in finished if r["ttft"] is not None)
    tokens = sum(len(want[r["i"]].token_ids) for r in finished)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    print(f"\n{NUM_CLIENTS} clients ({NUM_CLIENTS - len(finished)} dropped): TTFT p50 "
          f"{statistics.median(ttfts) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms; {tokens / wall:.0f} tok/s, {wall:.2f} s")  # fmt: skip


def server_busy(gen) -> bool:
    stats = gen.kv_stats()
    queue = gen.queue_stats()
    return bool(stats["num_sequences"] or queue["num_waiting"] or queue["num_running"])
