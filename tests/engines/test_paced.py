"""The simulator's paced mode (``engines/paced.py``): a benchmark's token source whose every
token says when the engine sent it; usage and abandonment as any stream's."""

from __future__ import annotations

import contextlib

import orjson

from serve_app.config.models import SimulatedEngineConfig
from serve_app.engines.base import Usage
from serve_app.engines.paced import STAMP
from serve_app.engines.simulated import SimulatedEngine

MODEL = "sim-model"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 3,
    "stream_options": {"include_usage": True},
}


def _engine() -> SimulatedEngine:
    # Fast enough that the test waits ~2 ms; nothing here depends on how long it took.
    return SimulatedEngine(MODEL, SimulatedEngineConfig(paced_tokens_per_s=1000.0), 64)


async def test_every_token_is_its_send_time_and_the_first_also_the_arrival():
    engine = _engine()
    items = [item async for item in engine.stream(BODY, "chat", "req-1")]
    *frames, usage = items
    assert isinstance(usage, Usage) and usage.completion_tokens == 3
    chunks = [orjson.loads(frame[len(b"data: ") :]) for frame in frames]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    stamps = [STAMP.findall(frame) for frame in frames[1:4]]
    assert [[marker for marker, _ in found] for found in stamps] == [[b"@", b"~"], [b"~"], [b"~"]]
    times = [float(seconds) for found in stamps for _, seconds in found]
    assert times == sorted(times)  # arrival, then each send in order


async def test_a_stream_left_early_is_charged_what_it_was_sent():
    engine = _engine()
    stream = engine.stream({**BODY, "max_tokens": 50}, "chat", "req-2")
    async with contextlib.aclosing(stream):
        for _ in range(3):  # the role chunk and two tokens
            await anext(stream)
    usage = await engine.abandoned.collect("req-2", wait_s=0)
    assert usage is not None and usage.completion_tokens == 2 and usage.prompt_tokens > 0
