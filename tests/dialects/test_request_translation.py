"""What the dialects send the model, where a simulated model's answer cannot show it: the
roles and text a chat template sees, and the sampling fields vLLM applies."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.dialects.messages import MessagesDialect
from serve_app.dialects.responses import ResponsesDialect, ResponsesRequest, Turn
from tests.dialects.test_stream_translation import NoStore


def ctx(api: str = "messages") -> SimpleNamespace:
    return SimpleNamespace(api=api, tenant_name="t", turn=None)


async def test_a_developer_message_is_a_system_message():
    """A chat template without a developer role (Qwen2.5's, Llama's) would leave it out."""
    body = {
        "model": "m",
        "input": [
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": "Hi"},
        ],
    }
    chat = await ResponsesDialect(None).to_chat(body, ctx("responses"))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


async def test_text_blocks_are_joined_as_vllm_joins_text_parts():
    """Coding agents send their system prompt and turns as several blocks: not run together."""
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": [
            {"type": "text", "text": "You are a CLI."},
            {"type": "text", "text": "Be brief."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<reminder>ctx</reminder>"},
                    {"type": "text", "text": "look at main.py"},
                ],
            }
        ],
    }
    chat = await MessagesDialect().to_chat(body, ctx())
    assert [m["content"] for m in chat["messages"]] == [
        "You are a CLI.\nBe brief.",
        "<reminder>ctx</reminder>\nlook at main.py",
    ]


async def test_top_k_and_a_prefill_reach_vllm():
    body = {
        "model": "m",
        "max_tokens": 4,
        "top_k": 5,
        "messages": [
            {"role": "user", "content": "JSON please"},
            {"role": "assistant", "content": "{"},
        ],
    }
    chat = await MessagesDialect().to_chat(body, ctx())
    assert chat["top_k"] == 5
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    # A turn that ends with the assistant's tool call is not a prefill.
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    body["messages"][-1] = {"role": "assistant", "content": [call]}
    assert "continue_final_message" not in await MessagesDialect().to_chat(body, ctx())


async def test_a_call_without_an_id_gets_one_the_follow_up_can_name():
    store = NoStore()
    request = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    turn = Turn("resp_1", request, {}, [{"role": "user", "content": "x"}], "t")
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}  # no id
    answer = {
        "choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    _, response = await ResponsesDialect(store)._json(turn, 200, answer)
    (item,) = response["output"]
    (kept,) = store.record["messages"][-1]["tool_calls"]
    assert item["call_id"].startswith("call_") and kept["id"] == item["call_id"]


async def test_consecutive_turns_of_one_role_are_one_turn_as_anthropic_combines_them():
    """A template that insists on alternating roles (Gemma's, Mistral's) refuses two user
    messages in a row; Anthropic's API takes them and combines them."""
    image = {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}}
    call = {"type": "tool_use", "id": "call_1", "name": "look", "input": {}}
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "<reminder>ctx</reminder>"},
            {"role": "user", "content": [image, {"type": "text", "text": "look at this"}]},
            {"role": "assistant", "content": "Looking."},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "ok"}],
            },
            {"role": "user", "content": "and?"},
        ],
    }
    chat = await MessagesDialect().to_chat(body, ctx())
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "user"]
    first, said, _, last = chat["messages"]
    assert first["content"] == [
        {"type": "text", "text": "<reminder>ctx</reminder>"},
        {"type": "image_url", "image_url": {"url": "https://example.test/a.png"}},
        {"type": "text", "text": "look at this"},
    ]
    assert said["content"] == "Looking." and [c["id"] for c in said["tool_calls"]] == ["call_1"]
    assert last["content"] == "and?"


async def test_a_mid_conversation_system_message_is_the_users_turn_where_it_stands():
    """Claude Code (2.1.154 on) sends system messages inside ``messages``. Many templates
    refuse a system message past the first (Qwen3.5's, Mistral's, Gemma's), and folding it
    into the first would change the prompt's start, which vLLM's prefix cache keys on."""
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": "You are a CLI.",
        "messages": [
            {"role": "user", "content": "look at main.py"},
            {"role": "system", "content": [{"type": "text", "text": "Skills: review"}]},
            {"role": "assistant", "content": "Looking."},
            {"role": "user", "content": "and?"},
            {"role": "system", "content": "Be brief."},
        ],
    }
    chat = await MessagesDialect().to_chat(body, ctx())
    assert chat["messages"] == [
        {"role": "system", "content": "You are a CLI."},
        {"role": "user", "content": "look at main.py\nSkills: review"},
        {"role": "assistant", "content": "Looking."},
        {"role": "user", "content": "and?\nBe brief."},
    ]


async def test_instructions_and_leading_developer_messages_are_one_system_message():
    """Codex sends developer messages before and during the conversation; a template that
    takes one system message, first, refuses the rest. A later one is the user's, where it
    stands, one message with the user's next to it (Gemma's and Mistral's templates insist
    that roles alternate)."""
    body = {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"role": "developer", "content": "Sandbox: read-only."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "developer", "content": "Approval: never."},
            {"role": "user", "content": "Go"},
        ],
    }
    chat = await ResponsesDialect(None).to_chat(body, ctx("responses"))
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex.\nSandbox: read-only."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Approval: never.\nGo"},
    ]


async def test_reasoning_replayed_after_the_assistants_text_stays_in_its_turn():
    """Replays may put an assistant's text before its reasoning item: still one assistant
    message (two in a row would break a template whose roles alternate)."""
    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Check."}],
    }
    call = {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"}
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "I'll check."},
            thought,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    }
    chat = await ResponsesDialect(None).to_chat(body, ctx("responses"))
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    said = chat["messages"][1]
    assert (said["content"], said["reasoning"]) == ("I'll check.", "Check.")
    assert [c["id"] for c in said["tool_calls"]] == ["c1"]


async def test_a_reasoning_item_of_another_shape_is_read_as_no_reasoning():
    """Not a 500: a reasoning item whose content is not a list of parts says nothing."""
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "content": 5, "summary": "x", "encrypted_content": "opaque"},
            {"role": "assistant", "content": "Hello."},
        ],
    }
    chat = await ResponsesDialect(None).to_chat(body, ctx("responses"))
    assert chat["messages"][-1] == {"role": "assistant", "content": "Hello."}
