"""Token counting's own budget: ``/v1/messages/count_tokens`` and ``/v1/responses/input_tokens``.

Counting generates nothing, so it takes nothing from a tenant's budgets (Anthropic's own
endpoint has limits of its own, apart from message creation's). It does spend this gateway
replica's CPU: a megabyte of text is about 0.1 s of tokenizing, on the event loop every other
tenant's requests share, and unlimited it let one tenant slow every other (measured: another
tenant's ``/v1/models`` from 4 ms to 165 ms p50). So a tenant counts at its requests/min, held
by each gateway replica to its share of it, in memory: no store round trip for a call that
costs the store nothing. A tenant with no requests/min counts unlimited, as it asks unlimited.
"""

from __future__ import annotations

from dataclasses import replace

from starlette.responses import Response

from serve_app.config.models import TenantConfig
from serve_app.pipeline import Handler, RequestContext
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.store import MemoryStore


class CountingLimit:
    def __init__(self, tenants: list[TenantConfig], share: float) -> None:
        self.quotas = {t.name: TenantQuota.of(t, share=share) for t in tenants}
        self.store = MemoryStore()

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        quota = self.quotas.get(ctx.tenant_name)
        if quota is None or quota.requests is None:
            return await call_next(ctx)
        bucket = replace(quota.requests, key="counting:" + quota.requests.key)
        taken = await self.store.take([bucket], [1.0])
        if not taken.granted:
            raise quota.refused([bucket], [1.0], taken)
        return await call_next(ctx)
