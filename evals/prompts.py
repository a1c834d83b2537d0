"""The prompt set (``evals/data/prompts.yaml``): one check per prompt, each asked twice through
the official ``openai`` client, streamed and not, with the answer's shape asserted."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from evals.gate import Check, Failed, Served, expect
from evals.target import Target

PROMPTS = Path(__file__).parent / "data" / "prompts.yaml"

# A schema the json-schema prompt asks for (top-level properties of several types).
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string"},
        "urgency": {"type": "string", "enum": ["low", "medium", "high"]},
        "page_oncall": {"type": "boolean"},
    },
    "required": ["summary", "urgency", "page_oncall"],
    "additionalProperties": False,
}
NO_CACHE = {"cache-control": "no-store"}  # the backend's answer, every time


def load(path: Path = PROMPTS) -> list[dict]:
    prompts = yaml.safe_load(path.read_text())
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate prompt ids")
    return prompts


def _request(target: Target, prompt: dict) -> dict:
    args: dict = {"model": target.model, "max_tokens": prompt["max_tokens"]}
    if prompt.get("route", "chat") == "chat":
        messages = list(prompt["messages"])
        if prompt.get("system"):
            messages.insert(0, {"role": "system", "content": prompt["system"]})
        args["messages"] = messages
    else:
        args["prompt"] = prompt["prompt"]
    if prompt.get("stop"):
        args["stop"] = prompt["stop"]
    if prompt.get("json") == "object":
        args["response_format"] = {"type": "json_object"}
    elif prompt.get("json") == "schema":
        args["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA, "strict": True},
        }
    return args


def _judge(prompt: dict, how: str, text: str, finish: str | None, usage) -> None:
    where = f"{how}:"
    expect(text.strip(), f"{where} empty answer")
    expect(usage is not None, f"{where} no usage")
    expect(
        usage.prompt_tokens > 0 and usage.completion_tokens > 0,
        f"{where} usage without tokens: {usage}",
    )
    expect(
        usage.total_tokens == usage.prompt_tokens + usage.completion_tokens,
        f"{where} total_tokens != prompt + completion: {usage}",
    )
    expect(
        usage.completion_tokens <= prompt["max_tokens"],
        f"{where} {usage.completion_tokens} completion tokens > max_tokens {prompt['max_tokens']}",
    )
    expect(finish in ("stop", "length"), f"{where} finish_reason {finish!r}")
    if finish == "length":
        expect(
            usage.completion_tokens == prompt["max_tokens"],
            f"{where} finish_reason length at {usage.completion_tokens} of {prompt['max_tokens']}",
        )
    for stop in prompt.get("stop") or ():
        expect(stop not in text, f"{where} stop string {stop!r} in the answer")
    if prompt.get("json") and finish == "stop":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise Failed(
                f"{where} JSON mode answered invalid JSON ({exc}): {text[:80]!r}"
            ) from None
        expect(isinstance(data, dict), f"{where} JSON mode answered {type(data).__name__}")
        if prompt["json"] == "schema":
            missing = set(TICKET_SCHEMA["required"]) - set(data)
            expect(not missing, f"{where} JSON lacks required {sorted(missing)}")
            expect(data["urgency"] in ("low", "medium", "high"), f"{where} urgency not in enum")
    elif prompt.get("json"):
        raise Failed(f"{where} JSON mode answer cut at max_tokens: raise max_tokens")


async def _ask(target: Target, prompt: dict, served: Served, stream: bool) -> None:
    client = target.openai()
    args = _request(target, prompt)
    chat = "messages" in args
    api = client.chat.completions if chat else client.completions
    async with client:
        if not stream:
            raw = await api.with_raw_response.create(**args, extra_headers=NO_CACHE)
            served.saw(raw.headers.get("x-forge-backend"), raw.headers.get("x-forge-cache"))
            response = raw.parse()
            choice = response.choices[0]
            text = choice.message.content if chat else choice.text
            _judge(prompt, "json", text or "", choice.finish_reason, response.usage)
            return
        raw = await api.with_raw_response.create(
            **args, stream=True, stream_options={"include_usage": True}, extra_headers=NO_CACHE
        )
        served.saw(raw.headers.get("x-forge-backend"), raw.headers.get("x-forge-cache"))
        text, finish, usage = "", None, None
        async for chunk in raw.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                piece = choice.delta.content if chat else choice.text
                text += piece or ""
                finish = choice.finish_reason or finish
        _judge(prompt, "sse", text, finish, usage)


def _check(prompt: dict) -> Check:
    async def run(target: Target, served: Served) -> None:
        await _ask(target, prompt, served, stream=False)
        await _ask(target, prompt, served, stream=True)

    return Check(f"prompt:{prompt['id']}", run, "prompts")


def checks(path: Path = PROMPTS) -> list[Check]:
    return [_check(p) for p in load(path)]
