"""How the fallback client proves who it is upstream: one Authorization header per request.

Asked per request rather than fixed on the HTTP client because a workload-identity token
expires within the hour; a static key answers the same way so the client has one code path.
No credential's secret appears in a log line, an error message or a ``repr``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol

import httpx
import orjson

from serve_app import errors
from serve_app.config.models import FallbackConfig

logger = logging.getLogger("ray.serve")

# Refresh this long before the metadata token's expiry, so no request carries a token that
# dies in flight and one failed refresh still leaves a working token to serve on.
REFRESH_MARGIN_S = 300.0
# After a failed refresh, wait this long before the next try: a metadata server that is down
# then costs one request per interval its timeout, not every request.
RETRY_AFTER_S = 5.0


class Credentials(Protocol):
    async def headers(self) -> dict[str, str]:
        """The headers to add to the next upstream request; raise a 5xx ``ForgeError`` when
        there are none to give, so the gateway treats it as a failing backend."""
        ...

    async def aclose(self) -> None: ...


class NoCredentials:
    """An upstream that needs no credential (the local mock without a key)."""

    async def headers(self) -> dict[str, str]:
        return {}

    async def aclose(self) -> None:
        pass


class StaticKey:
    """A bearer API key from an environment variable (a mounted Kubernetes secret), read once
    at start so a missing secret stops the deployment instead of failing every request."""

    def __init__(self, env_var: str) -> None:
        key = os.environ.get(env_var, "").strip()
        if not key:
            raise RuntimeError(
                f"fallback.api_key_env: the environment variable {env_var} is unset or empty; "
                "it must hold the fallback's API key (or set fallback.auth to 'none')."
            )
        self.env_var = env_var
        self._headers = {"authorization": f"Bearer {key}"}

    async def headers(self) -> dict[str, str]:
        return self._headers

    async def aclose(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"StaticKey(env_var={self.env_var!r})"


class GcpMetadataToken:
    """An access token for the pod's Google service account, from the GCE/GKE metadata server.

    Cached until ``REFRESH_MARGIN_S`` before it expires. One caller refreshes at a time; callers
    that queued behind it take its outcome instead of each asking again. If a refresh fails
    while the cached token is still valid, that token keeps serving until it really expires.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self._clock = clock
        # The metadata server refuses requests without this header (a guard against SSRF), and
        # is link-local: a proxy from the environment could only get in the way.
        self._client = httpx.AsyncClient(
            headers={"metadata-flavor": "Google"},
            timeout=timeout_s,
            transport=transport,
            trust_env=False,
        )
        self._lock = asyncio.Lock()
        self._token: str | None = None
        self._expires_at = 0.0
        self._refresh_at = 0.0
        self._refreshes = 0  # finished refresh attempts, successful or not

    async def headers(self) -> dict[str, str]:
        if self._clock() >= self._refresh_at:
            seen = self._refreshes
            async with self._lock:
                if self._refreshes == seen:  # no refresh finished while this caller waited
                    await self._refresh()
        if self._token is None or self._clock() >= self._expires_at:
            raise errors.bad_gateway(
                "Fallback credentials unavailable: no token from the metadata server."
            )
        return {"authorization": f"Bearer {self._token}"}

    async def _refresh(self) -> None:
        started = self._clock()
        try:
            token, lifetime = await self._fetch()
        except (httpx.HTTPError, _BadAnswer) as exc:
            # httpx's text names the URL only; _BadAnswer's is ours and never quotes the body.
            logger.warning(
                "fallback credentials: metadata token refresh failed: %s: %s",
                type(exc).__name__,
                exc,
            )
            self._refresh_at = started + RETRY_AFTER_S
        else:
            self._token, self._expires_at = token, started + lifetime
            # Short-lived tokens (under twice the margin) are refreshed at half-life instead.
            self._refresh_at = started + max(lifetime - REFRESH_MARGIN_S, lifetime / 2)
        finally:
            self._refreshes += 1

    async def _fetch(self) -> tuple[str, float]:
        response = await self._client.get(self.url)
        if response.status_code != 200:
            raise _BadAnswer(f"HTTP {response.status_code}")
        try:
            body = orjson.loads(response.content)
            token, lifetime = body["access_token"], float(body["expires_in"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise _BadAnswer("malformed token response") from None
        if not isinstance(token, str) or not token or not lifetime > 0:
            raise _BadAnswer("malformed token response")
        return token, lifetime

    async def aclose(self) -> None:
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"GcpMetadataToken(url={self.url!r})"


class _BadAnswer(Exception):
    """The metadata server answered, but not with a token. Its message never quotes the body."""


def credentials_for(config: FallbackConfig) -> Credentials:
    """The credentials ``config.auth`` names, built (and checked) at start."""
    if config.auth == "api_key":
        assert config.api_key_env is not None  # the config validator guarantees it
        return StaticKey(config.api_key_env)
    if config.auth == "gcp_metadata":
        return GcpMetadataToken(config.metadata_url)
    return NoCredentials()
