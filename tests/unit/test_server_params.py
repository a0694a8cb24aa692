"""OpenAI request bodies map to SamplingParams one field to one field, and every value the
library rejects is an APIError naming the request's field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specdec import SamplingParams, StructuredOutput
from specdec.server.errors import APIError, field_of_message
from specdec.server.params import chat_sampling_params, completion_sampling_params
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest

ALL = {
    "prompt": "x", "max_tokens": 9, "temperature": 0.7, "top_p": 0.8, "n": 2, "stop": ["a", "b"], "seed": 5,
    "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"3": -1.5}, "logprobs": 2,
    "top_k": 4, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
    "stop_token_ids": [7], "allowed_token_ids": [1, 2, 3], "bad_words": ["no"], "prompt_logprobs": 1,
    "cache_salt": "s",
}  # fmt: skip


def test_every_completion_field_reaches_its_params_field():
    params = completion_sampling_params(CompletionRequest(**ALL), salt=None)
    assert params == SamplingParams(
        max_new_tokens=9, temperature=0.7, top_p=0.8, n=2, stop=("a", "b"), seed=5, presence_penalty=0.1,
        frequency_penalty=0.2, logit_bias={3: -1.5}, logprobs=2, top_k=4, min_p=0.05, repetition_penalty=1.1,
        min_tokens=2, ignore_eos=True, stop_token_ids=(7,), allowed_token_ids=(1, 2, 3), bad_words=("no",),
        prompt_logprobs=1, cache_salt="s",
    )
    regex = completion_sampling_params(CompletionRequest(prompt="x", guided_regex="[a-z]+"), salt=None)
    assert regex.structured_output == StructuredOutput(regex="[a-z]+")  # fmt: skip


def test_openai_defaults():
    params = completion_sampling_params(CompletionRequest(prompt="x"), salt=None)
    assert (params.max_new_tokens, params.temperature, params.n) == (16, 1.0, 1)  # OpenAI's defaults
    nulls = CompletionRequest(prompt="x", max_tokens=None, temperature=None, top_p=None)
    assert completion_sampling_params(nulls, salt=None) == params  # null is the default
    chat = chat_sampling_params(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), salt=None,
                                max_tokens=100)  # fmt: skip
    assert chat.max_new_tokens == 100 and chat.logprobs is None


def test_chat_fields():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7,
                                 logprobs=True, top_logprobs=3,
                                 response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})  # fmt: skip
    params = chat_sampling_params(body, salt=None, max_tokens=100)
    assert params.max_new_tokens == 7 and params.logprobs == 3
    assert params.structured_output == StructuredOutput(json_schema={"type": "object"})
    json_object = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
    assert chat_sampling_params(json_object, salt=None, max_tokens=5).structured_output == StructuredOutput(json_object=True)
    text = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"})
    assert chat_sampling_params(text, salt=None, max_tokens=5).structured_output is None


def test_key_salt_and_request_salt_combine():
    key = completion_sampling_params(CompletionRequest(prompt="x"), salt="K")
    both = completion_sampling_params(CompletionRequest(prompt="x", cache_salt="r"), salt="K")
    alone = completion_sampling_params(CompletionRequest(prompt="x", cache_salt="r"), salt=None)
    assert len({key.cache_salt, both.cache_salt, alone.cache_salt}) == 3


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"logprobs": -1}, "logprobs"), ({"min_p": 1.0}, "min_p"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"cache_salt": ""}, "cache_salt"),
])  # fmt: skip
def test_bad_values_name_the_request_field(fields, param):
    with pytest.raises(APIError) as err:
        completion_sampling_params(CompletionRequest(prompt="x", **fields), salt=None)
    assert err.value.param == param and err.value.status == 400
    assert err.value.message.startswith(param) or param in err.value.message


def test_chat_max_completion_tokens_named():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0)
    with pytest.raises(APIError) as err:
        chat_sampling_params(body, salt=None, max_tokens=10)
    assert err.value.param == "max_completion_tokens"


def test_types_are_strict_and_unknown_fields_rejected():
    for bad in ({"stream": "yes"}, {"max_tokens": "3"}, {"bogus": 1}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)
    assert CompletionRequest(prompt="x", temperature=1).temperature == 1  # an int is a number


def test_field_of_message():
    assert field_of_message("top_p must be in (0, 1], got 2") == "top_p"
    assert field_of_message("params.bad_words needs a tokenizer") == "bad_words"
    assert field_of_message("  ") is None
