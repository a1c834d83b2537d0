"""ForgeMetrics.record: the SLIs a rollout gate reads, from one request's outcome."""

from __future__ import annotations

import pytest

from serve_app.metering.ledger import UsageRecord
from serve_app.metrics import ForgeMetrics
from tests.doubles import Counter

SERIES = ("requests", "ttft", "tpot", "duration", "truncated", "tokens", "estimated")


@pytest.fixture
def metrics() -> ForgeMetrics:
    metrics = ForgeMetrics()
    for name in SERIES:  # read what would be exported
        setattr(metrics, name, Counter())
    return metrics


def record(metrics: ForgeMetrics, **overrides) -> None:
    fields = {
        "tenant": "acme",
        "route": "chat",
        "model": "forge-sim",
        "backend": "primary",
        "status": 200,
        "ttft_s": 0.1,
        "duration_s": 1.1,
        "usage": {"prompt_tokens": 7, "completion_tokens": 11},
    }
    metrics.record(**{**fields, **overrides})


def test_a_stream_gives_ttft_tpot_and_duration_by_model(metrics):
    record(metrics)
    tags = {"route": "chat", "model": "forge-sim", "backend": "primary"}
    assert metrics.requests.calls == [{"tenant": "acme", "status": "200", **tags}]
    assert metrics.ttft.values == [0.1] and metrics.ttft.calls == [tags]
    assert metrics.tpot.values == [pytest.approx(0.1)]  # 1.0 s over the 10 tokens after the first
    assert metrics.duration.values == [1.1]
    assert metrics.truncated.calls == []
    assert metrics.tokens.calls == []  # tokens are metering's: one record, two views


def test_a_usage_record_counts_tokens_by_kind_and_an_estimate_apart(metrics):
    counts = {"requests": 1, "prompt_tokens": 7, "completion_tokens": 11, "cached_tokens": 0}
    metrics.meter(UsageRecord("acme", "forge-sim", "2026-11-30", counts))
    kinds = [call["kind"] for call in metrics.tokens.calls]
    assert dict(zip(kinds, metrics.tokens.values, strict=True)) == {"prompt": 7, "completion": 11}
    assert metrics.estimated.calls == []  # requests: forge_requests_total counts them already
    metrics.meter(UsageRecord("acme", "forge-sim", "2026-11-30", {"estimated_requests": 1}))
    assert metrics.estimated.calls == [{"tenant": "acme", "model": "forge-sim"}]


def test_a_truncated_stream_is_counted_apart_from_a_client_leaving(metrics):
    record(metrics, status=599)
    record(metrics, status=499)
    assert metrics.truncated.calls == [{"model": "forge-sim", "backend": "primary"}]


@pytest.mark.parametrize(
    "usage",
    [None, {}, {"completion_tokens": 1}, {"completion_tokens": "11"}, {"prompt_tokens": -3}],
)
def test_no_tpot_or_tokens_from_missing_single_token_or_untrusted_usage(metrics, usage):
    record(metrics, usage=usage)
    assert metrics.tpot.calls == []
    assert all(v > 0 for v in metrics.tokens.values)


def test_a_whole_answer_has_a_duration_but_no_ttft_or_tpot(metrics):
    """Its first byte is its last: as TTFT it read as slow as the answer, and its tokens, all
    before it, as a TPOT of nothing (the live panels: TTFT p50 172 ms, TPOT p50 0.7 ms)."""
    record(metrics, streamed=False)
    assert metrics.ttft.calls == [] and metrics.tpot.calls == []
    assert metrics.duration.values == [1.1] and len(metrics.requests.calls) == 1


def test_an_error_before_any_byte_has_no_ttft(metrics):
    record(metrics, status=401, ttft_s=None, usage=None, model="none", backend="none")
    assert metrics.ttft.calls == [] and metrics.tpot.calls == []
    assert metrics.requests.calls[0]["status"] == "401"
