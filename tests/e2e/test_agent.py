"""The LangGraph operations agent (examples/agent) as a tenant of the session's graph: a tool
call, the tool's result, the answer; the same with the primary failing and the fallback serving."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from examples.agent import ops_agent
from tests.e2e.conftest import tenant_key
from tests.polling import eventually

KEY = tenant_key("agents")  # a tenant no other test counts


def assert_called_then_answered(messages: list, tool: str) -> None:
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert calls and calls[0].tool_calls[0]["name"] == tool, messages
    assert results and json.loads(results[0].content)["status"] == "degraded", results
    final = messages[-1]
    # ``text``: on the Responses API an answer's content is a list of blocks.
    assert isinstance(final, AIMessage) and not final.tool_calls and final.text.strip()


@pytest.mark.parametrize(
    ("stream", "responses_api"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_the_agent_calls_a_tool_reads_its_result_and_answers(forge_url, stream, responses_api):
    messages = ops_agent.run(
        "What is the service status of checkout?",
        f"{forge_url}/v1",
        KEY,
        "forge-sim",
        stream,
        responses_api,
    )
    assert_called_then_answered(messages, "get_service_status")


def test_the_agent_works_the_same_while_the_fallback_serves(forge_url, faults, metric):
    faults.set_all("pool-chaos", {"mode": "error"})
    retried = metric("forge_retries_total")
    messages = ops_agent.run(
        "What is the service status of checkout?", f"{forge_url}/v1", KEY, "forge-chaos"
    )
    assert_called_then_answered(messages, "get_service_status")
    # Its first call met a failing replica and was retried on the fallback. Retries reach
    # Prometheus up to an export interval late: let all of them land before the next test (the
    # chaos tests count retries exactly).
    eventually(
        lambda: metric("forge_retries_total") > retried,
        timeout_s=15,
        what="this test's retries to be exported",
    )
    seen = [metric("forge_retries_total")]
    eventually(
        lambda: seen.append(metric("forge_retries_total")) or seen[-1] == seen[-2],
        timeout_s=10,
        interval_s=1.5,
        what="the retry counter to settle",
    )
