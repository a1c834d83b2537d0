"""Dispatch: route by model, fail over before the first byte, end honestly after it."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from starlette.responses import StreamingResponse

from serve_app import errors, sse
from serve_app.errors import ForgeError
from serve_app.stages.dispatch import Dispatch
from tests.doubles import MODEL, USAGE, FakeBackend, body_of, chunk, make_ctx


async def test_unknown_model_is_404():
    primary = FakeBackend("primary")
    dispatch = Dispatch({MODEL: [primary]})
    with pytest.raises(ForgeError) as info:
        await dispatch(make_ctx(model="gpt-unknown"))
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    assert "gpt-unknown" in info.value.message
    assert primary.calls == []


async def test_model_with_no_backends_is_404():
    with pytest.raises(ForgeError) as info:
        await Dispatch({MODEL: []})(make_ctx())
    assert info.value.status == 404


async def test_normal_stream_relays_frames_and_ends_with_done():
    primary = FakeBackend("primary", [[chunk("a"), chunk("b")], [chunk("c")]])
    ctx = make_ctx()
    response = await Dispatch({MODEL: [primary]})(ctx)
    assert isinstance(response, StreamingResponse)
    assert response.media_type == "text/event-stream"
    assert response.headers["x-forge-backend"] == "primary"
    assert response.headers["cache-control"] == "no-cache"
    parts = await body_of(response)
    assert parts == [chunk("a") + chunk("b"), chunk("c"), b"data: [DONE]\n\n"]
    assert ctx.backend == "primary"
    assert ctx.first_byte_at is not None
    assert ctx.stream_error is None
    assert primary.calls == [(ctx.body, "chat", ctx.key)]


async def test_metadata_is_stripped_from_bytes_and_recorded_on_ctx():
    primary = FakeBackend(
        "primary",
        [[{"replica": "replica-7"}, chunk("a")], [chunk("b"), {"usage": USAGE}]],
    )
    ctx = make_ctx()
    response = await Dispatch({MODEL: [primary]})(ctx)
    assert response.headers["x-forge-replica"] == "replica-7"
    body = b"".join(await body_of(response))
    assert body == chunk("a") + chunk("b") + sse.DONE
    assert b"replica-7" not in body and b"prompt_tokens" not in body
    assert ctx.replica == "replica-7"
    assert ctx.usage == USAGE


async def test_metadata_only_batches_write_nothing():
    primary = FakeBackend("primary", [[{"replica": "r"}], [chunk("a")], [{"usage": USAGE}]])
    response = await Dispatch({MODEL: [primary]})(make_ctx())
    assert await body_of(response) == [chunk("a"), sse.DONE]


async def test_5xx_before_first_item_fails_over_to_fallback():
    primary = FakeBackend("primary", fail_before=errors.bad_gateway("replica died"))
    fallback = FakeBackend("fallback", [[chunk("from fallback")]])
    ctx = make_ctx()
    response = await Dispatch({MODEL: [primary, fallback]})(ctx)
    assert ctx.backend == "fallback"
    assert response.headers["x-forge-backend"] == "fallback"
    assert await body_of(response) == [chunk("from fallback"), sse.DONE]
    assert len(primary.calls) == len(fallback.calls) == 1


async def test_4xx_from_primary_is_raised_not_failed_over():
    bad = errors.invalid_request("too long", code="context_length_exceeded")
    primary = FakeBackend("primary", fail_before=bad)
    fallback = FakeBackend("fallback", [[chunk("x")]])
    with pytest.raises(ForgeError) as info:
        await Dispatch({MODEL: [primary, fallback]})(make_ctx())
    assert info.value is bad
    assert fallback.calls == []


async def test_all_failing_raises_the_last_error():
    primary = FakeBackend("primary", fail_before=errors.bad_gateway())
    fallback = FakeBackend("fallback", fail_before=errors.upstream_timeout())
    with pytest.raises(ForgeError) as info:
        await Dispatch({MODEL: [primary, fallback]})(make_ctx())
    assert (info.value.status, info.value.code) == (504, "upstream_timeout")


async def test_error_after_first_item_ends_stream_with_error_event_and_no_done():
    late = errors.bad_gateway("replica died mid-stream")
    primary = FakeBackend("primary", [[chunk("a")], [chunk("b")]], fail_after=late)
    fallback = FakeBackend("fallback", [[chunk("never")]])
    ctx = make_ctx()
    response = await Dispatch({MODEL: [primary, fallback]})(ctx)
    parts = await body_of(response)
    assert parts == [chunk("a"), chunk("b"), errors.error_event(late)]
    assert orjson.loads(parts[-1][len(b"data: ") :]) == late.body()
    assert sse.DONE not in b"".join(parts)
    assert ctx.stream_error == "replica died mid-stream"
    assert ctx.backend == "primary"
    assert fallback.calls == []  # text already sent is never spliced with another backend's


async def test_an_unexpected_failure_after_first_item_still_ends_with_an_error_event():
    primary = FakeBackend("primary", [[chunk("a")]], fail_after=RuntimeError("bug"))
    ctx = make_ctx()
    parts = await body_of(await Dispatch({MODEL: [primary]})(ctx))
    assert parts[0] == chunk("a")
    error = orjson.loads(parts[-1][len(b"data: ") :])["error"]
    assert error["code"] == "bad_gateway" and "bug" not in error["message"]
    assert sse.DONE not in b"".join(parts)


async def test_client_going_away_closes_the_backend_stream():
    primary = FakeBackend("primary", [[chunk("a")], [chunk("b")], [chunk("c")]])
    response = await Dispatch({MODEL: [primary]})(make_ctx())
    iterator = response.body_iterator
    assert await anext(iterator) == chunk("a")
    await iterator.aclose()
    assert primary.closed


async def test_empty_stream_still_ends_with_done():
    response = await Dispatch({MODEL: [FakeBackend("primary", [])]})(make_ctx())
    assert await body_of(response) == [sse.DONE]


async def test_non_streaming_returns_json_with_backend_headers():
    response_body = {
        "id": "chatcmpl-1",
        "choices": [{"message": {"content": "hi"}}],
        "usage": USAGE,
    }
    primary = FakeBackend("primary", response=response_body, replica="replica-3")
    ctx = make_ctx(stream=False)
    response = await Dispatch({MODEL: [primary]})(ctx)
    assert response.media_type == "application/json"
    assert orjson.loads(response.body) == response_body
    assert response.headers["x-forge-backend"] == "primary"
    assert response.headers["x-forge-replica"] == "replica-3"
    assert (ctx.backend, ctx.replica, ctx.usage) == ("primary", "replica-3", USAGE)
    assert primary.calls == [(ctx.body, "chat", ctx.key)]


async def test_non_streaming_fails_over_on_5xx_without_replica_header():
    primary = FakeBackend("primary", fail_before=errors.backend_unavailable())
    fallback = FakeBackend("fallback", replica=None)
    ctx = make_ctx(stream=False)
    response = await Dispatch({MODEL: [primary, fallback]})(ctx)
    assert response.headers["x-forge-backend"] == "fallback"
    assert "x-forge-replica" not in response.headers
    assert orjson.loads(response.body)["id"] == "fallback"
    assert ctx.backend == "fallback"


async def test_non_streaming_4xx_is_raised_not_failed_over():
    primary = FakeBackend("primary", fail_before=errors.invalid_request("bad"))
    fallback = FakeBackend("fallback")
    with pytest.raises(ForgeError) as info:
        await Dispatch({MODEL: [primary, fallback]})(make_ctx(stream=False))
    assert info.value.status == 400
    assert fallback.calls == []


async def test_non_streaming_all_failing_raises_the_last_error():
    primary = FakeBackend("primary", fail_before=errors.upstream_timeout())
    fallback = FakeBackend("fallback", fail_before=errors.bad_gateway())
    with pytest.raises(ForgeError) as info:
        await Dispatch({MODEL: [primary, fallback]})(make_ctx(stream=False))
    assert info.value.status == 502


async def test_failover_gives_the_pool_slot_back_before_the_fallback_serves():
    released = []
    primary = FakeBackend("primary", fail_before=errors.bad_gateway("down"))
    fallback = FakeBackend("fallback", [[chunk("f")]])
    ctx = make_ctx()
    ctx.release_slot = lambda: released.append(True)
    await Dispatch({MODEL: [primary, fallback]})(ctx)
    assert released == [True]


async def test_the_pool_keeps_its_slot_when_it_serves():
    released = []
    ctx = make_ctx()
    ctx.release_slot = lambda: released.append(True)
    await Dispatch({MODEL: [FakeBackend("primary", [[chunk("a")]])]})(ctx)
    assert released == []


async def test_two_requests_under_one_client_id_reach_the_backend_under_ids_of_their_own():
    """Clients choose ``x-request-id`` (two tenants may both send ``1``): what keys a request
    inside (its backend call, pinned follow-ups, abandoned usage) is Forge's own id."""
    primary = FakeBackend("primary", [[chunk("a")]])
    first, second = make_ctx(), make_ctx()
    assert first.request_id == second.request_id == "req-1"
    for ctx in (first, second):
        await body_of(await Dispatch({MODEL: [primary]})(ctx))
    keys = [call[2] for call in primary.calls]
    assert keys == [first.key, second.key] and first.key != second.key
    assert "req-1" not in keys


class _CostAsker:
    """A pool of one replica (``PoolControl``) that answers what an abandoned stream cost, and
    counts the questions."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def replica_count(self) -> int:
        return 1

    def wake(self) -> None:
        pass

    def avoid(self, request_id: str, replica_id: str) -> None:
        pass

    def take_routed(self, request_id: str) -> tuple[str, bool] | None:
        return None

    def take_offered(self, request_id: str) -> tuple[str, ...]:
        return ()

    async def set_fault(self, spec):
        return {}

    def engine_identity(self) -> str | None:
        return None

    async def abandoned_usage(self, request_id: str, replica_id: str) -> dict:
        self.asked.append((request_id, replica_id))
        return USAGE


class _SlowToClose(FakeBackend):
    """A stream whose close takes a while, as a Serve handle stream's does."""

    def __init__(self, name: str, batches: list[list]) -> None:
        super().__init__(name, batches)
        self.pool = _CostAsker()

    async def stream(self, body, kind, request_id, budget_s=None):
        try:
            async for batch in super().stream(body, kind, request_id, budget_s):
                yield batch
        finally:
            await asyncio.sleep(0.05)


async def test_a_stream_closed_from_both_ends_at_once_is_charged_what_it_cost():
    """The client left: the relay's ``finally`` (run when the server, or the collector, closes
    the body) and the response's own end close the backend's stream at the same moment. The
    second close must not fail, or the replica is never asked and the tenant is charged an
    estimate (the end-to-end metering test saw it about once in three runs)."""
    backend = _SlowToClose("primary", [[{"replica": "r-1"}, chunk("a")], [chunk("b")]])
    ctx = make_ctx()
    response = await Dispatch({MODEL: [backend]})(ctx)
    body = response.body_iterator
    assert await anext(body) == chunk("a")  # the client read the first frame, then left
    relay_closing = asyncio.create_task(body.aclose())
    await asyncio.sleep(0.01)  # the relay is closing the backend's stream
    await response._close_source()  # the response's end, as EventStream runs it
    await relay_closing
    assert backend.closed
    assert backend.pool.asked == [(ctx.key, "r-1")]
    assert ctx.usage == USAGE
