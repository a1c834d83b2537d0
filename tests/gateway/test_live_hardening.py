"""A live change cannot hurt a running gateway: whatever fails while applying one (a malformed
mounted key file included) is a refusal that keeps the last good configuration serving and
says so; and a key revoked in a mounted key file stops working within seconds, with no live
change to wait for. In process (``serve_app/local.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway import live
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from tests.polling import eventually_async

KEY, OTHER_KEY = "sk-test-hardening-a", "sk-test-hardening-b"
MODEL = "forge-sim"


def write_keys(path, *keys: str) -> None:
    path.write_text("alpha: [" + ", ".join(hash_key(k) for k in keys) + "]\n")


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "key-hashes.yaml"
    write_keys(path, KEY, OTHER_KEY)
    return path


@pytest.fixture
async def gateway(key_file, monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setattr(live, "KEY_FILES_CHECK_S", 0.05)
    config = load_config(
        {
            "tenants": [{"name": "alpha"}],
            "key_hashes_file": str(key_file),
            "pools": [{"name": "primary", "model": MODEL}],
        }
    )
    gateway = build_local_gateway(config)
    async with gateway.lifespan():
        yield gateway


async def status_of(gateway: Gateway, key: str) -> int:
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://forge.test") as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"authorization": f"Bearer {key}"},
        )
    return answer.status_code


async def readiness(gateway: Gateway) -> dict:
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://forge.test") as http:
        return (await http.get("/readyz")).json()


async def test_a_key_revoked_in_the_mounted_file_stops_working_within_seconds(gateway, key_file):
    assert [await status_of(gateway, KEY), await status_of(gateway, OTHER_KEY)] == [200, 200]
    write_keys(key_file, KEY)  # OTHER_KEY revoked: the secret was updated, nothing redeployed
    await eventually_async(
        lambda: gateway.live.status.get("keys_read_at"),
        timeout_s=5,
        what="the changed key file read again",
    )
    assert await status_of(gateway, OTHER_KEY) == 401
    assert await status_of(gateway, KEY) == 200


async def test_a_malformed_key_file_is_refused_and_the_keys_it_had_keep_working(gateway, key_file):
    key_file.write_text("alpha: [not a digest\n")  # half-written, or a bad edit: not YAML
    await eventually_async(
        lambda: gateway.live.refused, timeout_s=5, what="the malformed key file refused"
    )
    assert "key files" in gateway.live.status["refused"]["digest"]
    assert [await status_of(gateway, KEY), await status_of(gateway, OTHER_KEY)] == [200, 200]
    assert (await readiness(gateway))["config"] == "refused"
    write_keys(key_file, KEY)  # fixed: read again, the refusal cleared
    await eventually_async(
        lambda: not gateway.live.refused, timeout_s=5, what="the fixed key file applied"
    )
    assert await status_of(gateway, OTHER_KEY) == 401
    assert (await readiness(gateway))["config"] == "current"


async def test_a_live_change_that_fails_in_an_unexpected_way_is_a_refusal(gateway, key_file):
    """Serve calls ``reconfigure`` with the new user_config: an exception escaping it after
    start-up would make Serve replace the replica, and the replacement would fail the same way.
    Here the change reads a key file that is not YAML (``yaml.YAMLError``, not a ValueError)."""
    await gateway.reconfigure({"tenants": [{"name": "alpha", "weight": 2}]})  # a first change
    key_file.write_text("alpha: [\n")
    await gateway.reconfigure({"tenants": [{"name": "alpha", "weight": 3}]})
    assert gateway.live.refused
    assert gateway.config.tenants[0].weight == 2  # the last good configuration serves
    assert await status_of(gateway, KEY) == 200


# -- a replica that starts while the target is bad ---------------------------------------------


def _config(key_file):
    return load_config(
        {
            "tenants": [{"name": "alpha"}],
            "key_hashes_file": str(key_file),
            "pools": [{"name": "primary", "model": MODEL}],
        }
    )


GOOD = {"tenants": [{"name": "alpha", "weight": 2}]}
BAD = {"tenants": [{"name": "alpha", "weight": -1}]}


async def test_a_replica_starting_on_a_bad_target_serves_what_a_running_one_serves(key_file):
    """A scale-up or a replacement while a refused change is Serve's target: the new replica
    asks a running one (through the deployment's handle, under Serve) and serves that."""
    running = build_local_gateway(_config(key_file))
    await running.reconfigure(GOOD)
    await running.reconfigure(BAD)  # refused by the running replica: it keeps GOOD
    starting = build_local_gateway(_config(key_file))
    starting.live.peers = running.served_user_config
    async with starting.lifespan():
        await starting.reconfigure(BAD)  # Serve's first call, at start-up
        await starting.reconfigure(BAD)  # and again once the replica runs: still said so
        assert starting.config.tenants[0].weight == 2
        assert starting.live.user_config == GOOD
        refused = starting.live.status["refused"]
        assert refused["started_from"] == "a running replica" and "weight" in refused["error"]
        assert (await readiness(starting))["config"] == "refused"
        assert await status_of(starting, KEY) == 200
        await starting.reconfigure({"tenants": [{"name": "alpha", "weight": 3}]})  # fixed
        assert starting.config.tenants[0].weight == 3 and not starting.live.refused


async def test_a_bad_target_with_no_running_replica_to_ask_fails_the_start(key_file, monkeypatch):
    """A first deploy (nobody to ask, or nobody answering in time): the replica fails to start
    with the bad field's path, as Serve shows it."""
    monkeypatch.setattr(live, "PEER_WAIT_S", 0.05)

    async def nobody_answers():
        await asyncio.Event().wait()

    async def none_applied():
        return None

    for peers in (None, none_applied, nobody_answers):
        starting = build_local_gateway(_config(key_file))
        starting.live.peers = peers
        with pytest.raises(Exception, match="weight"):
            await starting.reconfigure(BAD)
        await starting.aclose()
