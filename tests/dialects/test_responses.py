"""``/v1/responses`` as the official ``openai`` client and the OpenAI Agents SDK see it: plain,
streamed, with function tools, structured output, stored conversations, and the pipeline's
budgets, failover and refusals on this route."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from tests.dialects.conftest import ASK, OTHER_KEY, STATUS_SCHEMA, http, openai_client
from tests.gateway import test_server
from tests.gateway.test_server import CAPPED_KEY, KEY, MODEL

TOOL = {"type": "function", "name": "get_service_status", "parameters": STATUS_SCHEMA}


async def test_a_plain_response_counts_the_prompt_as_the_same_chat_does(oai):
    response = await oai.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello, Forge", max_output_tokens=6
    )
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, Forge"},
        ],
        max_tokens=6,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert 0 < response.usage.output_tokens <= 6
    assert response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens
    )


async def test_max_output_tokens_that_cut_the_answer_make_it_incomplete(oai):
    response = await oai.responses.create(model=MODEL, input="Tell me more", max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_the_item_max_output_tokens_cut_is_incomplete(oai, stream):
    """A call cut mid-arguments says so: a client must not run ``{"service": "che``."""
    ask = {"model": MODEL, "input": ASK, "tools": [TOOL], "max_output_tokens": 4}
    if stream:  # the SDK's get_final_response wants response.completed: the last event's
        async with oai.responses.stream(**ask) as events:
            response = [e async for e in events][-1].response
    else:
        response = await oai.responses.create(**ask)
    (call,) = response.output
    assert response.status == call.status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_come_with_the_text_where_include_asks(gateway, stream):
    """They were always an empty list, whatever ``include`` said."""
    ask = {
        "model": MODEL,
        "input": "Hello, Forge",
        "max_output_tokens": 5,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    async with openai_client(gateway, strict=True) as oai:
        if stream:
            async with oai.responses.stream(**ask) as events:
                seen = [e async for e in events]
            deltas = [e for e in seen if e.type == "response.output_text.delta"]
            streamed = [entry for e in deltas for entry in e.logprobs]
            response = seen[-1].response
        else:
            response = await oai.responses.create(**ask)
        plain = await oai.responses.create(
            **{k: v for k, v in ask.items() if k != "include" and k != "top_logprobs"}
        )
    (part,) = response.output[-1].content
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    if stream:
        assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    assert plain.output[-1].content[0].logprobs == []


async def test_an_error_names_the_field_as_the_client_wrote_it(oai):
    """vLLM refuses the chat body's max_tokens; the client sent max_output_tokens."""
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.responses.create(model=MODEL, input="Hello", max_output_tokens=1_000_000)
    assert refused.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens=1000000" in refused.value.body["message"]


async def test_input_tokens_are_what_the_response_is_charged(oai):
    """``client.responses.input_tokens.count``: the prompt a create with the same body reads."""
    ask = {"model": MODEL, "input": ASK, "instructions": "Be brief.", "tools": [TOOL]}
    counted = await oai.responses.input_tokens.count(**ask)
    created = await oai.responses.create(**ask, max_output_tokens=4)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == created.usage.input_tokens > 0
    with pytest.raises(openai.NotFoundError):
        await oai.responses.input_tokens.count(model="nope", input="x")


async def test_a_text_setting_without_a_format_echoes_the_default_format(oai):
    response = await oai.responses.create(
        model=MODEL, input="Hello", text={"verbosity": "low"}, max_output_tokens=2
    )
    assert response.text.format.type == "text" and response.text.verbosity == "low"


async def test_parallel_calls_stream_one_item_after_the_other(oai):
    ticket = {"type": "function", "name": "open_ticket", "parameters": STATUS_SCHEMA}
    ask = "Check the service status and open a ticket"
    async with oai.responses.stream(model=MODEL, input=ask, tools=[TOOL, ticket]) as stream:
        told = [
            (e.type, e.output_index)
            async for e in stream
            if e.type.startswith("response.output_item.")
            or e.type.startswith("response.function_call_arguments.")
        ]
        final = await stream.get_final_response()
    first, second = [i for i, kind in enumerate(told) if kind[0] == "response.output_item.added"]
    assert {index for _, index in told[first:second]} == {0}  # item 0 done before 1 opens
    assert told[second - 1] == ("response.output_item.done", 0)
    assert [c.status for c in final.output] == ["completed", "completed"]


async def test_a_stream_is_the_event_sequence_the_client_assembles(oai):
    async with oai.responses.stream(model=MODEL, input="Hello", max_output_tokens=8) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    assert "response.output_text.delta" in kinds
    assert final.output_text and final.usage.output_tokens > 0
    sequence = [kind for kind in kinds if kind != "response.output_text.delta"]
    assert sequence[2:7] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


async def test_a_function_call_and_its_output_continue_by_previous_response_id(oai):
    first = await oai.responses.create(model=MODEL, input=ASK, tools=[TOOL])
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_service_status"
    assert json.loads(call.arguments) == {"service": "checkout"}
    follow = await oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "up"}],
        tools=[TOOL],
    )
    assert follow.previous_response_id == first.id
    assert follow.output_text  # the tool's result is in: the model answers
    # The follow-up's prompt is the whole conversation: more than the first one's.
    assert follow.usage.input_tokens > first.usage.input_tokens


async def test_a_function_outputs_images_reach_the_model(oai):
    """A tool that returns a screenshot (the Agents SDK's ``ToolOutputImage``): its image goes
    with the result, never dropped."""
    first = await oai.responses.create(model=MODEL, input=ASK, tools=[TOOL])
    (call,) = first.output

    async def follow_up(*output: dict):
        item = {"type": "function_call_output", "call_id": call.call_id, "output": list(output)}
        return await oai.responses.create(
            model=MODEL, previous_response_id=first.id, input=[item], tools=[TOOL]
        )

    text = {"type": "input_text", "text": "the dashboard:"}
    image = {"type": "input_image", "image_url": "https://example.test/s.png", "detail": "low"}
    alone = await follow_up(text)
    pictured = await follow_up(text, image)
    assert pictured.usage.input_tokens > alone.usage.input_tokens  # the image is in the prompt
    with pytest.raises(openai.BadRequestError) as refused:
        await follow_up(text, {"type": "input_file", "file_id": "file-1"})
    assert refused.value.body["param"] == "input.0.output.1.type"


async def test_what_clients_send_as_they_are_typed_is_served(oai):
    """Null where the SDK's types allow it, and an empty text part (LangChain sends an
    assistant's empty string as one)."""
    said = [
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]},
        {"role": "user", "content": "Tell me more"},
    ]
    response = await oai.responses.create(
        model=MODEL, input=said, store=None, stream=None, max_output_tokens=4
    )
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.store is True  # null is the default


async def test_a_strictly_validating_client_accepts_every_answer(gateway: Gateway):
    """The SDK's own types, held strictly (``_strict_response_validation``): every field it
    requires is there, plain and as a stream's final response."""
    strict = openai_client(gateway, strict=True)
    async with strict:
        plain = await strict.responses.create(model=MODEL, input=ASK, tools=[TOOL])
        async with strict.responses.stream(model=MODEL, input="Hi") as s:
            final = await s.get_final_response()
    assert plain.output[0].type == "function_call"
    assert plain.usage.input_tokens_details.cache_write_tokens == 0
    assert final.usage.output_tokens > 0


async def test_streamed_function_call_arguments_arrive_as_deltas(oai):
    async with oai.responses.stream(model=MODEL, input=ASK, tools=[TOOL]) as stream:
        deltas = [
            e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
        ]
        final = await stream.get_final_response()
    (call,) = final.output
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    assert json.loads(call.arguments) == {"service": "checkout"}


@pytest.mark.parametrize("choice", ["auto", "none"])
async def test_a_tool_choice_without_tools_is_served(oai, choice):
    """vLLM refuses a tool_choice without tools; OpenAI's API takes auto and none without."""
    response = await oai.responses.create(
        model=MODEL, input="Hello", tool_choice=choice, max_output_tokens=2
    )
    assert response.output_text and response.tool_choice == choice


async def test_parallel_calls_and_a_named_tool_choice(oai):
    ticket = {
        "type": "function",
        "name": "open_ticket",
        "parameters": {"type": "object", "properties": {"title": {"type": "string"}}},
    }
    both = await oai.responses.create(
        model=MODEL, input="Check the service status and open a ticket", tools=[TOOL, ticket]
    )
    one = await oai.responses.create(
        model=MODEL,
        input="Check the service status and open a ticket",
        tools=[TOOL, ticket],
        parallel_tool_calls=False,
    )
    named = await oai.responses.create(
        model=MODEL,
        input="Hello",
        tools=[TOOL, ticket],
        tool_choice={"type": "function", "name": "open_ticket"},
    )
    assert [c.name for c in both.output] == ["get_service_status", "open_ticket"]
    assert [c.name for c in one.output] == ["get_service_status"]
    assert [c.name for c in named.output] == ["open_ticket"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_namespaced_functions_call_names_its_namespace(gateway: Gateway, stream):
    """Codex (0.171) declares its sub-agent tools in a namespace; the client routes a call by
    its ``namespace``. Held to the SDK's types strictly."""
    namespace = {
        "type": "namespace",
        "name": "ops",
        "description": "Operations tools.",
        "tools": [TOOL],
    }
    strict = openai_client(gateway, strict=True)
    choice = {"type": "function", "name": TOOL["name"]}
    async with strict:
        if stream:
            async with strict.responses.stream(
                model=MODEL, input=ASK, tools=[namespace], tool_choice=choice
            ) as events:
                added = [e.item async for e in events if e.type == "response.output_item.added"]
                answer = await events.get_final_response()
            assert [item.namespace for item in added] == ["ops"]
        else:
            answer = await strict.responses.create(
                model=MODEL, input=ASK, tools=[namespace], tool_choice=choice
            )
    (call,) = answer.output
    assert (call.type, call.name, call.namespace) == ("function_call", TOOL["name"], "ops")
    assert json.loads(call.arguments) == {"service": "checkout"}


async def test_parse_validates_structured_output_against_the_model(oai):
    class Status(BaseModel):
        service: str
        healthy: bool

    parsed = await oai.responses.parse(model=MODEL, input="Status?", text_format=Status)
    assert isinstance(parsed.output_parsed, Status)
    assert parsed.text.format.type == "json_schema"


async def test_stored_responses_belong_to_their_tenant_and_can_be_deleted(gateway: Gateway, oai):
    kept = await oai.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    unkept = await oai.responses.create(
        model=MODEL, input="Hello", max_output_tokens=4, store=False
    )
    assert (await oai.responses.retrieve(kept.id)).output_text == kept.output_text
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(unkept.id)
    async with openai_client(gateway, OTHER_KEY) as other:
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError) as refused:
            await other.responses.create(model=MODEL, input="Hi", previous_response_id=kept.id)
    assert refused.value.code == "previous_response_not_found"
    await oai.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(kept.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
        ({"max_output_tokens": "16"}, "max_output_tokens"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
        (
            {"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]},
            "tools.0.tools.0.type",
        ),
        ({"tools": [TOOL, {"type": "namespace", "name": "n", "tools": [TOOL]}]}, "tools"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": ["x"]}]}, "tools.0.tools.0"),
        # OpenAI's bounds: stored for free, unbounded it evicted others' conversations.
        ({"metadata": {"k": "x" * 513}}, "metadata.k"),
        ({"metadata": {"k" * 65: "x"}}, "metadata." + "k" * 65),
        ({"metadata": {f"k{i}": "x" for i in range(17)}}, "metadata"),
    ],
)
async def test_what_cannot_be_served_is_a_400_naming_the_field(gateway: Gateway, extra, param):
    body = {"model": MODEL, "input": "Hello", **extra}
    async with http(gateway) as client:
        answer = await client.post(
            "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_a_wrong_key_is_a_401_on_every_responses_route(gateway: Gateway):
    async with openai_client(gateway, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.responses.create(model=MODEL, input="Hello")
        with pytest.raises(openai.AuthenticationError):
            await client.responses.retrieve("resp_x")


async def test_the_routes_share_a_tenants_request_budget(gateway: Gateway):
    async with openai_client(gateway, CAPPED_KEY) as capped:
        await capped.responses.create(model=MODEL, input="one", max_output_tokens=2)
        await capped.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "two"}], max_tokens=2
        )
        with pytest.raises(openai.RateLimitError) as shed:
            await capped.responses.create(model=MODEL, input="three", max_output_tokens=2)
    assert int(shed.value.response.headers["retry-after"]) >= 1


async def test_failing_replicas_fail_the_response_over_to_the_fallback(gateway: Gateway, oai):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    raw = await oai.responses.with_raw_response.create(
        model=MODEL, input=ASK, tools=[TOOL], max_output_tokens=32
    )
    assert raw.headers["x-forge-backend"] == "fallback"
    response = raw.parse()
    assert response.status in ("completed", "incomplete") and response.output


async def test_a_stream_that_breaks_after_its_first_byte_ends_as_response_failed(
    gateway: Gateway, oai
):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "die_mid_stream", "after_frames": 6, "exit_process": False})
    async with oai.responses.stream(model=MODEL, input="Hello", max_output_tokens=32) as stream:
        seen = [event async for event in stream]
    kinds = [event.type for event in seen]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.failed"
    assert "response.completed" not in kinds
    # A code the SDK's type knows; the gateway's own is the error's type.
    error = seen[-1].response.error
    assert error.code == "server_error" and error.type and error.message
    # What the client was already told stays in the failed response's output.
    said = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    (message,) = seen[-1].response.output
    assert said and message.content[0].text == said and message.status == "incomplete"


async def test_the_agents_sdk_runs_a_tool_using_agent_to_its_final_output(
    gateway: Gateway, monkeypatch
):
    """The Agents SDK with its defaults (the Responses API), plain and streamed."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # its exporter calls OpenAI
    from agents import Agent, Runner, function_tool, set_default_openai_client

    asked: list[str] = []

    @function_tool
    def get_service_status(service: str) -> str:
        """The status of a service."""
        asked.append(service)
        return f"{service} is up"

    set_default_openai_client(openai_client(gateway), use_for_tracing=False)
    agent = Agent(
        name="ops", instructions="Use the tools.", tools=[get_service_status], model=MODEL
    )
    result = await Runner.run(agent, ASK)
    streamed = Runner.run_streamed(agent, ASK)
    kinds = [event.type async for event in streamed.stream_events()]
    assert asked == ["checkout", "checkout"]
    assert isinstance(result.final_output, str) and result.final_output
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem",
        "ToolCallOutputItem",
        "MessageOutputItem",
    ]
    assert streamed.final_output and "raw_response_event" in kinds


async def test_truncation_auto_drops_the_oldest_turns_instead_of_a_400(monkeypatch):
    """A conversation past the pool's window: a 400 by default, as OpenAI's API answers it;
    with ``truncation: "auto"`` served from its latest turns, and echoed as asked."""
    args = test_server.forge_args()
    args["gateway"] = {"max_body_bytes": 1 << 20}
    args["pools"][0]["engine"] = {**test_server.FAST, "max_model_len": 512}
    monkeypatch.setenv(test_server.KEY_ENV, test_server.UPSTREAM_KEY)
    gateway = build_local_gateway(load_config(args), fallback_transport=test_server.upstream())
    words = " ".join(f"w{i}" for i in range(60))
    items = [
        {"role": role, "content": f"{role} {n} {words}"}
        for n in range(12)
        for role in ("user", "assistant")
    ] + [{"role": "user", "content": "And now?"}]
    async with gateway.lifespan(), openai_client(gateway) as oai:
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.responses.create(model=MODEL, input=items, max_output_tokens=8)
        fitted = await oai.responses.create(
            model=MODEL, input=items, max_output_tokens=8, truncation="auto"
        )
        follow = await oai.responses.create(
            model=MODEL,
            input="More?",
            previous_response_id=fitted.id,
            max_output_tokens=8,
            truncation="auto",
        )
    assert refused.value.body["code"] == "context_length_exceeded"
    assert refused.value.body["param"] == "input"
    assert fitted.status in ("completed", "incomplete") and fitted.truncation == "auto"
    assert fitted.usage.input_tokens <= 512 - 8 < 12 * 2 * 60
    assert follow.usage.input_tokens <= 512 - 8 and follow.output_text
