"""One short digest of a settings document, so a live change is applied once and named."""

from __future__ import annotations

import hashlib

import orjson


def settings_digest(*parts: object) -> str:
    """Stable across processes (sorted keys), 12 hex digits: enough to tell versions apart."""
    raw = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()[:12]
