"""What each stage of the request path costs in CPU, measured so a sub-millisecond change shows on
a noisy machine.

    python -m loadtest.stage_cpu [--requests 2000] [--redis-url redis://127.0.0.1:6379/0]
        [--out loadtest/results/stage-cpu.json]

The gateway runs in this process (``serve_app.local``: real stages, replica and engine, no Ray
and no HTTP server), as ``loadtest/serve_forge.py`` configures it for the overhead benchmark (a
zero-delay engine, every stage on). Requests go one at a time through the ASGI app, so nothing
else runs while a stage does, and each stage's CPU is this thread's ``thread_time`` from its
entry until it hands the request on, plus from when the rest returns until it returns. Thread
CPU time, not wall time: another process on the machine takes wall time from a request, not
CPU time, which is why these numbers hold still on a busy 2-core machine where ``loadtest.
overhead``'s move by 10 %.

Buckets beyond the stages: ``dispatch`` (choosing and calling the replica, with the in-process
replica and engine work that runs meanwhile), ``outside`` (the ASGI app, the client, the
response's body and its end: the relay, metering's record, the quota's settle, the access line).

To compare two checkouts in one sitting, point ``PYTHONPATH`` at the other one's root and run this
file by its path (it uses only ``build_local_gateway``, the gateway's pipeline and
``loadtest.serve_forge.forge_args``, which older checkouts have too)::

    PYTHONPATH=/tmp/old-checkout .venv/bin/python loadtest/stage_cpu.py --out /tmp/old.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from loadtest.serve_forge import BENCH_KEY, forge_args
from serve_app.config.models import load_config
from serve_app.local import build_local_gateway

ENGINE = {"output_tokens_min": 16, "output_tokens_max": 16, "max_num_seqs": 256}
BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "Say sixteen words about gateways."}],
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
}


class StageClock:
    """This thread's CPU time by owner: the one stage (or bucket) running now."""

    def __init__(self, timer: Callable[[], float] = time.thread_time) -> None:
        self.cpu: Counter[str] = Counter()
        self.owner = "outside"
        self._timer = timer
        self._mark = timer()

    def enter(self, owner: str) -> str:
        """Charge the time since the last switch to the owner then; ``owner`` runs now."""
        now = self._timer()
        self.cpu[self.owner] += now - self._mark
        self._mark = now
        previous, self.owner = self.owner, owner
        return previous


def clocked(kind: type, name: str, clock: StageClock, *, endpoint: bool = False) -> None:
    """Wrap ``kind.__call__`` (this process only) so that ``clock`` charges ``name`` while
    the stage's own code runs."""
    original = kind.__call__

    if endpoint:

        async def call_endpoint(self, ctx):
            previous = clock.enter(name)
            try:
                return await original(self, ctx)
            finally:
                clock.enter(previous)

        kind.__call__ = call_endpoint
        return

    async def call_stage(self, ctx, call_next):
        async def rest(ctx):
            try:
                return await call_next(ctx)
            finally:
                clock.enter(name)

        previous = clock.enter(name)
        try:
            return await original(self, ctx, rest)
        finally:
            clock.enter(previous)

    kind.__call__ = call_stage


def stage_name(stage: object) -> str:
    return type(stage).__name__.removesuffix("Stage").lower()


def log_to_file(path: Path) -> None:
    """Serve writes the replica's log (the access line among it) to a file: so does this, and
    not to the terminal, which would cost more than the stages."""
    handler = logging.FileHandler(path)
    for name in ("ray", "ray.serve"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False


async def measure(requests: int, redis_url: str | None) -> dict:
    from serve_app.stages.dispatch import Dispatch

    config = load_config(forge_args(ENGINE, 1, redis_url, "full"))
    gateway = build_local_gateway(config)
    clock = StageClock()
    names = []
    for stage in gateway.pipeline.stages:
        names.append(stage_name(stage))
        clocked(type(stage), names[-1], clock)
    clocked(Dispatch, "dispatch", clock, endpoint=True)
    transport = httpx.ASGITransport(gateway.asgi_app())
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    async with (
        gateway.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://forge.bench", timeout=30) as client,
    ):

        async def one() -> None:
            async with client.stream(
                "POST", "/v1/chat/completions", json=BODY, headers=headers
            ) as answer:
                answer.raise_for_status()
                async for _ in answer.aiter_bytes():
                    pass

        for _ in range(min(200, requests)):  # warm: imports, caches, the store's scripts
            await one()
        clock.enter("outside")
        clock.cpu.clear()
        process0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(requests):
            await one()
        clock.enter("outside")
        process_s, wall_s = time.process_time() - process0, time.perf_counter() - wall0
    per_request = {k: v * 1e6 / requests for k, v in clock.cpu.items()}
    order = [*names, "dispatch", "outside"]
    return {
        "requests": requests,
        "store": "redis" if redis_url else "embedded",
        "us_per_request": {k: round(per_request.get(k, 0.0), 1) for k in order},
        "stages_us_per_request": round(sum(per_request.get(k, 0.0) for k in names), 1),
        "process_cpu_us_per_request": round(process_s * 1e6 / requests, 1),
        "wall_us_per_request": round(wall_s * 1e6 / requests, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--redis-url", default=None, help="the store (embedded without)")
    parser.add_argument("--out", default="loadtest/results/stage-cpu.json")
    args = parser.parse_args()
    log_to_file(Path(tempfile.mkdtemp(prefix="forge-stage-cpu-")) / "gateway.log")
    result = asyncio.run(measure(args.requests, args.redis_url))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
