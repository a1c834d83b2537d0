"""A reasoning model behind every route, as each SDK sees it: vLLM's reasoning parser splits the
answer's reasoning off (``reasoning``; the simulated engine's ``reasoning_tokens``), chat
completions pass it on, Anthropic's Messages show it as thinking blocks when thinking is asked
for, and the Responses API as a reasoning item; sent back in a tool loop, it reaches the model's
template again, and never the fallback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import orjson
import pytest

from serve_app.config.models import load_config
from serve_app.dialects.messages import MessagesDialect
from serve_app.dialects.responses import ResponsesDialect
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from tests.dialects.conftest import ASK, STATUS_SCHEMA, anthropic_client, http, openai_client
from tests.gateway import test_server
from tests.gateway.test_server import KEY_ENV, MODEL, UPSTREAM_KEY

THOUGHT = 3  # tokens of reasoning before every answer
ASKED = [{"role": "user", "content": "Tell me more"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {"name": "get_service_status", "input_schema": STATUS_SCHEMA}
FUNCTION = {"type": "function", "name": "get_service_status", "parameters": STATUS_SCHEMA}


@pytest.fixture
async def gateway(monkeypatch) -> AsyncIterator[Gateway]:
    """This module's gateway (the conftest's ``oai`` and ``claude`` reach it): one pool of a
    reasoning model."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    args = test_server.forge_args()
    engine = {**test_server.FAST, "output_tokens_min": 8, "output_tokens_max": 12}
    args["pools"][0]["engine"] = engine | {"reasoning_tokens": THOUGHT}
    gateway = build_local_gateway(load_config(args), fallback_transport=test_server.upstream())
    async with gateway.lifespan():
        yield gateway


async def chat_answer(oai: openai.AsyncOpenAI, **extra) -> tuple[str, str, object]:
    """The chat route's reasoning, text and usage for ``ASKED``: what the others must match."""
    answer = await oai.chat.completions.create(model=MODEL, messages=ASKED, max_tokens=40, **extra)
    message = answer.choices[0].message
    return (message.model_extra or {}).get("reasoning") or "", message.content or "", answer.usage


# -- chat completions: vLLM's own fields, passed on ------------------------------------------


async def test_chat_carries_the_reasoning_apart_from_the_answer_and_counts_it(oai):
    reasoning, text, usage = await chat_answer(oai)
    assert len(reasoning.split()) == THOUGHT and text
    assert usage.completion_tokens_details.reasoning_tokens == THOUGHT
    assert usage.completion_tokens == THOUGHT + len(text.split())
    # Streamed: the reasoning's deltas come first, then the answer's; the same words.
    stream = await oai.chat.completions.create(
        model=MODEL, messages=ASKED, max_tokens=40, stream=True
    )
    thought, said = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning"):
                assert not said, "reasoning after the answer began"
                thought.append(delta["reasoning"])
            if choice.delta.content:
                said.append(choice.delta.content)
    assert ("".join(thought), "".join(said)) == (reasoning, text)


async def test_thinking_turned_off_is_an_answer_without_reasoning(oai):
    reasoning, text, usage = await chat_answer(oai, extra_body=OFF)
    assert reasoning == "" and text
    assert usage.completion_tokens_details.reasoning_tokens == 0


# -- Anthropic's Messages: thinking blocks, when thinking is asked for ------------------------


async def test_thinking_asked_for_is_a_thinking_block_before_the_text(claude, oai):
    reasoning, text, _ = await chat_answer(oai)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    message = await claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASKED, thinking=thinking
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (reasoning, text)
    # Anthropic bills thinking as output.
    assert message.usage.output_tokens == THOUGHT + len(text.split())
    async with claude.messages.stream(
        model=MODEL, max_tokens=40, messages=ASKED, thinking=thinking
    ) as stream:
        kinds = [event.delta.type async for event in stream if event.type == "content_block_delta"]
        streamed = await stream.get_final_message()
    # Anthropic's order: the thinking, its signature, then the text.
    words = len(text.split())
    assert kinds == ["thinking_delta"] * THOUGHT + ["signature_delta"] + ["text_delta"] * words
    # Not empty: clients take an empty signature for a broken block (see the pydantic-ai test).
    assert message.content[0].signature and streamed.content[0].signature
    assert [b.to_dict() for b in streamed.content] == [b.to_dict() for b in message.content]


async def test_without_thinking_asked_for_the_model_is_told_not_to_think(claude, oai):
    _, text, _ = await chat_answer(oai, extra_body=OFF)
    message = await claude.messages.create(model=MODEL, max_tokens=40, messages=ASKED)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == text
    for off in ("disabled", "between_tools"):  # the latter: "thinking turned off" (the SDK)
        disabled = await claude.messages.create(
            model=MODEL, max_tokens=40, messages=ASKED, thinking={"type": off}
        )
        assert disabled.content == message.content


async def test_thinking_display_omitted_keeps_the_block_and_not_its_text(claude):
    thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    message = await claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASKED, extra_body={"thinking": thinking}
    )
    assert message.content[0].type == "thinking" and message.content[0].thinking == ""
    async with claude.messages.stream(
        model=MODEL, max_tokens=40, messages=ASKED, extra_body={"thinking": thinking}
    ) as stream:
        deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
    assert "thinking_delta" not in deltas and "text_delta" in deltas


async def test_an_unknown_thinking_type_is_a_400_naming_it(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        await claude.messages.create(
            model=MODEL, max_tokens=40, messages=ASKED, extra_body={"thinking": {"type": "on"}}
        )
    assert "thinking.type" in info.value.message


async def test_a_tool_loops_thinking_sent_back_reaches_the_template_and_an_old_ones_not(
    claude,
):
    """Claude Code sends the assistant's thinking blocks back with its tool results. Qwen3's
    template (and the simulated one) keeps the current turn's reasoning and leaves earlier
    turns' out: the prompt grows by the current turn's only."""
    thinking = {"type": "enabled", "budget_tokens": 1024}
    ask = [{"role": "user", "content": ASK}]
    first = await claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=ask,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": TOOL["name"]},
        thinking=thinking,
    )
    assert [b.type for b in first.content] == ["thinking", "tool_use"]  # it thinks, then calls
    thought, call = first.content
    said = [b.model_dump(exclude_none=True) for b in first.content]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "healthy"}

    async def prompt_tokens(assistant: list[dict], then: list[dict]) -> int:
        messages = [*ask, {"role": "assistant", "content": assistant}, *then]
        counted = await claude.messages.count_tokens(
            model=MODEL, messages=messages, tools=[TOOL], thinking=thinking
        )
        return counted.input_tokens

    plain = [b for b in said if b["type"] != "thinking"]
    in_loop = {"role": "user", "content": [result]}
    extra = await prompt_tokens(said, [in_loop]) - await prompt_tokens(plain, [in_loop])
    assert extra >= len(thought.thinking.split())  # the reasoning, and its template markers
    # Once the user speaks again, the earlier turn's reasoning is left out of the prompt.
    later = [in_loop, {"role": "assistant", "content": "It is healthy."}, *ASKED]
    assert await prompt_tokens(said, later) == await prompt_tokens(plain, later)


# -- OpenAI's Responses: a reasoning item ---------------------------------------------------


async def test_a_response_has_a_reasoning_item_before_its_message(gateway, oai):
    reasoning, text, _ = await chat_answer(oai)
    strict = openai_client(gateway, strict=True)
    async with strict:
        response = await strict.responses.create(model=MODEL, input=ASKED, max_output_tokens=40)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == reasoning
        assert response.output_text == text
        assert response.usage.output_tokens_details.reasoning_tokens == THOUGHT
        async with strict.responses.stream(
            model=MODEL, input=ASKED, max_output_tokens=40
        ) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
    deltas = [k for k in kinds if k.endswith(".delta")]
    assert deltas == ["response.reasoning_text.delta"] * THOUGHT + [
        "response.output_text.delta"
    ] * len(text.split())
    assert "response.reasoning_text.done" in kinds
    assert streamed.output[0].content[0].text == reasoning
    assert streamed.output_text == text


async def test_reasoning_effort_none_is_a_response_without_reasoning(oai):
    response = await oai.responses.create(
        model=MODEL, input=ASKED, max_output_tokens=40, reasoning={"effort": "none"}
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.reasoning.effort == "none"  # echoed, as OpenAI does


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_loop_replayed_by_items_keeps_the_models_reasoning(oai, stream):
    """The Agents SDK replays the output items (the reasoning item among them) as the next
    ``input``: the model's reasoning before its call is in the next prompt; without the item,
    it is not."""
    first = await oai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[FUNCTION],
        tool_choice={"type": "function", "name": FUNCTION["name"]},
        max_output_tokens=64,
        stream=stream,
    )
    if stream:
        async for event in first:
            if event.type == "response.completed":
                first = event.response
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    thought, call = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "healthy"}

    async def prompt_tokens(*replayed) -> int:
        answer = await oai.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": ASK}, *replayed, result],
            tools=[FUNCTION],
            max_output_tokens=4,
            store=False,
        )
        return answer.usage.input_tokens

    item = thought.model_dump(exclude_none=True)
    with_thought = await prompt_tokens(item, call.model_dump())
    without = await prompt_tokens(call.model_dump())
    assert with_thought - without >= len(thought.content[0].text.split())
    # LangChain replays a streamed item as its ``output_item.added`` (no text yet) and the
    # ``encrypted_content`` of its ``.done``: the same reasoning.
    sealed_only = {**item, "content": [], "status": "in_progress"}
    assert await prompt_tokens(sealed_only, call.model_dump()) == with_thought


async def test_a_stored_answers_reasoning_is_part_of_the_follow_ups_prompt(oai):
    """``previous_response_id`` within the turn (no user message since) keeps the reasoning the
    model gave, as replaying its items does."""
    first = await oai.responses.create(model=MODEL, input=ASKED, max_output_tokens=40)
    follow_up = [{"role": "assistant", "content": "And so?"}]
    by_id = await oai.responses.create(
        model=MODEL, previous_response_id=first.id, input=follow_up, max_output_tokens=4
    )
    replayed = [*ASKED, *(item.model_dump(exclude_none=True) for item in first.output)]
    by_items = await oai.responses.create(
        model=MODEL, input=[*replayed, *follow_up], max_output_tokens=4, store=False
    )
    dropped = [*ASKED, *(i.model_dump() for i in first.output if i.type != "reasoning")]
    without = await oai.responses.create(
        model=MODEL, input=[*dropped, *follow_up], max_output_tokens=4, store=False
    )
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert by_items.usage.input_tokens > without.usage.input_tokens


# -- the fallback: never another model's reasoning -----------------------------------------


async def test_the_fallback_is_sent_no_reasoning(gateway):
    sent: list[dict] = []
    fallback = gateway.backends["fallback"]
    original = fallback._upstream_body

    def recorded(body: dict, stream: bool) -> bytes:
        out = original(body, stream)
        sent.append(orjson.loads(out))
        return out

    fallback._upstream_body = recorded
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    history = [
        *ASKED,
        {"role": "assistant", "content": "Sure.", "reasoning": "They want more."},
        {"role": "user", "content": "Go on"},
    ]
    async with http(gateway) as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": history, "max_tokens": 8},
            headers={"authorization": f"Bearer {test_server.KEY}"},
        )
    assert answer.status_code == 200, answer.text
    assert sent and all(
        "reasoning" not in m and "reasoning_content" not in m for m in sent[-1]["messages"]
    )
    assert sent[-1]["messages"][1]["content"] == "Sure."


# -- agent libraries: the reasoning they send back is the model's ---------------------------


@pytest.fixture
def sent(monkeypatch) -> list[dict]:
    """The chat bodies the dialects made of the requests, in order."""
    bodies: list[dict] = []
    for dialect in (MessagesDialect, ResponsesDialect):
        translate = dialect.to_chat

        async def recorded(self, body, ctx, translate=translate):
            chat = await translate(self, body, ctx)
            bodies.append(chat)
            return chat

        monkeypatch.setattr(dialect, "to_chat", recorded)
    return bodies


def assistant_reasoning(chat: dict) -> list[str | None]:
    return [m.get("reasoning") for m in chat["messages"] if m["role"] == "assistant"]


def get_service_status(service: str) -> str:
    """The status of a service."""
    return f"{service}: degraded"


@pytest.mark.parametrize("stream", [False, True])
async def test_pydantic_ais_anthropic_agent_sends_its_thinking_back_as_thinking(
    gateway, sent, stream
):
    """pydantic-ai sends a thinking block with an empty signature back as the user's text
    (``<assistant_thinking>``): the model would read its own thoughts as the user's."""
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel, AnthropicModelSettings
    from pydantic_ai.providers.anthropic import AnthropicProvider

    client = anthropic_client(gateway)
    model = AnthropicModel(MODEL, provider=AnthropicProvider(anthropic_client=client))
    settings = AnthropicModelSettings(
        anthropic_thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=64
    )
    agent = Agent(model, model_settings=settings, tools=[get_service_status])
    if stream:
        async with agent.run_stream(ASK) as run:
            await run.get_output()
            messages = run.all_messages()
    else:
        messages = (await agent.run(ASK)).all_messages()
    called = [p.args_as_dict() for m in messages for p in m.parts if p.part_kind == "tool-call"]
    assert called == [{"service": "checkout"}]
    thought = next(p for m in messages for p in m.parts if p.part_kind == "thinking")
    follow_up = sent[1]
    assert assistant_reasoning(follow_up) == [thought.content]
    users = [m["content"] for m in follow_up["messages"] if m["role"] == "user"]
    assert not any("assistant_thinking" in str(content) for content in users)


async def test_langchains_streamed_responses_agent_sends_its_reasoning_back(gateway, sent):
    """LangChain keeps a streamed reasoning item as announced (no text yet) with the
    ``encrypted_content`` it is done with, and with ``store: false`` sends back only items that
    have one."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url="http://forge.test/v1",
        api_key=test_server.KEY,
        http_async_client=http(gateway),
        use_responses_api=True,
        streaming=True,
        store=False,
        max_retries=0,
    ).bind_tools([FUNCTION], tool_choice=FUNCTION["name"])
    ask = HumanMessage(ASK)
    said = None
    async for chunk in llm.astream([ask]):
        said = chunk if said is None else said + chunk
    (call,) = said.tool_calls
    result = ToolMessage("healthy", tool_call_id=call["id"])
    await llm.ainvoke([ask, said, result])
    _, follow_up = sent
    (reasoning,) = assistant_reasoning(follow_up)
    assert reasoning and len(reasoning.split()) == THOUGHT
