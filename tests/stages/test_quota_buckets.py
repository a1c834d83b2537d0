"""A tenant's budgets as buckets: what a request reserves, the 429 it gets, the headers."""

from __future__ import annotations

import math

import pytest

from serve_app.config.models import TenantConfig
from serve_app.errors import ForgeError
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.store import MemoryStore, TakeResult


def quota(**limits) -> TenantQuota:
    return TenantQuota.of(TenantConfig(name="acme", key_hashes=["a" * 64], limits=limits))


def test_buckets_refill_per_minute_and_burst_defaults_to_a_minute():
    q = quota(rpm=120, tpm=6000)
    assert q.requests.capacity == 120 and q.requests.refill_per_s == 2
    assert q.tokens.capacity == 6000 and q.tokens.refill_per_s == 100
    assert quota(rpm=60, burst_requests=5).requests.capacity == 5


def test_keys_share_a_hash_tag_so_one_take_covers_both_on_a_cluster():
    q = quota(rpm=1, tpm=1)
    assert "{acme}" in q.requests.key and "{acme}" in q.tokens.key


def test_no_limits_means_no_buckets():
    q = quota()
    assert q.unlimited
    assert q.plan(100) == ([], [])


def test_plan_takes_one_request_and_the_reserved_tokens():
    q = quota(rpm=10, tpm=1000)
    buckets, amounts = q.plan(250)
    assert buckets == [q.requests, q.tokens] and amounts == [1.0, 250.0]


def test_a_reservation_larger_than_the_bucket_is_a_400_that_says_why():
    with pytest.raises(ForgeError) as info:
        quota(tpm=500).check_fits(600, 100, 500)
    assert info.value.status == 400
    assert info.value.code == "request_exceeds_token_budget"
    assert "500" in info.value.message
    quota(tpm=500).check_fits(500, 100, 400)  # exactly fits: allowed


def test_refusal_names_the_limit_and_sets_retry_after_and_headers():
    q = quota(rpm=60, tpm=600)
    buckets, amounts = q.plan(300)
    refused = TakeResult(granted=False, remaining=(30.0, 120.0), retry_after_s=18.2)
    err = q.refused(buckets, amounts, refused)
    assert err.status == 429 and err.type == "tokens" and err.code == "rate_limit_exceeded"
    assert err.headers["retry-after"] == "19"
    assert err.headers["x-ratelimit-limit-tokens"] == "600"
    assert err.headers["x-ratelimit-remaining-tokens"] == "120"
    assert err.headers["x-ratelimit-remaining-requests"] == "30"
    # (600 - 120) tokens at 10/s until full.
    assert err.headers["x-ratelimit-reset-tokens"] == "48.000s"


def test_headers_never_show_negative_remaining():
    q = quota(tpm=600)
    headers = q.headers([q.tokens], (-40.0,))
    assert headers["x-ratelimit-remaining-tokens"] == "0"


async def test_reserve_then_settle_refunds_the_unused_part():
    """The arithmetic the quota stage runs: reserve prompt + max_tokens, settle to usage."""
    store = MemoryStore()
    q = quota(tpm=1000)
    buckets, amounts = q.plan(400)  # 100 prompt + max_tokens 300
    assert (await store.take(buckets, amounts)).granted
    level = await store.adjust(q.tokens, 400 - 160)  # the answer used 60 of its 300
    assert math.isclose(level, 1000 - 160, abs_tol=1)


async def test_overshoot_is_charged_as_debt():
    store = MemoryStore()
    q = quota(tpm=1000)
    assert (await store.take(*q.plan(1000))).granted
    level = await store.adjust(q.tokens, 1000 - 1100)  # usage beat the estimate by 100
    assert level < 0
    assert not (await store.take(*q.plan(1))).granted
