"""Tool calling in the simulated engine, as an agent (and the official client) sees it."""

from __future__ import annotations

import datetime as dt
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from serve_app.auth.keys import hash_key
from serve_app.config.models import SimulatedEngineConfig, load_config
from serve_app.engines.simulated import SimulatedEngine
from serve_app.engines.tool_calls import plan_tool_calls
from serve_app.errors import ForgeError
from serve_app.local import build_local_gateway
from tests.tool_deltas import assemble

KEY = "sk-test-tools"
STATUS = {
    "type": "function",
    "function": {
        "name": "get_service_status",
        "description": "The status of a service.",
        "parameters": {
            "type": "object",
            "properties": {
                "service": {"type": "string"},
                "region": {"type": "string", "enum": ["eu", "us"]},
                "verbose": {"type": "boolean"},
            },
            "required": ["service", "region"],
        },
    },
}
TICKET = {
    "type": "function",
    "function": {
        "name": "open_ticket",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "priority": {"type": "integer", "minimum": 1},
            },
            "required": ["title", "priority"],
        },
    },
}
TOOLS = [STATUS, TICKET]
ASK = [{"role": "user", "content": "Check the service status of checkout"}]


def body(messages=ASK, **extra) -> dict:
    return {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 200, **extra}


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_auto_calls_the_tool_the_user_names_with_arguments_from_its_schema():
    (call,) = plan_tool_calls(body(), "r1")
    assert call.name == "get_service_status"
    arguments = json.loads(call.arguments)
    assert arguments == {"service": "checkout", "region": "eu"}
    jsonschema.validate(arguments, schema_of(call.name))


def test_auto_answers_in_text_when_no_tool_is_named_or_a_result_is_in():
    assert plan_tool_calls(body([{"role": "user", "content": "hello"}]), "r") == []
    (call,) = plan_tool_calls(body(), "r")
    after = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"status": "degraded"}'},
    ]
    assert plan_tool_calls(body(after), "r") == []
    # Claude Code puts a note of its own after the results: still the results' turn.
    noted = [*after, {"role": "user", "content": "<system-reminder>Check the service status"}]
    assert plan_tool_calls(body(noted), "r") == []
    # Required, results in: the tool it did not just call (pydantic-ai's final_result), so a
    # required loop ends instead of calling the same tool for ever.
    [then] = plan_tool_calls(body(noted, tool_choice="required"), "r")
    assert then.name == "open_ticket" != call.name


def test_required_named_none_and_parallel_choices():
    hello = [{"role": "user", "content": "hello"}]
    assert [c.name for c in plan_tool_calls(body(hello, tool_choice="required"), "r")] == [
        "get_service_status"
    ]
    named = {"type": "function", "function": {"name": "open_ticket"}}
    (call,) = plan_tool_calls(body(tool_choice=named), "r")
    jsonschema.validate(json.loads(call.arguments), schema_of("open_ticket"))
    assert plan_tool_calls(body(tool_choice="none"), "r") == []
    both = [{"role": "user", "content": "get service status, then open ticket for checkout"}]
    assert [c.name for c in plan_tool_calls(body(both), "r")] == [
        "get_service_status",
        "open_ticket",
    ]
    assert len(plan_tool_calls(body(both, parallel_tool_calls=False), "r")) == 1
    with pytest.raises(ForgeError) as info:
        plan_tool_calls(body(tool_choice={"type": "function", "function": {"name": "nope"}}), "r")
    assert info.value.status == 400


@pytest.fixture
async def client():
    config = load_config(
        {
            "tenants": [{"name": "agent", "key_hashes": [hash_key(KEY)]}],
            "pools": [{"model": "m", "engine": {"prefill_base_s": 0, "decode_base_s": 0}}],
        }
    )
    gateway = build_local_gateway(config)
    async with gateway.lifespan():
        transport = httpx.ASGITransport(gateway.asgi_app())
        http = httpx.AsyncClient(transport=transport, base_url="http://forge.test/v1")
        async with openai.AsyncOpenAI(
            base_url="http://forge.test/v1", api_key=KEY, http_client=http
        ) as c:
            yield c


async def test_the_official_client_gets_one_complete_call_streamed_or_not(client):
    response = await client.chat.completions.create(**body())
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    assert response.usage.completion_tokens > 1

    stream = await client.chat.completions.create(
        **body(), stream=True, stream_options={"include_usage": True}
    )
    streamed = assemble([chunk async for chunk in stream])
    assert streamed.finish == "tool_calls"
    assert streamed.deltas > 1  # streamed piece by piece, as vLLM does
    (only,) = streamed.calls.values()
    assert only["id"].startswith("call_") and only["name"] == call.function.name
    assert json.loads(only["arguments"]) == json.loads(call.function.arguments)
    assert streamed.usage.completion_tokens == response.usage.completion_tokens


async def test_a_parallel_tool_call_is_two_calls_in_one_message_streamed_or_not(client):
    both = [{"role": "user", "content": "get service status, then open ticket for checkout"}]
    response = await client.chat.completions.create(**body(both))
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_service_status", "open_ticket"]
    assert len({c.id for c in message.tool_calls}) == 2
    for call in message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))

    stream = await client.chat.completions.create(**body(both), stream=True)
    streamed = assemble([chunk async for chunk in stream])
    assert sorted(streamed.calls) == [0, 1]
    assert [streamed.calls[i]["name"] for i in (0, 1)] == ["get_service_status", "open_ticket"]
    for i, call in enumerate(message.tool_calls):
        assert json.loads(streamed.calls[i]["arguments"]) == json.loads(call.function.arguments)


async def test_a_named_tools_call_finishes_with_stop_as_vllms_does(client):
    """vLLM (as OpenAI) says ``tool_calls`` for a call the model chose and ``stop`` for one
    ``tool_choice`` named."""
    named = {"type": "function", "function": {"name": "open_ticket"}}
    response = await client.chat.completions.create(**body(tool_choice=named))
    stream = await client.chat.completions.create(**body(tool_choice=named), stream=True)
    streamed = assemble([chunk async for chunk in stream])
    assert response.choices[0].finish_reason == streamed.finish == "stop"
    assert [c.function.name for c in response.choices[0].message.tool_calls] == ["open_ticket"]
    assert [c["name"] for c in streamed.calls.values()] == ["open_ticket"]


async def test_a_prefill_is_continued_and_both_flags_are_refused(client):
    """vLLM's ``continue_final_message``: the last message is left open (no new turn after
    it), which ``add_generation_prompt`` (on by default) must not contradict."""
    said = [*ASK, {"role": "assistant", "content": "Checkout is"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    opened = await client.chat.completions.create(model="m", messages=said, extra_body=flags)
    closed = await client.chat.completions.create(model="m", messages=said)
    # The open prompt lacks the last turn's end and the new turn's start.
    assert opened.usage.prompt_tokens < closed.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="m", messages=said, extra_body={"continue_final_message": True}
        )
    assert "add_generation_prompt" in refused.value.message


TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "priority": {"type": "integer"},
        "urgent": {"type": "boolean"},
        "labels": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "priority", "urgent", "labels"],
}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA}},
    ],
)
async def test_json_mode_through_the_official_client_streamed_or_not(client, response_format):
    ask = {
        "model": "m",
        "messages": [{"role": "user", "content": "A ticket for the checkout outage, as JSON."}],
        "response_format": response_format,
        "max_tokens": 400,
    }
    plain = await client.chat.completions.create(**ask)
    stream = await client.chat.completions.create(**ask, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    for answer in (plain.choices[0].message.content, text):
        parsed = json.loads(answer)
        assert isinstance(parsed, dict)
        if response_format["type"] == "json_schema":
            jsonschema.validate(parsed, TICKET_SCHEMA)
    assert json.loads(text) == json.loads(plain.choices[0].message.content)  # deterministic


async def test_the_clients_structured_output_helper_parses_into_a_pydantic_model(client):
    """``chat.completions.parse``: the client sends the model's strict JSON schema and parses
    the answer back into it (an answer off the schema would raise here)."""

    class Ticket(pydantic.BaseModel):
        title: str
        priority: int
        urgent: bool
        labels: list[str]

    completion = await client.chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": "A ticket for the checkout outage."}],
        response_format=Ticket,
        max_tokens=400,
    )
    ticket = completion.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and ticket.title


class Address(pydantic.BaseModel):
    city: str
    zip: int = pydantic.Field(ge=1000)


class Order(pydantic.BaseModel):
    """What pydantic makes of a nested model, an Optional, a list, a date and a Literal:
    ``$ref`` into ``$defs``, ``anyOf`` with null, ``format``, ``enum``."""

    address: Address
    quantity: int | None
    placed: dt.datetime
    lines: list[Address] = pydantic.Field(min_length=1)
    kind: Literal["retail", "bulk"]


class Count(pydantic.BaseModel):  # no string anywhere for the words to go in
    n: int
    ok: bool | None


@pytest.mark.parametrize("model", [Order, Count])
async def test_the_structured_output_helpers_parse_pydantics_nested_schemas(client, model):
    ask = [{"role": "user", "content": "The order for Paris, please."}]
    completion = await client.chat.completions.parse(
        model="m", messages=ask, response_format=model, max_tokens=400
    )
    assert isinstance(completion.choices[0].message.parsed, model)
    async with client.chat.completions.stream(
        model="m", messages=ask, response_format=model, max_tokens=400
    ) as stream:
        final = await stream.get_final_completion()
    assert final.choices[0].message.parsed == completion.choices[0].message.parsed


def test_a_tools_arguments_validate_against_pydantics_nested_schema():
    """What the OpenAI Agents SDK and pydantic-ai send for ``def ship(order: Order)``."""
    parameters = pydantic.TypeAdapter(Order).json_schema()
    tool = {"type": "function", "function": {"name": "ship", "parameters": parameters}}
    ask = [{"role": "user", "content": "ship it to Paris"}]
    [call] = plan_tool_calls(body(ask, tools=[tool], tool_choice="required"), "r")
    order = Order.model_validate_json(call.arguments)
    assert order.address.city == "Paris" and order.quantity is not None
    jsonschema.validate(json.loads(call.arguments), parameters)


async def test_max_tokens_cuts_the_arguments_as_a_real_model_would(client):
    response = await client.chat.completions.create(**body(max_tokens=2))
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.choices[0].message.tool_calls[0].function.arguments)


async def test_tools_are_part_of_the_prompt_the_tenant_pays_for():
    engine = SimulatedEngine("m", SimulatedEngineConfig(prefill_base_s=0, decode_base_s=0), 64)
    plain = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    _, without = await engine.complete(plain, "chat", "a")
    _, with_tools = await engine.complete(plain | {"tools": TOOLS}, "chat", "b")
    assert with_tools.prompt_tokens > without.prompt_tokens
    await engine.shutdown()
