"""A tenant's budgets as store buckets: what a request reserves, and the headers that tell it.

Requests and tokens are two token buckets per tenant, refilled continuously (``rpm / 60`` and
``tpm / 60`` per second) up to their burst. A request reserves ``prompt_tokens + max_tokens``
up front, because the answer's length is unknown until it ends; it settles to the real usage
when it does. Bucket keys carry the tenant in a ``{hash tag}`` so one atomic take covers both
buckets even on a Redis Cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serve_app import errors
from serve_app.config.models import TenantConfig
from serve_app.store import Bucket, TakeResult


@dataclass(frozen=True, slots=True)
class TenantQuota:
    tenant: str
    requests: Bucket | None
    tokens: Bucket | None
    rpm: int | None
    tpm: int | None
    max_streams: int | None

    @classmethod
    def of(cls, tenant: TenantConfig, share: float = 1.0) -> TenantQuota:
        """The tenant's budgets; with ``share`` < 1, that fraction of each (one gateway
        replica's part while the shared store is unreachable), never below one request, one
        stream, or a burst of tokens one request could not fit."""
        limits = tenant.limits
        tag = "{" + tenant.name + "}"
        requests = tokens = None
        rpm = tpm = None
        if limits.rpm:
            burst = limits.burst_requests or limits.rpm
            rpm = max(1, math.floor(limits.rpm * share))
            requests = Bucket(f"quota:{tag}:requests", max(1.0, burst * share), rpm / 60)
        if limits.tpm:
            burst = limits.burst_tokens or limits.tpm
            tpm = max(1, math.floor(limits.tpm * share))
            tokens = Bucket(f"quota:{tag}:tokens", max(1.0, burst * share), tpm / 60)
        streams = limits.max_concurrent_streams
        if streams is not None:
            streams = max(1, math.floor(streams * share))
        return cls(tenant.name, requests, tokens, rpm, tpm, streams)

    @property
    def unlimited(self) -> bool:
        return self.requests is None and self.tokens is None and self.max_streams is None

    @property
    def stream_key(self) -> str:
        return f"streams:{{{self.tenant}}}"

    def plan(self, reserve_tokens: int) -> tuple[list[Bucket], list[float]]:
        buckets, amounts = [], []
        if self.requests is not None:
            buckets.append(self.requests)
            amounts.append(1.0)
        if self.tokens is not None:
            buckets.append(self.tokens)
            amounts.append(float(reserve_tokens))
        return buckets, amounts

    def check_fits(self, reserve_tokens: int, prompt_tokens: int, max_tokens: int) -> None:
        """A reservation larger than the bucket could never be granted: say so, don't 429."""
        if self.tokens is None or reserve_tokens <= self.tokens.capacity:
            return
        budget = f"tenant {self.tenant}'s token budget can ever hold ({int(self.tokens.capacity)})"
        if max_tokens == 0:  # an embedding: its input is all it reserves
            raise errors.invalid_request(
                f"This request's input is about {prompt_tokens} tokens, more than {budget}. "
                "Send fewer or shorter inputs.",
                param="input",
                code="request_exceeds_token_budget",
            )
        raise errors.invalid_request(
            f"This request reserves {reserve_tokens} tokens (about {prompt_tokens} prompt "
            f"tokens + max_tokens {max_tokens}), more than {budget}. Lower max_tokens or "
            "shorten the prompt.",
            param="max_tokens",
            code="request_exceeds_token_budget",
        )

    def headers(self, buckets: list[Bucket], levels: tuple[float, ...]) -> dict[str, str]:
        """``x-ratelimit-*`` headers in OpenAI's shape, from bucket levels after the take."""
        out: dict[str, str] = {}
        for bucket, level in zip(buckets, levels, strict=True):
            kind = "requests" if bucket is self.requests else "tokens"
            limit = self.rpm if kind == "requests" else self.tpm
            reset = (bucket.capacity - level) / bucket.refill_per_s if bucket.refill_per_s else 0
            out[f"x-ratelimit-limit-{kind}"] = str(limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            out[f"x-ratelimit-reset-{kind}"] = f"{max(0.0, reset):.3f}s"
        return out

    def refused(
        self, buckets: list[Bucket], amounts: list[float], result: TakeResult
    ) -> errors.ForgeError:
        """The 429 for a refused take: which limit, when to retry, and the usual headers."""
        short = [
            "requests" if b is self.requests else "tokens"
            for b, a, level in zip(buckets, amounts, result.remaining, strict=True)
            if level + 1e-9 < a
        ] or ["requests"]
        kind = short[0]
        limit = self.rpm if kind == "requests" else self.tpm
        retry = max(1, math.ceil(result.retry_after_s))
        headers = {"retry-after": str(retry), **self.headers(buckets, result.remaining)}
        return errors.rate_limited(
            f"Rate limit reached for tenant {self.tenant} on {kind} per minute: limit {limit}. "
            f"Try again in {retry}s.",
            kind=kind,
            headers=headers,
        )

    def too_many_streams(self, holders: int) -> errors.ForgeError:
        return errors.rate_limited(
            f"Tenant {self.tenant} has {holders} requests in flight, its limit is "
            f"{self.max_streams}. Retry when one ends.",
            kind="concurrent_requests",
            headers={"retry-after": "1"},
        )
