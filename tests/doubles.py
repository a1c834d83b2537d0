"""Test doubles shared by the unit tests, in one place.

Where a seam has a real in-process implementation (``MemoryStore``, ``BreakerBoard``,
``LocalSchedulerClient``, ``LocalPoolBackend``) tests use that; what is here stands in only for
what has none: a clock a test can move, metrics a test can read, a backend scripted to fail at a
chosen point, a store that is down.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import StreamingResponse

from serve_app import sse
from serve_app.errors import ForgeError
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import RequestContext
from serve_app.protocol import ChatCompletionRequest
from serve_app.store import Bucket, Store, StoreError, StoreUnavailable, TakeResult

MODEL = "forge-sim"
USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


class Clock:
    """A clock that moves only when told to (``now`` or ``advance``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Counter:
    """Records every ``inc``/``set``/``observe`` call's tags (and values)."""

    def __init__(self) -> None:
        self.calls: list[dict | None] = []
        self.values: list[float] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.calls.append(tags)
        self.values.append(value)

    set = inc
    observe = inc


class RecordingMetrics:
    """``ForgeMetrics``' surface, recording instead of exporting; ``record`` keeps its kwargs.
    Its series are ``ForgeMetrics``' own, read from a real one, so the two cannot drift."""

    SERIES = tuple(vars(ForgeMetrics()))

    def __init__(self) -> None:
        for name in self.SERIES:
            setattr(self, name, Counter())
        self.store_errors_seen = collections.Counter()  # a plain tally, not a series
        self.recorded: list[dict] = []

    def record(self, **fields) -> None:
        self.recorded.append(fields)

    meter = ForgeMetrics.meter  # onto the recording series
    store_changed = ForgeMetrics.store_changed


def chunk(text: str) -> bytes:
    return sse.frame({"object": "chat.completion.chunk", "choices": [{"delta": {"content": text}}]})


class FakeBackend:
    """A backend scripted to stream the given batches, failing before or after where told."""

    pool = None
    served_model = None
    kinds = ("chat", "completion", "embedding")

    def __init__(
        self,
        name: str,
        batches: list[list] | None = None,
        *,
        fail_before: ForgeError | None = None,
        fail_after: Exception | None = None,
        response: dict | None = None,
        replica: str | None = "replica-1",
    ) -> None:
        self.name = name
        self.batches = batches or []
        self.fail_before = fail_before
        self.fail_after = fail_after
        self.response = response or {"id": name, "choices": [], "usage": USAGE}
        self.replica = replica
        self.calls: list[tuple] = []
        self.closed = False

    async def stream(
        self, body: dict, kind: str, request_id: str, budget_s: float | None = None
    ) -> AsyncIterator[list]:
        self.calls.append((body, kind, request_id))
        try:
            if self.fail_before:
                raise self.fail_before
            for batch in self.batches:
                yield batch
            if self.fail_after:
                raise self.fail_after
        finally:
            self.closed = True

    async def complete(
        self, body: dict, kind: str, request_id: str, budget_s: float | None = None
    ) -> dict:
        self.calls.append((body, kind, request_id))
        if self.fail_before:
            raise self.fail_before
        return {"response": self.response, "replica": self.replica}

    async def ready(self) -> bool:
        return True


def make_ctx(stream: bool = True, model: str = MODEL) -> RequestContext:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    request = Request(
        {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    )
    return RequestContext(
        request=request,
        route="chat",
        request_id="req-1",
        body=body,
        parsed=ChatCompletionRequest.model_validate(body),
    )


async def body_of(response: StreamingResponse) -> list[bytes]:
    return [part async for part in response.body_iterator]


class DownStore(Store):
    """A store whose every call fails: ``StoreUnavailable`` (unreachable) or plain
    ``StoreError`` (answered an error). ``calls`` counts what reached it."""

    def __init__(self, error: type[StoreError] = StoreUnavailable) -> None:
        self.error = error
        self.calls = 0

    def _fail(self):
        self.calls += 1
        raise self.error("store down (test double)")

    async def take(self, buckets: Sequence[Bucket], amounts: Sequence[float]) -> TakeResult:
        self._fail()

    async def adjust(self, bucket: Bucket, delta: float, *, once=None) -> float:
        self._fail()

    async def peek(self, buckets: Sequence[Bucket]) -> tuple[float, ...]:
        self._fail()

    async def acquire_lease(self, key, lease_id, limit, ttl_s) -> tuple[bool, int]:
        self._fail()

    async def renew_lease(self, key, lease_id, ttl_s) -> bool:
        self._fail()

    async def renew_leases(self, leases, ttl_s) -> list[tuple[str, str]]:
        self._fail()

    async def release_lease(self, key, lease_id) -> None:
        self._fail()

    async def cache_get(self, key) -> bytes | None:
        self._fail()

    async def cache_put(self, key, value, ttl_s) -> None:
        self._fail()

    async def cache_delete(self, key) -> bool:
        self._fail()

    async def ping(self) -> None:
        self._fail()

    async def close(self) -> None:
        return None
