"""Chaos through the real gateway: one replica of a two-replica pool misbehaves at a time.

Each drill states what a client may see. Before the first byte, a failure is retried once (the
fallback here) within the retry budget, and the misbehaving replica's breaker opens after
``BREAKER_THRESHOLD`` failures so later requests do not even try it. After the first byte,
nothing is retried: a stream that breaks ends with an error event, and no client ever gets
text from two generations spliced together.
"""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import ALPHA_KEY, APP, BREAKER_THRESHOLD, gateway_breaker_states
from tests.polling import eventually

pytestmark = pytest.mark.e2e

POOL = "pool-chaos"
AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}


def ask(url: str, stream: bool, max_tokens: int = 8) -> tuple[httpx.Response, list[dict]]:
    body = {
        "model": "forge-chaos",
        "messages": [{"role": "user", "content": "tell me something"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    events = []
    if stream and response.status_code == 200:
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(orjson.loads(line[6:]))
    return response, events


def breaker_state(backend: str) -> int:
    return replica_admin.breaker_states(APP).get(backend, (0, 0))[0]


def retries(metric) -> float:
    return metric("forge_retries_total")


def settled(read, *, quiet_s: float = 1.5, timeout_s: float = 20) -> float:
    """A counter's value once it has stopped moving for ``quiet_s``: Ray exports a process's
    metrics every 0.5 s, so a count read just after the earlier tests may still miss their last
    retries (CI once read 1 for what was 2, and this test then counted one retry too many)."""
    last, deadline = read(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read()
        if now == last:
            return now
        last = now
    return last


def answered(metric) -> float:
    """Requests of this module's tenant the gateways have finished (recorded at the last byte,
    after any retry): once it counts every request sent, their retries are exported too."""
    return metric("forge_requests_total", 'tenant="alpha"')


def shunned_everywhere(backend: str) -> bool:
    """The board has the backend's breaker open or half-open, and so does every gateway
    replica's copy: no gateway will send it a request but its half-open probe."""
    return breaker_state(backend) in (1, 2) and all(
        copy[backend] in (1, 2) for copy in gateway_breaker_states([backend])
    )


def assert_one_generation(events: list[dict]) -> None:
    """Every chunk of a stream comes from one generation: one id, no error mixed into text."""
    chunk_ids = {e["id"] for e in events if "id" in e}
    assert len(chunk_ids) <= 1, f"spliced stream: chunks from {chunk_ids}"


def drive(url: str, n: int) -> list[str]:
    """``n`` requests, alternating streaming and not; every one must succeed. Returns who
    served each (``x-forge-backend``/``x-forge-replica``)."""
    served = []
    for i in range(n):
        response, events = ask(url, stream=bool(i % 2))
        assert response.status_code == 200, response.text
        if events:
            assert_one_generation(events)
            assert "error" not in events[-1]
        served.append(
            f"{response.headers['x-forge-backend']}/{response.headers.get('x-forge-replica')}"
        )
    return served


@pytest.mark.parametrize(
    "fault",
    [
        {"mode": "error"},
        # A hung replica costs each of its non-streamed requests the 5 s request deadline
        # before the breaker opens (~20 s): the slow run's, so the default run stays in 5 min.
        pytest.param({"mode": "hang"}, marks=pytest.mark.slow),
    ],
)
def test_a_failing_or_hung_replica_costs_clients_nothing_and_is_routed_around(
    forge_url, faults, metric, fault
):
    bad = faults.set_one(POOL, fault)
    retried_before = settled(lambda: retries(metric))
    answered_before = settled(lambda: answered(metric))
    served = drive(forge_url, 16)
    eventually(
        lambda: shunned_everywhere(f"chaos/{bad}"),
        timeout_s=10,
        what=f"the breaker of chaos/{bad} to be open on the board and in every gateway's copy",
        explain=lambda: (served, replica_admin.describe_breakers(APP)),
    )
    assert breaker_state("chaos") == 0, "the pool as a whole still serves"
    assert not any(s.endswith(f"/{bad}") for s in served), "nothing the bad replica said"
    rescued = sum(s.startswith("fallback/") for s in served)
    # Each gateway replica may send up to the threshold before the board's verdict reaches it;
    # after that only the half-open probes (one per 2 s cool-down) reach the bad replica.
    boards = replica_admin.describe_breakers(APP)
    probes = boards[f"chaos/{bad}"]["probes"]
    assert 1 <= rescued <= 2 * BREAKER_THRESHOLD + probes, (served, boards)
    later = drive(forge_url, 6)
    # Home on the good replica; at most one probe of the bad one per cool-down (2 s) between.
    assert sum(not s.startswith("chaos/") for s in later) <= 1, later
    rescued += sum(s.startswith("fallback/") for s in later)
    sent = len(served) + len(later)
    eventually(
        lambda: (
            answered(metric) - answered_before >= sent
            and retries(metric) - retried_before >= rescued
        ),
        timeout_s=15,
        what=f"the metrics to count all {sent} requests and at least {rescued} retries",
        explain=lambda: (answered(metric) - answered_before, retries(metric) - retried_before),
    )
    assert retries(metric) - retried_before == rescued, "one retry per rescued request, no more"


def test_a_ten_times_slower_replica_is_slow_not_failed(forge_url, faults):
    slow = faults.set_one(POOL, {"mode": "slow", "factor": 10})
    served = drive(forge_url, 8)
    # Nothing to wait for: a failure before the first byte is retried on the fallback (and would
    # show here), one after it fails ``drive``; the breakers have heard of no failure to open on.
    assert not any(s.startswith("fallback/") for s in served), served
    assert breaker_state(f"chaos/{slow}") == 0 and breaker_state("chaos") == 0


def test_a_replica_killed_mid_stream_ends_its_streams_honestly(forge_url, faults):
    doomed = faults.set_one(POOL, {"mode": "die_mid_stream", "after_frames": 3})
    cut = whole = 0
    for _ in range(8):
        response, events = ask(forge_url, stream=True, max_tokens=20)
        if response.status_code != 200:
            continue  # refused before its first byte: a clean error, nothing spliced
        assert_one_generation(events)
        if events and "error" in events[-1]:
            cut += 1
            assert response.headers.get("x-forge-replica") == doomed
            text = "".join(
                c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", [])
            )
            assert text, "the client kept what it had seen, and got an error, not a retry"
        else:
            whole += 1
    assert cut >= 1 and whole >= 1
    # Serve replaces the dead replica; the pool serves whole streams again.
    eventually(
        lambda: doomed not in replica_admin.replica_ids(APP, POOL),
        timeout_s=60,
        interval_s=0.5,
        what=f"Serve to remove the killed replica {doomed} from {POOL}",
    )


def test_a_long_healthy_answer_outlives_the_connect_and_first_token_timeouts(forge_url):
    """Connect (2 s) and first token (1 s) time the start only: a 3 s answer is not a hang,
    streamed or not (a non-streaming call once looked unassigned until it was done)."""
    for stream in (False, True):
        body = {
            "model": "forge-chaos",
            "messages": [{"role": "user", "content": "a long answer"}],
            "max_tokens": 800,  # ~3.2 s of decoding
            "ignore_eos": True,
            "stream": stream,
        }
        response = httpx.post(
            f"{forge_url}/v1/chat/completions", json=body, headers=AUTH, timeout=30
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-forge-backend"] == "chaos"
        if not stream:
            assert response.json()["usage"]["completion_tokens"] == 800
