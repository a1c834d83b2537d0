"""The interface the dispatch stage sees: every backend streams lists of ready items.

Items are SSE frames (``bytes``, passed to the client untouched) and metadata (``dict``:
``{"replica": id}``, ``{"usage": {...}}``) that the gateway consumes. Keeping one shape for Serve
handles and external HTTP means dispatch, failover and metering have a single code path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from serve_app.engines.base import Kind


class Backend(Protocol):
    name: str  # the ``backend`` label in metrics, logs and ``x-forge-backend``

    def stream(self, body: dict, kind: Kind, request_id: str) -> AsyncIterator[list]:
        """Stream a request. Raise ``ForgeError`` before the first item for a clean failure."""
        ...

    async def complete(self, body: dict, kind: Kind, request_id: str) -> dict:
        """Serve a non-streaming request: ``{"response": <OpenAI body>, "replica": id | None}``."""
        ...

    async def ready(self) -> bool:
        """Whether the backend can take a request now (for ``/readyz``)."""
        ...
