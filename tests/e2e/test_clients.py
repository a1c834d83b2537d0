"""The client matrix against the running graph (operations.md's table): each client streamed and
not, a tool call where the client has a tool API, and embeddings where it has an embeddings
API. The LangGraph ReAct agent is tests/e2e/test_agent.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from tests.e2e.conftest import tenant_key

MODEL = "forge-sim"
EMBED_MODEL = "forge-embed"  # the graph's embedding pool (tests/e2e/conftest.py)
EMBED_DIM = 256
ASK = [{"role": "user", "content": "What is the service status of checkout?"}]
STATUS_TOOL = {
    "type": "function",
    "function": {
        "name": "get_service_status",
        "parameters": {
            "type": "object",
            "properties": {"service": {"type": "string"}},
            "required": ["service"],
        },
    },
}
NODE_CLIENT = Path(__file__).with_name("clients") / "chat.cjs"
# Where .ci/run installs the openai npm package (npm install --prefix DIR openai).
NODE_PREFIX = Path(os.environ.get("FORGE_NODE_PREFIX", Path.home() / ".cache/forge/node"))

KEY = tenant_key("agents")  # a tenant no other test counts


def test_openai_sync(forge_url):
    with openai.OpenAI(base_url=f"{forge_url}/v1", api_key=KEY, max_retries=0) as client:
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8)
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, stream=True)
        )
        tool = client.chat.completions.create(model=MODEL, messages=ASK, tools=[STATUS_TOOL])
        vectors = client.embeddings.create(model=EMBED_MODEL, input=["checkout", "payments"])
    assert plain.choices[0].message.content
    assert [len(item.embedding) for item in vectors.data] == [EMBED_DIM, EMBED_DIM]
    assert vectors.usage.prompt_tokens == 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    call = tool.choices[0].message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"service": "checkout"}


async def test_openai_async(forge_url):
    async with openai.AsyncOpenAI(base_url=f"{forge_url}/v1", api_key=KEY, max_retries=0) as client:
        plain = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8)
        stream = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[STATUS_TOOL], stream=True
        )
        arguments = "".join(
            [
                d.function.arguments or ""
                async for chunk in stream
                for c in chunk.choices
                for d in c.delta.tool_calls or ()
            ]
        )
        vectors = await client.embeddings.create(
            model=EMBED_MODEL, input="checkout", encoding_format="float"
        )
    assert plain.choices[0].message.content
    assert json.loads(arguments) == {"service": "checkout"}
    assert len(vectors.data[0].embedding) == EMBED_DIM


def test_langchain_openai_embeddings(forge_url):
    """LangChain's embeddings client, as any non-OpenAI model needs it: sending text. (By
    default it cuts text into *OpenAI's* tiktoken ids, meaningless to another model, and
    fetches tiktoken's tables from the internet.)"""
    embeddings = OpenAIEmbeddings(
        base_url=f"{forge_url}/v1",
        api_key=KEY,
        model=EMBED_MODEL,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(["checkout is down", "payments are fine"])
    query = embeddings.embed_query("is checkout down?")
    assert [len(v) for v in documents] == [EMBED_DIM, EMBED_DIM]
    # The bag-of-tokens vectors rank the document sharing the query's words first.
    scores = [sum(a * b for a, b in zip(query, v, strict=True)) for v in documents]
    assert scores[0] > scores[1]


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_chat_openai_with_bound_tools(forge_url, stream):
    llm = ChatOpenAI(base_url=f"{forge_url}/v1", api_key=KEY, model=MODEL, max_retries=0)
    bound = llm.bind_tools([STATUS_TOOL])
    if stream:
        message = None
        for chunk in bound.stream(ASK):
            assert isinstance(chunk, AIMessageChunk)
            message = chunk if message is None else message + chunk
    else:
        message = bound.invoke(ASK)
    assert message.tool_calls[0]["name"] == "get_service_status"
    assert message.tool_calls[0]["args"] == {"service": "checkout"}


@pytest.mark.parametrize("stream", [False, True])
def test_raw_httpx(forge_url, stream):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "stream": stream}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=forge_url, headers=headers, timeout=30) as http:
        if not stream:
            answer = http.post("/v1/chat/completions", json=body).json()
            assert answer["choices"][0]["message"]["content"]
            return
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for line in lines[:-1]
    )
    assert text


def curl_post(forge_url: str, path: str, body: dict) -> str:
    """``curl -N`` (unbuffered: an SSE stream as it comes) of a JSON POST; its stdout."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    done = subprocess.run(
        [
            curl,
            "-sS",
            "-N",
            "--fail-with-body",
            f"{forge_url}{path}",
            "-H",
            f"Authorization: Bearer {KEY}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@pytest.mark.parametrize("stream", [False, True])
def test_curl(forge_url, stream):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "stream": stream}
    out = curl_post(forge_url, "/v1/chat/completions", body)
    if stream:
        assert out.rstrip().endswith("data: [DONE]")
    else:
        assert json.loads(out)["choices"][0]["message"]["content"]


def test_curl_embeddings(forge_url):
    out = curl_post(forge_url, "/v1/embeddings", {"model": EMBED_MODEL, "input": "checkout"})
    (item,) = json.loads(out)["data"]
    assert len(item["embedding"]) == EMBED_DIM and isinstance(item["embedding"][0], float)


@pytest.mark.parametrize("mode", ["plain", "stream", "tool", "embed"])
def test_openai_node_client(forge_url, mode):
    node = shutil.which("node")
    if node is None or not (NODE_PREFIX / "node_modules" / "openai").is_dir():
        pytest.skip(f"node or the openai npm package (npm install --prefix {NODE_PREFIX} openai)")
    model = EMBED_MODEL if mode == "embed" else MODEL
    done = subprocess.run(
        [node, str(NODE_CLIENT), f"{forge_url}/v1", KEY, model, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "NODE_PATH": str(NODE_PREFIX / "node_modules")},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if mode == "tool":
        assert out == {"name": "get_service_status", "arguments": {"service": "checkout"}}
    elif mode == "embed":
        assert (out["count"], out["dims"], out["prompt_tokens"]) == (2, EMBED_DIM, 2)
        assert out["norms"] == pytest.approx([1.0, 1.0], abs=1e-4)
    else:
        assert out["text"] and out["completion_tokens"] > 0


# -- the Responses and Messages APIs ----------------------------------------------------------

RESPONSES_TOOL = {
    "type": "function",
    "name": "get_service_status",
    **{"parameters": STATUS_TOOL["function"]["parameters"]},
}
QUESTION = ASK[0]["content"]


def test_openai_responses_create_stream_and_parse(forge_url):
    from pydantic import BaseModel

    class Status(BaseModel):
        service: str
        healthy: bool

    with openai.OpenAI(base_url=f"{forge_url}/v1", api_key=KEY, max_retries=0) as client:
        plain = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8)
        with client.responses.stream(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL]) as s:
            kinds = [event.type for event in s]
            streamed = s.get_final_response()
        parsed = client.responses.parse(model=MODEL, input="Status?", text_format=Status)
    assert plain.output_text and plain.usage.output_tokens > 0
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    (call,) = streamed.output
    assert json.loads(call.arguments) == {"service": "checkout"}
    assert isinstance(parsed.output_parsed, Status)


async def test_openai_agents_sdk_with_its_defaults(forge_url, monkeypatch):
    """Nothing set but the base URL and the key (the SDK's own environment variables): the
    SDK picks the Responses API itself; a run plain, then streamed (in one event loop: the SDK
    keeps the client it made for the next run). Its trace exporter would call OpenAI: off."""
    import agents
    from agents.models import _openai_shared

    monkeypatch.setattr(_openai_shared, "_default_openai_client", None)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{forge_url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    asked = []

    @agents.function_tool
    def get_service_status(service: str) -> str:
        """The status of a service."""
        asked.append(service)
        return f"{service}: degraded"

    agent = agents.Agent(
        name="ops", instructions="Use the tools.", tools=[get_service_status], model=MODEL
    )
    plain = await agents.Runner.run(agent, QUESTION)
    streamed = agents.Runner.run_streamed(agent, QUESTION)
    kinds = {event.type async for event in streamed.stream_events()}
    assert asked == ["checkout", "checkout"]
    for run in (plain, streamed):
        assert isinstance(run.final_output, str) and run.final_output.strip()
    assert "raw_response_event" in kinds  # the Responses events, as the SDK relays them


@pytest.mark.parametrize("stream", [False, True])
async def test_pydantic_ai_on_the_responses_api(forge_url, stream):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(
        MODEL, provider=OpenAIProvider(base_url=f"{forge_url}/v1", api_key=KEY)
    )
    agent = Agent(model, instructions="Use the tools.")
    asked = []

    @agent.tool_plain
    def get_service_status(service: str) -> str:
        """The status of a service."""
        asked.append(service)
        return f"{service}: degraded"

    if stream:
        async with agent.run_stream(QUESTION) as run:
            output = await run.get_output()
    else:
        output = (await agent.run(QUESTION)).output
    assert asked == ["checkout"]
    assert isinstance(output, str) and output.strip()


def test_anthropic_messages_create_stream_and_a_tool_round_trip(forge_url):
    import anthropic

    tool = {"name": "get_service_status", **{"input_schema": STATUS_TOOL["function"]["parameters"]}}
    with anthropic.Anthropic(base_url=forge_url, api_key=KEY, max_retries=0) as client:
        plain = client.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        with client.messages.stream(
            model=MODEL, max_tokens=64, messages=ASK, tools=[tool]
        ) as stream:
            first = stream.get_final_message()
        (call,) = first.content
        follow = [
            *ASK,
            {"role": "assistant", "content": [call.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "up"}],
            },
        ]
        with client.messages.stream(
            model=MODEL, max_tokens=16, messages=follow, tools=[tool]
        ) as stream:
            text = "".join(stream.text_stream)
        counted = client.messages.count_tokens(model=MODEL, messages=ASK)
        stop = " " + plain.content[0].text.split(" ")[2]  # a word it says: the answer ends there
        with client.messages.stream(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "Hello"}],
            stop_sequences=[stop],
        ) as stream:
            stopped = stream.get_final_message()
    assert plain.content[0].text and plain.usage.output_tokens > 0
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert call.type == "tool_use" and call.input == {"service": "checkout"}
    assert first.stop_reason == "tool_use"
    assert text.strip()
    assert counted.input_tokens > 0
