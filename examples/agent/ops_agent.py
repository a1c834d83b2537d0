"""An operations assistant on LangGraph, running as a Forge tenant through the OpenAI route.

    python examples/agent/ops_agent.py "What is the service status of checkout?" \
        [--base-url http://127.0.0.1:8000/v1] [--key sk-demo-alpha-local-only] [--model M]

Its three tools answer from a small in-memory world (no network): a service's status, a metric's
latest value, and a ticket it opens. The model decides when to call them; on the laptop that is
Forge's simulated engine, whose tool-calling rule is predictable (serve_app/engines/tool_calls.py:
it calls the tools your question names, e.g. "service status", "metric", "ticket", and answers
once a tool's result is in), and on the cluster vLLM with its tool parser, or Gemini on failover.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

SERVICES = {
    "checkout": {"status": "degraded", "since": "09:12 UTC", "error_rate": 0.042},
    "payments": {"status": "ok", "since": "yesterday", "error_rate": 0.001},
}
TICKETS: list[dict] = []


@tool
def get_service_status(service: str) -> str:
    """The current status of a service (ok, degraded or down) and since when."""
    found = SERVICES.get(service.lower())
    return json.dumps(found or {"status": "unknown", "service": service})


@tool
def read_metric(service: str, metric: str) -> str:
    """The latest value of a service's metric, e.g. error_rate."""
    value = SERVICES.get(service.lower(), {}).get(metric)
    return json.dumps({"service": service, "metric": metric, "value": value})


@tool
def open_ticket(title: str, priority: int) -> str:
    """Open an incident ticket; priority 1 is the most urgent."""
    ticket = {"id": f"OPS-{100 + len(TICKETS)}", "title": title, "priority": priority}
    TICKETS.append(ticket)
    return json.dumps(ticket)


TOOLS = [get_service_status, read_metric, open_ticket]


def build_agent(base_url: str, key: str, model: str, **chat_options):
    """The ReAct agent over Forge: any OpenAI-compatible endpoint would do, Forge is one."""
    llm = ChatOpenAI(base_url=base_url, api_key=key, model=model, max_retries=0, **chat_options)
    return create_react_agent(llm, TOOLS)


def run(
    question: str,
    base_url: str,
    key: str,
    model: str,
    stream: bool = False,
    responses_api: bool = False,
) -> list:
    """The conversation's messages after the agent is done (the question first); with
    ``responses_api``, the model is called on ``/v1/responses`` instead of chat completions."""
    agent = build_agent(base_url, key, model, streaming=stream, use_responses_api=responses_api)
    state = agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 8})
    return state["messages"]


def transcript(messages: list) -> str:
    lines = []
    for m in messages:
        if isinstance(m, AIMessage) and m.tool_calls:
            for call in m.tool_calls:
                lines.append(f"assistant → {call['name']}({json.dumps(call['args'])})")
        elif isinstance(m, ToolMessage):
            lines.append(f"tool {m.name} → {m.content}")
        else:
            lines.append(f"{m.type}: {m.content}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("question", nargs="?", default="What is the service status of checkout?")
    parser.add_argument(
        "--base-url", default=os.environ.get("FORGE_BASE_URL", "http://127.0.0.1:8000/v1")
    )
    parser.add_argument(
        "--key", default=os.environ.get("FORGE_API_KEY", "sk-demo-alpha-local-only")
    )
    parser.add_argument("--model", default=os.environ.get("FORGE_MODEL", "forge-sim-1b"))
    parser.add_argument("--stream", action="store_true", help="stream the model's turns")
    args = parser.parse_args(argv)
    print(transcript(run(args.question, args.base_url, args.key, args.model, args.stream)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
