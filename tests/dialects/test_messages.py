"""``/v1/messages`` as the official ``anthropic`` client sees it: plain, streamed, a tool round
trip, token counting, the key in ``x-api-key``, and every error in Anthropic's shape."""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest
from pydantic import BaseModel

from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from tests.dialects.conftest import ASK, STATUS_SCHEMA, anthropic_client, http
from tests.gateway import test_server
from tests.gateway.test_server import CAPPED_KEY, KEY, MODEL

ASKED = [{"role": "user", "content": "Tell me more"}]
TOOL = {
    "name": "get_service_status",
    "description": "A service's status",
    "input_schema": STATUS_SCHEMA,
}


async def test_a_plain_message_and_its_usage(claude, oai):
    message = await claude.messages.create(
        model=MODEL, max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    chat = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    # Anthropic counts cache reads apart from input_tokens; together they are the prompt.
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert 0 < usage.output_tokens <= 6


async def test_a_streams_message_start_counts_the_prompt_for_a_tenant_without_budgets(claude):
    """Clients show the context used from ``message_start`` before the answer ends (the
    tenant here has no token budget, which the gateway would have counted the prompt for)."""
    async with claude.messages.stream(model=MODEL, max_tokens=4, messages=ASKED) as stream:
        started = [e.message.usage async for e in stream if e.type == "message_start"]
        final = (await stream.get_final_message()).usage
    (start,) = started
    assert start.input_tokens > 0
    assert start.input_tokens == final.input_tokens + final.cache_read_input_tokens


async def test_claude_codes_request_as_it_sends_it_is_served(gateway: Gateway):
    """The shape of Claude Code 2.1.332's requests, as captured from it by a recording server
    (the texts here are stand-ins): a system message after the user's (a 400 before), 32,000
    max_tokens (past the model's window), adaptive thinking with its display omitted, context
    management and effort, its billing header line, cache_control, beta headers."""
    block = {"type": "text", "text": "Skills: none", "cache_control": {"type": "ephemeral"}}
    body = {
        "model": MODEL,
        "max_tokens": 32_000,
        "stream": True,
        "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=1f;"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>today</system-reminder>"},
                    {"type": "text", "text": "Say hello"},
                ],
            },
            {"role": "system", "content": [block]},
        ],
        "tools": [
            {
                "name": "Bash",
                "description": "Run a shell command.",
                "input_schema": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
            }
        ],
    }
    headers = {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
        "context-management-2025-06-27,effort-2025-11-24",
    }
    async with http(gateway) as client:
        answer = await client.post("/v1/messages?beta=true", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.text.rstrip().endswith('data: {"type":"message_stop"}')


async def test_claude_codes_max_tokens_past_the_models_window_is_served(claude):
    """Claude Code asks for 32,000 tokens and more, sized for Claude; the pool's model has an
    8,192-token window (vLLM refuses a max_tokens past it). The answer comes, within it."""
    async with claude.messages.stream(model=MODEL, max_tokens=32_000, messages=ASKED) as stream:
        message = await stream.get_final_message()
    assert message.content[0].text and message.stop_reason in ("end_turn", "max_tokens")


async def test_max_tokens_that_cut_the_answer_say_so(claude):
    message = await claude.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Tell me more"}]
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 1


async def test_a_stop_sequence_that_ended_the_answer_is_named_streamed_or_not(claude):
    plain = await claude.messages.create(model=MODEL, max_tokens=40, messages=ASKED)
    word = plain.content[0].text.split(" ")[4]  # a word the model says mid-answer
    stops = ["never-said", f" {word}"]
    message = await claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASKED, stop_sequences=stops
    )
    async with claude.messages.stream(
        model=MODEL, max_tokens=40, messages=ASKED, stop_sequences=stops
    ) as stream:
        streamed = await stream.get_final_message()
    for answer in (message, streamed):
        assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", f" {word}")
        assert f" {word}" not in answer.content[0].text
    # An answer that ended on its own says so, with no stop sequence.
    ended = await claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASKED, stop_sequences=["never-said"]
    )
    assert ended.stop_reason in ("end_turn", "max_tokens") and ended.stop_sequence is None


async def test_a_streamed_tool_round_trip(claude):
    ask = [{"role": "user", "content": ASK}]
    async with claude.messages.stream(
        model=MODEL, max_tokens=64, messages=ask, tools=[TOOL]
    ) as stream:
        kinds = [event.type async for event in stream]
        first = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds and "message_delta" in kinds
    (call,) = first.content
    assert call.type == "tool_use" and call.input == {"service": "checkout"}
    assert first.stop_reason == "tool_use"
    follow = [
        *ask,
        {"role": "assistant", "content": [c.model_dump() for c in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "up"}],
        },
    ]
    async with claude.messages.stream(
        model=MODEL, max_tokens=16, messages=follow, tools=[TOOL]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        answer = await stream.get_final_message()
    assert text and answer.content[0].text == text
    assert answer.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "none"}])
async def test_a_tool_choice_without_tools_is_served(claude, choice):
    """vLLM refuses a tool_choice without tools; auto and none ask for nothing without them."""
    ask = [{"role": "user", "content": "Hello"}]
    message = await claude.messages.create(
        model=MODEL, max_tokens=2, messages=ask, tool_choice=choice
    )
    assert message.content[0].text


async def test_tool_choice_any_and_no_parallel_calls(claude):
    ticket = {"name": "open_ticket", "input_schema": {"type": "object", "properties": {}}}
    ask = [{"role": "user", "content": "Check the service status and open a ticket"}]
    both = await claude.messages.create(
        model=MODEL, max_tokens=64, messages=ask, tools=[TOOL, ticket]
    )
    one = await claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=ask,
        tools=[TOOL, ticket],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    named = await claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "Hello"}],
        tools=[TOOL, ticket],
        tool_choice={"type": "tool", "name": "open_ticket"},
    )
    assert [b.name for b in both.content] == ["get_service_status", "open_ticket"]
    assert [b.name for b in one.content] == ["get_service_status"]
    assert [b.name for b in named.content] == ["open_ticket"]


async def test_a_call_of_a_named_tool_is_tool_use_streamed_or_not(claude):
    """vLLM (as OpenAI) finishes a named tool's call with ``stop``; an agent loop reads
    ``end_turn`` as "do not run the calls"."""
    ask = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hello"}],
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": TOOL["name"]},
    }
    message = await claude.messages.create(**ask)
    async with claude.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    for answer in (message, streamed):
        assert [block.type for block in answer.content] == ["tool_use"]
        assert answer.stop_reason == "tool_use"


async def test_a_tool_results_images_reach_the_model(claude):
    """A tool that returns a screenshot: its image goes with the result, never dropped."""
    ask = [{"role": "user", "content": ASK}]
    first = await claude.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=[TOOL])
    (call,) = first.content
    image = {"type": "image", "source": {"type": "url", "url": "https://example.test/s.png"}}

    def result(*content: dict) -> list[dict]:
        block = {"type": "tool_result", "tool_use_id": call.id, "content": list(content)}
        turn = {"role": "assistant", "content": [c.model_dump() for c in first.content]}
        return [*ask, turn, {"role": "user", "content": [block]}]

    text = {"type": "text", "text": "the dashboard:"}
    alone = await claude.messages.count_tokens(model=MODEL, messages=result(text), tools=[TOOL])
    pictured = await claude.messages.count_tokens(
        model=MODEL, messages=result(text, image), tools=[TOOL]
    )
    answer = await claude.messages.create(
        model=MODEL, max_tokens=8, messages=result(text, image), tools=[TOOL]
    )
    assert pictured.input_tokens > alone.input_tokens  # the image is in the prompt
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == (
        pictured.input_tokens
    )
    unknown = {"type": "search_result", "source": "s", "title": "t", "content": []}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(
            model=MODEL, max_tokens=8, messages=result(text, unknown), tools=[TOOL]
        )
    assert "messages.2.content.0.content.1.type" in refused.value.message


async def test_a_text_document_is_read_and_a_pdf_refused(claude):
    """A document the model here can read becomes text (title and context first), in a
    message or a tool result; a PDF needs Anthropic's reader: a 400 naming it, never dropped."""
    words = " ".join(f"w{i}" for i in range(50))
    plain = {"type": "text", "media_type": "text/plain", "data": words}
    blocks = [{"type": "text", "text": s} for s in (words, "more")]
    ask = [{"type": "text", "text": "Summarise"}]

    async def counted(*content: dict) -> int:
        turn = [{"role": "user", "content": [*ask, *content]}]
        return (await claude.messages.count_tokens(model=MODEL, messages=turn)).input_tokens

    alone = await counted()
    as_text = await counted({"type": "document", "source": plain})
    titled = await counted({"type": "document", "source": plain, "title": "Minutes"})
    as_blocks = await counted(
        {"type": "document", "source": {"type": "content", "content": blocks}}
    )
    assert as_text >= alone + 50 and titled > as_text and as_blocks > as_text
    answer = await claude.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=[{"role": "user", "content": [*ask, {"type": "document", "source": plain}]}],
    )
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == as_text
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        await counted({"type": "document", "source": pdf})
    assert "messages.0.content.1.source" in refused.value.message


async def test_structured_outputs_parse_into_the_clients_model(claude):
    class Status(BaseModel):
        service: str
        healthy: bool

    parsed = await claude.messages.parse(
        model=MODEL, max_tokens=64, messages=ASKED, output_format=Status
    )
    assert isinstance(parsed.parsed_output, Status)
    assert parsed.stop_reason == "end_turn"


async def test_a_prefill_is_continued_not_answered_anew(claude):
    """The last assistant turn's text is the start of the answer: the prompt ends with it,
    open, where a closed turn would be followed by a new assistant turn."""
    prefill = [*ASKED, {"role": "assistant", "content": "The status is"}]
    closed = [*ASKED, {"role": "assistant", "content": "The status is"}, *ASKED]
    open_count = await claude.messages.count_tokens(model=MODEL, messages=prefill)
    closed_count = await claude.messages.count_tokens(model=MODEL, messages=closed)
    asked_count = await claude.messages.count_tokens(model=MODEL, messages=ASKED)
    message = await claude.messages.create(model=MODEL, max_tokens=8, messages=prefill)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == open_count.input_tokens
    # Asked once more, the closed turn costs its end and a new turn's start; the open one not.
    assert open_count.input_tokens < closed_count.input_tokens - asked_count.input_tokens
    assert message.content[0].text and message.stop_reason in ("end_turn", "max_tokens")


async def test_the_sdk_reads_the_request_id(claude):
    raw = await claude.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=ASKED)
    message = await raw.parse()
    assert message._request_id == raw.headers["x-request-id"]


async def test_count_tokens_is_what_the_budgets_reserve(claude):
    ask = [{"role": "user", "content": "Hello, Forge"}]
    counted = await claude.messages.count_tokens(model=MODEL, messages=ask, system="Be brief.")
    message = await claude.messages.create(
        model=MODEL, max_tokens=2, messages=ask, system="Be brief."
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens


async def test_a_bearer_key_works_as_well_as_x_api_key(gateway: Gateway):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with http(gateway) as client:
        bearer = await client.post(
            "/v1/messages", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
        api_key = await client.post("/v1/messages", json=body, headers={"x-api-key": KEY})
        wrong = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
    assert bearer.status_code == api_key.status_code == 200
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            404,
            "not_found_error",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "document"}]}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "mcp_servers": [{"type": "url", "url": "https://mcp.test", "name": "m"}],
            },
            400,
            "invalid_request_error",
        ),
        *[  # malformed blocks: a 400 naming the field, never a 500 (which the SDK retries)
            (
                {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [b]}]},
                400,
                "invalid_request_error",
            )
            for b in (
                {"type": "image", "source": "https://images.test/cat.png"},
                {"type": "image", "source": ["base64"]},
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
                {"type": "text"},
            )
        ],
        *[  # a system block that is not text is refused, not dropped unseen
            (
                {
                    "model": MODEL,
                    "max_tokens": 2,
                    "system": [block],
                    "messages": [{"role": "user", "content": "x"}],
                },
                400,
                "invalid_request_error",
            )
            for block in ({"type": "image", "source": {"type": "url", "url": "u"}}, {})
        ],
    ],
)
async def test_errors_are_in_anthropics_shape(gateway: Gateway, body, status, kind):
    async with http(gateway) as client:
        answer = await client.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert answer.status_code == status, answer.text
    payload = answer.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert payload["error"]["message"] and payload["request_id"] == answer.headers["x-request-id"]


async def test_what_the_pipeline_never_reads_is_refused_in_anthropics_shape_too(
    gateway: Gateway, claude
):
    """A body over the limit, a path or method not served, an unknown model to count for:
    each in Anthropic's shape and of the status the SDK maps to its own exception."""
    big = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * 9999}]}
    async with http(gateway) as client:
        answers = [
            await client.post("/v1/messages", json=big, headers={"x-api-key": KEY}),
            await client.post("/v1/messages/batches", json={}, headers={"x-api-key": KEY}),
            await client.get("/v1/messages", headers={"x-api-key": KEY}),
        ]
    assert [a.status_code for a in answers] == [413, 404, 405]
    kinds = [a.json()["error"]["type"] for a in answers]
    assert kinds == ["request_too_large", "not_found_error", "invalid_request_error"]
    assert all(a.json()["type"] == "error" for a in answers)
    assert answers[0].headers["request-id"]  # the pipeline refused it: the SDK reads its id
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.count_tokens(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )


async def test_the_sdk_raises_what_it_would_against_anthropic(gateway: Gateway):
    async with anthropic_client(gateway, "sk-wrong") as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
    async with anthropic_client(gateway, CAPPED_KEY) as capped:
        for _ in range(2):
            await capped.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
        with pytest.raises(anthropic.RateLimitError) as shed:
            await capped.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
    assert int(shed.value.response.headers["retry-after"]) >= 1


async def test_failing_replicas_fail_the_message_over_to_the_fallback(gateway: Gateway, claude):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    raw = await claude.messages.with_raw_response.create(
        model=MODEL, max_tokens=32, messages=[{"role": "user", "content": ASK}], tools=[TOOL]
    )
    assert raw.headers["x-forge-backend"] == "fallback"
    message = await raw.parse()
    assert message.content and message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The fallback, an OpenAI-compatible API, does not say which stop string ended an answer.
    said = (await claude.messages.create(model=MODEL, max_tokens=40, messages=ASKED)).content
    stop = " " + said[0].text.split(" ")[4]
    cut = await claude.messages.create(
        model=MODEL, max_tokens=40, messages=ASKED, stop_sequences=[stop]
    )
    assert stop not in cut.content[0].text
    assert (cut.stop_reason, cut.stop_sequence) == ("end_turn", None)


async def test_a_stream_that_breaks_after_its_first_byte_ends_with_an_error_event(
    gateway: Gateway, claude
):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "die_mid_stream", "after_frames": 6, "exit_process": False})
    with pytest.raises(anthropic.APIStatusError) as failed:
        async with claude.messages.stream(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "Hello"}]
        ) as stream:
            async for _ in stream:
                pass
    assert failed.value.body["error"]["type"] == "api_error"


async def test_a_stream_longer_than_the_sdks_timeout_is_not_cut_while_it_flows(monkeypatch):
    """The SDK sends a call's timeout (``x-stainless-timeout``), and for a stream it is httpx's
    read timeout: the longest wait between two chunks. Forge took it as the stream's total
    deadline and cut a steadily streamed answer at 0.5 s with an error event."""
    monkeypatch.setenv(test_server.KEY_ENV, test_server.UPSTREAM_KEY)
    args = test_server.forge_args()
    # 300 tokens of 5 ms each: 1.5 s in all, never more than 5 ms between two of them.
    args["pools"][0]["engine"] = {
        **test_server.FAST,
        "decode_base_s": 0.005,
        "output_tokens_min": 300,
        "output_tokens_max": 300,
    }
    slow = build_local_gateway(load_config(args), fallback_transport=test_server.upstream())
    async with slow.lifespan(), anthropic_client(slow) as claude:
        started = time.perf_counter()
        async with claude.messages.stream(
            model=MODEL,
            max_tokens=300,
            messages=[{"role": "user", "content": ASK}],
            timeout=0.5,  # a client-wide timeout is sent as "NOT_GIVEN" (2.17), read as none
        ) as stream:
            message = await stream.get_final_message()
        took = time.perf_counter() - started
    assert took > 0.5
    assert message.stop_reason in ("end_turn", "max_tokens"), message
    assert message.usage.output_tokens == 300


async def test_counting_tokens_has_a_budget_of_its_own(gateway: Gateway):
    """Counting generates nothing, so it takes nothing from the tenant's budgets; unlimited, a
    tenant's megabyte bodies, tokenized on the event loop every tenant shares, slowed every
    other tenant's requests (4 ms to 165 ms p50). It counts at its requests/min, apart."""
    from tests.dialects.conftest import openai_client

    said = [{"role": "user", "content": "hi"}]
    async with (
        anthropic_client(gateway, CAPPED_KEY) as capped,
        openai_client(gateway, CAPPED_KEY) as capped_oai,
    ):
        for _ in range(2):  # the capped tenant's burst: 2 requests
            await capped.messages.count_tokens(model=MODEL, messages=said)
        with pytest.raises(anthropic.RateLimitError) as refused:
            await capped.messages.count_tokens(model=MODEL, messages=said)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["type"] == "error"  # Anthropic's shape
        # The Responses route's counting shares it...
        with pytest.raises(openai.RateLimitError):
            await capped_oai.responses.input_tokens.count(model=MODEL, input="hi")
        # ...and the tenant's own requests budget is whole.
        answer = await capped_oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=said, max_tokens=2
        )
        assert answer.headers["x-ratelimit-remaining-requests"] == "1"
