"""The running Forge a gate talks to: its address, the keys it was given, what it found there."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from evals.gate import Failed, Skipped
from evals.profile import Profile


@dataclass
class Target:
    base_url: str
    key: str  # the gate's own tenant (the victim in the isolation drill)
    profile: Profile
    admin_key: str | None = None
    # Where the operator's routes are (/admin/*): the admin listener on a cluster
    # (FORGE_ADMIN_PORT, docs/listeners.md); None: the base URL, as on a laptop.
    admin_url: str | None = None
    flood_key: str | None = None  # a second tenant that floods in the isolation drill
    quota_key: str | None = None  # a tenant with a small budget (default: the flood key)
    redis_url: str | None = None  # the gateway's Redis, for the Redis-loss drill
    model: str | None = None  # None: the first model Forge lists
    pool: str | None = None  # None: the pool serving ``model`` (from /admin/status)
    verbose: bool = False
    timeout_s: float = 60.0
    # Found by ``discover``:
    pool_names: list[str] = field(default_factory=list)
    store_kind: str | None = None
    fallback: str | None = None
    faults: bool = False  # whether the gateway takes POST /admin/faults (faults.enabled)
    primary_serving: bool = False

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.admin_url = (self.admin_url or self.base_url).rstrip("/")

    @property
    def admin_listener(self) -> bool:
        """Whether the operator's routes are on a listener of their own."""
        return self.admin_url != self.base_url

    def http(
        self, key: str | None = "default", *, admin: bool = False, **kwargs
    ) -> httpx.AsyncClient:
        """A client on the base URL (``admin``: the admin URL) with ``key`` (the gate's own by
        default; None: no key)."""
        key = self.key if key == "default" else key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(
            base_url=self.admin_url if admin else self.base_url,
            headers=headers,
            timeout=self.timeout_s,
            **kwargs,
        )

    def openai(self, key: str | None = None):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=key or self.key,
            max_retries=0,  # a retry would hide the very errors the gate looks for
            timeout=self.timeout_s,
        )

    def need_admin(self) -> str:
        if not self.admin_key:
            raise Skipped("needs --admin-key")
        return self.admin_key

    async def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        async with self.http(self.need_admin(), admin=True) as client:
            response = await client.request(method, path, **kwargs)
        if response.status_code != 200:
            raise Failed(f"{method} {path}: {response.status_code} {response.text[:200]}")
        return response

    def chat_body(self, content: str, max_tokens: int = 16, **extra) -> dict:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **extra,
        }

    async def discover(self) -> None:
        """The model, its pool, the store and whether the pool serves now. Raises ``Failed``
        when Forge cannot be reached or refuses the gate's key: no check could run."""
        async with self.http() as client:
            try:
                models = await client.get("/v1/models")
            except httpx.HTTPError as exc:
                raise Failed(f"cannot reach {self.base_url}: {exc!r}") from exc
            if models.status_code != 200:
                raise Failed(f"GET /v1/models: {models.status_code} {models.text[:200]}")
            listed = [m["id"] for m in models.json()["data"]]
            if self.model is None:
                if not listed:
                    raise Failed("GET /v1/models lists no model")
                self.model = listed[0]
        if self.admin_key:
            status = (await self.admin("GET", "/admin/status")).json()
            self.store_kind = status["store"]["kind"]
            self.fallback = status.get("fallback")
            self.faults = bool(status.get("faults"))
            self.pool_names = [p["name"] for p in status["pools"]]
            if self.pool is None:
                self.pool = next(
                    (p["name"] for p in status["pools"] if p["model"] == self.model), None
                )
        self.primary_serving = await self._primary_answers()

    async def _primary_answers(self) -> bool:
        """One request, uncached: did the model's pool answer it (not the fallback)?"""
        body = self.chat_body("gate: are you there?", max_tokens=4)
        async with self.http() as client:
            response = await client.post(
                "/v1/chat/completions", json=body, headers={"cache-control": "no-store"}
            )
        backend = response.headers.get("x-forge-backend")
        if self.pool is None and backend not in (None, "fallback"):
            self.pool = backend
        return response.status_code == 200 and backend is not None and backend != "fallback"

    def primary(self, backend: str | None) -> bool:
        if self.pool is not None:
            return backend == self.pool
        return backend not in (None, "fallback", "cache")
