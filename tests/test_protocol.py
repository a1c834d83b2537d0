"""OpenAI wire types: the raw body passes through; a bad body is a 400 naming the field."""

from __future__ import annotations

import orjson
import pytest

from serve_app.errors import ForgeError
from serve_app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    prompt_text,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields) -> bytes:
    return orjson.dumps({**CHAT, **fields})


def rejected(raw: bytes, model=ChatCompletionRequest) -> ForgeError:
    with pytest.raises(ForgeError) as info:
        parse_request(raw, model)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def test_returns_raw_dict_unchanged_and_model():
    body = {
        **CHAT,
        "logit_bias": {"50256": -100},
        "response_format": {"type": "json_object"},
        "some_future_param": [1, 2],
    }
    raw, parsed = parse_request(orjson.dumps(body), ChatCompletionRequest)
    assert raw == body
    assert isinstance(parsed, ChatCompletionRequest)
    assert parsed.model == "m"
    assert parsed.messages[0].role == "user" and parsed.messages[0].content == "hi"
    assert parsed.stream is False


def test_unknown_message_fields_pass_through():
    body = {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": []}]}
    raw, _ = parse_request(orjson.dumps(body), ChatCompletionRequest)
    assert raw["messages"][0]["tool_calls"] == []


def test_content_parts_accepted():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    _, parsed = parse_request(orjson.dumps(body), ChatCompletionRequest)
    assert parsed.messages[0].content[0].text == "x"


def test_invalid_json():
    err = rejected(b'{"model": ')
    assert err.code == "invalid_json"
    assert err.message.startswith("Request body is not valid JSON")


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"null", b"3"])
def test_non_object_json(raw):
    err = rejected(raw)
    assert err.code == "invalid_json"
    assert err.message == "Request body must be a JSON object."


@pytest.mark.parametrize("missing", ["model", "messages"])
def test_missing_field(missing):
    body = dict(CHAT)
    del body[missing]
    err = rejected(orjson.dumps(body))
    assert err.code == "missing_required_parameter"
    assert err.param == missing
    assert err.message == f"Missing required parameter: '{missing}'."


def test_nested_missing_param_path():
    err = rejected(orjson.dumps({"model": "m", "messages": [{"content": "x"}]}))
    assert (err.code, err.param) == ("missing_required_parameter", "messages.0.role")


def test_nested_invalid_param_path():
    body = {"model": "m", "messages": [CHAT["messages"][0], {"role": "robot", "content": "x"}]}
    err = rejected(orjson.dumps(body))
    assert (err.code, err.param) == ("invalid_value", "messages.1.role")
    assert err.message.startswith("Invalid value for 'messages.1.role'")


@pytest.mark.parametrize(
    ("raw", "model", "param"),
    [
        (
            chat(messages=[{"role": "user", "content": 5}]),
            ChatCompletionRequest,
            "messages.0.content",
        ),
        (orjson.dumps({"model": "m", "prompt": 5}), CompletionRequest, "prompt"),
    ],
)
def test_union_fields_name_the_client_field(raw, model, param):
    # Pydantic's union-member tags ("prompt.str") are not fields the client sent.
    assert rejected(raw, model).param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"messages": []}, "messages"),
        ({"model": ""}, "model"),
        ({"stream": "maybe"}, "stream"),
        # Strict, as OpenAI's schema: a bool is not a count, a string is not a number.
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream": 1}, "stream"),
        ({"seed": False}, "seed"),
    ],
)
def test_invalid_values_name_their_param(fields, param):
    err = rejected(chat(**fields))
    assert (err.code, err.param) == ("invalid_value", param)


def test_n_above_one_is_refused():
    err = rejected(chat(n=2))
    assert err.message == "Only n=1 is supported."
    assert err.param == "n"


def test_a_whole_temperature_is_a_number():
    assert parse_request(chat(temperature=1), ChatCompletionRequest)[1].temperature == 1.0


def test_n_equal_one_accepted():
    assert parse_request(chat(n=1), ChatCompletionRequest)[1].n == 1


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"stream": True, "stream_options": {"include_usage": True}}, True),
        ({"stream": True, "stream_options": {"include_usage": False}}, False),
        ({"stream": True}, False),
        # Usage is only streamed: without stream it is always in the body anyway.
        ({"stream": False, "stream_options": {"include_usage": True}}, False),
    ],
)
def test_include_usage(fields, expected):
    assert parse_request(chat(**fields), ChatCompletionRequest)[1].include_usage is expected


def test_chat_output_limit_prefers_max_completion_tokens():
    _, parsed = parse_request(chat(max_tokens=10, max_completion_tokens=20), ChatCompletionRequest)
    assert parsed.output_limit() == 20
    assert parse_request(chat(max_tokens=10), ChatCompletionRequest)[1].output_limit() == 10
    assert parse_request(chat(), ChatCompletionRequest)[1].output_limit() is None


def test_completion_prompt_string_and_list_of_one():
    raw, _ = parse_request(orjson.dumps({"model": "m", "prompt": "abc"}), CompletionRequest)
    assert prompt_text(raw, "completion") == "abc"
    raw, _ = parse_request(orjson.dumps({"model": "m", "prompt": ["abc"]}), CompletionRequest)
    assert prompt_text(raw, "completion") == "abc"
    assert raw["prompt"] == ["abc"]


@pytest.mark.parametrize("prompt", [[], ["a", "b"], [1, 2], [[1, 2]]])
def test_completion_prompt_list_must_hold_one_string(prompt):
    """A batch (LangChain's OpenAI LLM sends its batches so) or token ids: the 400 says what
    is taken and what to do instead, not pydantic's "should be a valid string"."""
    err = rejected(orjson.dumps({"model": "m", "prompt": prompt}), CompletionRequest)
    assert err.param == "prompt"
    assert "one text prompt per request" in err.message and "valid string" not in err.message


def test_completion_missing_prompt():
    err = rejected(orjson.dumps({"model": "m"}), CompletionRequest)
    assert (err.code, err.param) == ("missing_required_parameter", "prompt")


@pytest.mark.parametrize(
    "parts",
    [
        [{"type": "text", "text": None}],
        [{"type": "text"}],
        [{"text": "no type"}],
        ["just a string"],
    ],
)
def test_malformed_content_parts_are_a_400_not_a_crash(parts):
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]})
    with pytest.raises(ForgeError) as info:
        parse_request(raw, ChatCompletionRequest)
    assert info.value.status == 400
    assert info.value.param.startswith("messages.0.content")


def test_non_text_parts_are_kept_and_ignored_by_the_prompt():
    from serve_app.protocol import prompt_text

    parts = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "hi"}]
    body, _ = parse_request(
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]}),
        ChatCompletionRequest,
    )
    assert body["messages"][0]["content"] == parts
    assert "hi" in prompt_text(body, "chat") and "image_url" not in prompt_text(body, "chat")
