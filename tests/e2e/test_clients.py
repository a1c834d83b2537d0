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
