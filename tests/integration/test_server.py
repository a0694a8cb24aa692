"""The OpenAI-compatible server, driven over HTTP on 127.0.0.1 by the official ``openai`` client.

Every answer is compared with the offline ``Generator`` on the same model (stories260K with its
MTP head, so speculation runs): completions and chat, streamed and not, greedy and seeded, every
request option; usage counts; errors as OpenAI shapes them, naming the field, leaving nothing
queued or held; API keys and cache salts keep cached prefixes apart; a client that disconnects
cancels its request; a full server answers 429 with Retry-After.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from helpers import running_server

from specdec import CacheConfig, Generator, SamplingParams, StructuredOutput
from specdec.proposers import MTPHead
from specdec.server import ServerConfig

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "Once upon a time, there was a little"
# Long enough for several full KV pages (16 tokens each): a prefix the cache can share.
LONG_PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    "One day, she saw a big red ball in the park. She ran to get it and"
)


@pytest.fixture(scope="module")
def gen(stories_path):
    head = MTPHead.from_pretrained(stories_path.parent / "stories260K-mtp", num_speculative_tokens=2)
    return Generator.from_pretrained(stories_path, dtype="float32", proposer=head)


@pytest.fixture(scope="module")
def served(gen):
    server = running_server(gen, ServerConfig(model_name="stories", chat_template=TEMPLATE))
    with server as url:
        yield server, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def _idle(server) -> bool:
    """No request live in the server, no KV page held by a sequence."""
    stats = server.state.gen.kv_stats()
    return server.state.driver.num_live == 0 and stats["num_sequences"] == 0 and stats["num_used_pages"] == 0


def _wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not _idle(server):
        assert time.monotonic() < deadline, f"server not idle: {server.state.gen.kv_stats()}"
        time.sleep(0.01)


def _chat_ids(gen, messages) -> list[int]:
    text = gen.tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return list(gen.tokenizer(text, add_special_tokens=False)["input_ids"])


SETTINGS = {
    "greedy": ({"temperature": 0.0}, {"temperature": 0.0}),
    "seeded": ({"temperature": 0.9, "top_p": 0.95, "seed": 7}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_completions_equal_offline(gen, client, served, setting, stream):
    api, lib = SETTINGS[setting]
    want = gen.generate(PROMPT, SamplingParams(max_new_tokens=24, **lib))
    if stream:
        chunks = list(client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **api))  # fmt: skip
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert not chunks[-1].choices and chunks[-1].model_extra["speculation"]["target_passes"] > 0
    else:
        resp = client.completions.create(model="stories", prompt=PROMPT, max_tokens=24, **api)
        text, reasons, usage = resp.choices[0].text, [resp.choices[0].finish_reason], resp.usage
        spec = resp.model_extra["speculation"]
        assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"] and spec["target_passes"] > 0
        if setting == "greedy":  # (the adaptive policy may not draft for a sampled request)
            assert spec["drafted_tokens"] > 0
    assert text == want.text
    assert reasons == [want.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    _wait_idle(served[0])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_chat_equal_offline(gen, client, setting, stream):
    api, lib = SETTINGS[setting]
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat and a dog"}]
    want = gen.generate(_chat_ids(gen, messages), SamplingParams(max_new_tokens=20, **lib))
    if stream:
        chunks = list(client.chat.completions.create(model="stories", messages=messages, max_tokens=20,
                                                     stream=True, **api))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
    else:
        resp = client.chat.completions.create(model="stories", messages=messages, max_completion_tokens=20, **api)
        text = resp.choices[0].message.content
        assert resp.choices[0].message.role == "assistant" and resp.object == "chat.completion"
        assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
        assert resp.usage.completion_tokens == len(want.token_ids)
    assert text == want.text


def test_samples_of_several_prompts_equal_offline(gen, client):
    prompts = ["Once upon a time", "The dog ran"]
    want = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=11, n=3))
    resp = client.completions.create(model="stories", prompt=prompts, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [o.text for group in want for o in group]
    assert resp.usage.prompt_tokens == sum(len(g[0].prompt_token_ids) for g in want)  # each prompt once
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for g in want for o in g)


def test_token_id_prompts_and_echo(gen, client):
    ids = gen.encode(PROMPT)
    want = gen.generate(ids, SamplingParams(max_new_tokens=10))
    resp = client.completions.create(model="stories", prompt=ids, max_tokens=10, temperature=0, echo=True)
    assert resp.choices[0].text == gen.decode(ids) + want.text
    batch = client.completions.create(model="stories", prompt=[ids, ids[:4]], max_tokens=6, temperature=0)
    assert batch.choices[0].text == gen.generate(ids, SamplingParams(max_new_tokens=6)).text
    assert batch.choices[1].text == gen.generate(ids[:4], SamplingParams(max_new_tokens=6)).text


def test_logprobs_equal_offline(gen, client):
    want = gen.generate(PROMPT, SamplingParams(max_new_tokens=8, logprobs=2))
    resp = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    streamed = client.completions.create(model="stories", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                         stream=True)  # fmt: skip
    got = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)


def test_every_option_maps_one_to_one(gen, client):
    """Each request field reaches its SamplingParams field: the output equals the offline one
    with the same options (and differs from the plain one where the option bites)."""
    banned = gen.encode(" girl")[-1]
    api = dict(temperature=0.8, top_p=0.9, seed=3, presence_penalty=0.5, frequency_penalty=0.3,
               logit_bias={str(banned): -100.0}, stop=["park"])  # fmt: skip
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.3, min_tokens=5, bad_words=["dog"],
                 stop_token_ids=[gen.encode("sun")[-1]])  # fmt: skip
    lib = SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=3, presence_penalty=0.5,
                         frequency_penalty=0.3, logit_bias={banned: -100.0}, stop=("park",), top_k=20,
                         min_p=0.05, repetition_penalty=1.3, min_tokens=5, bad_words=("dog",),
                         stop_token_ids=(gen.encode("sun")[-1],))  # fmt: skip
    resp = client.completions.create(model="stories", prompt=PROMPT, max_tokens=30, extra_body=extra, **api)
    want = gen.generate(PROMPT, lib)
    assert resp.choices[0].text == want.text
    assert banned not in want.token_ids
    choice = client.completions.create(model="stories", prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"guided_choice": ["cat", "dog and a ball"]})  # fmt: skip
    assert choice.choices[0].text in ("cat", "dog and a ball")
    assert choice.choices[0].text == gen.generate(PROMPT, SamplingParams(
        max_new_tokens=16, structured_output=StructuredOutput(choice=["cat", "dog and a ball"]))).text
    allowed = gen.encode(" the a")
    only = client.completions.create(model="stories", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"allowed_token_ids": allowed, "ignore_eos": True})  # fmt: skip
    assert gen.encode(only.choices[0].text) and set(gen.encode(only.choices[0].text)) <= set(allowed)


def test_prompt_logprobs(gen, client):
    want = gen.generate(PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    resp = client.completions.create(model="stories", prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 1})  # fmt: skip
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for entry, row in zip(want.prompt_logprobs[1:], got[1:]):
        assert row[str(entry.token_id)]["logprob"] == pytest.approx(entry.logprob, abs=1e-5)


BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1000}}, "logit_bias"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens"),
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"guided_json": {"type": "nonsense"}}}, "guided_json"),
    ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": "once upon a time " * 400}, "prompt"),  # longer than the model's 512 positions
    ({"max_tokens": 600}, "max_tokens"),  # prompt + max_tokens past the 512 positions
    ({"max_tokens": 600, "n": 2, "temperature": 1}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completions_are_400_naming_the_field(client, served, kwargs, param):
    kwargs = {"prompt": PROMPT, "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="stories", **kwargs)
    body = err.value.body
    assert err.value.status_code == 400
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    assert body["message"]
    assert _idle(served[0])  # nothing queued, no page held


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "once upon a time " * 400}]}, "messages"),  # past 512 positions
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chats_are_400_naming_the_field(client, served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="stories", **kwargs)
    assert err.value.body["param"] == param, err.value.body
    assert _idle(served[0])


def test_a_completion_past_the_context_is_400_with_the_numbers(gen, client, served):
    n = len(gen.encode(PROMPT))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="stories", prompt=PROMPT, max_tokens=600)
    body = err.value.body
    assert body["param"] == "max_tokens"
    assert body["message"] == (
        f"max_tokens must be at most {512 - n} for this {n}-token prompt: the maximum sequence length is 512 "
        f"tokens (the model's context, max_position_embeddings), and {n + 600} were requested ({n} in the "
        "prompt, 600 in the completion)"
    )
    assert _idle(served[0])


def test_a_chat_without_max_tokens_may_run_to_the_context_end(gen, client, served):
    """OpenAI's chat default: no max_tokens is whatever the context leaves after the prompt."""
    messages = [{"role": "user", "content": "A cat and a dog"}]
    prompt = _chat_ids(gen, messages)
    resp = client.chat.completions.create(model="stories", messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.usage.completion_tokens == 512 - len(prompt) and resp.choices[0].finish_reason == "length"
    assert client.models.list().data[0].model_extra["max_model_len"] == 512
    _wait_idle(served[0])


def test_a_server_bounded_by_max_model_len(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32", cache_config=CacheConfig(max_model_len=64))
    messages = [{"role": "user", "content": "A cat"}]
    with running_server(gen, ServerConfig(model_name="s", chat_template=TEMPLATE)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].model_extra["max_model_len"] == 64
        resp = client.chat.completions.create(model="s", messages=messages, temperature=0, extra_body={"ignore_eos": True})
        assert resp.usage.prompt_tokens + resp.usage.completion_tokens == 64
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="s", prompt=PROMPT, max_tokens=60)
        assert err.value.body["param"] == "max_tokens" and "(max_model_len; raise" in err.value.body["message"]


def test_unknown_model_is_404_and_bad_json_400(client, served):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=4)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    r = httpx.post(served[1] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(served[1] + "/v1/completions", json={"prompt": [], "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    for echo in (False, True):  # ids outside the vocabulary, echoed or not
        r = httpx.post(served[1] + "/v1/completions", json={"prompt": [1, 10**6], "max_tokens": 3, "echo": echo})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_models_health_and_metrics(gen, client, served):
    url = served[1]
    assert [m.id for m in client.models.list()] == ["stories"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    for salt in ("m1", "m1"):  # the second finds the first's pages
        client.completions.create(model="stories", prompt=LONG_PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"cache_salt": salt})  # fmt: skip
    text = httpx.get(url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}  # fmt: skip
    for name in ("specdec_spec_decode_num_draft_tokens_total", "specdec_spec_decode_num_accepted_tokens_total",
                 'specdec_spec_decode_acceptance_rate_per_position{model="stories",position="0"}',
                 "specdec_time_to_first_token_seconds_count", "specdec_time_per_output_token_seconds_count",
                 "specdec_prefix_cache_hits_total", "specdec_kv_pages_total"):  # fmt: skip
        key = name if "{" in name else f'{name}{{model="stories"}}'
        assert values[key] > 0, name
    assert 0 < values['specdec_prefix_cache_hit_rate{model="stories"}'] <= 1
    assert values['specdec_num_requests_waiting{model="stories"}'] == 0
    assert any(k.startswith("specdec_spec_decode_k_total{") for k in values)
    m = gen.metrics
    assert values['specdec_spec_decode_num_draft_tokens_total{model="stories"}'] == m.num_drafted


def _hits(gen) -> int:
    return gen.kv_stats()["prefix_cache_hit_tokens"]


def test_salts_and_api_keys_never_share_pages(stories_path):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    with running_server(gen, ServerConfig(model_name="s", api_keys=("alpha", "beta"))) as url:
        def ask(key, **extra):
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            return c.completions.create(model="s", prompt=LONG_PROMPT, max_tokens=3, temperature=0, extra_body=extra)

        with pytest.raises(openai.AuthenticationError) as err:
            ask("gamma")
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401  # no header
        first = ask("alpha").choices[0].text
        before = _hits(gen)
        assert ask("beta").choices[0].text == first
        assert _hits(gen) == before  # another key: none of alpha's pages
        assert ask("alpha").choices[0].text == first
        assert _hits(gen) > before  # the same key: its own pages
        before = _hits(gen)
        ask("alpha", cache_salt="private")
        assert _hits(gen) == before  # a salt parts a key's requests further
        ask("alpha", cache_salt="private")
        assert _hits(gen) > before


def _slow_engine(gen, monkeypatch) -> None:
    """Each engine step takes 10 ms more: a long request outlives the client's visit."""
    step = gen.step
    monkeypatch.setattr(gen, "step", lambda: (time.sleep(0.01), step())[1])


def test_streaming_client_that_disconnects_cancels(gen, served, monkeypatch):
    server, url = served
    _slow_engine(gen, monkeypatch)
    before = server.state.metrics.finished.labels("stories", "cancelled")._value.get()
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    _wait_idle(server)
    assert server.state.metrics.finished.labels("stories", "cancelled")._value.get() == before + 1


def test_waiting_client_that_disconnects_cancels(gen, served, monkeypatch):
    server, url = served
    _slow_engine(gen, monkeypatch)
    before = server.state.metrics.finished.labels("stories", "cancelled")._value.get()
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "stories", "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        deadline = time.monotonic() + 10
        while server.state.driver.num_live == 0:  # admitted
            assert time.monotonic() < deadline
            time.sleep(0.005)
    _wait_idle(server)
    assert server.state.metrics.finished.labels("stories", "cancelled")._value.get() == before + 1


def test_full_server_answers_429_with_retry_after(stories_path, monkeypatch):
    gen = Generator.from_pretrained(stories_path, dtype="float32", cache_config=CacheConfig(prefix_caching=False))
    gate = threading.Event()
    step = gen.step
    monkeypatch.setattr(gen, "step", lambda: (gate.wait(), step())[1])  # the engine waits for the test
    with running_server(gen, ServerConfig(model_name="s", max_pending=2, retry_after_s=3)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        results = []
        ask = lambda: results.append(client.completions.create(model="s", prompt=PROMPT, max_tokens=5, temperature=0))  # noqa: E731
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while gen.queue_stats()["num_waiting"] + gen.queue_stats()["num_running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="s", prompt=PROMPT, max_tokens=5)
        assert err.value.response.headers["retry-after"] == "3"
        assert err.value.body["type"] == "rate_limit_error"
        gate.set()
        for t in threads:
            t.join(30)
        assert len(results) == 2 and all(r.choices[0].finish_reason for r in results)
        assert gen.kv_stats()["num_used_pages"] == 0
