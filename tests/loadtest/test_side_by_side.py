"""`loadtest.overhead --side-by-side`'s verdict: Forge against LiteLLM at issue 36's bar."""

from __future__ import annotations

from loadtest.overhead import side_by_side


def _row(path: str, c: int, ttft_ms: float, per_core: float) -> dict:
    return {
        "engine": "zero",
        "path": path,
        "concurrency": c,
        "ttft_p50_ms": ttft_ms,
        "req_per_s": per_core,
        "req_per_gateway_core_s": per_core,
    }


def test_the_verdict_is_issue_36s_bar_added_ttft_over_direct_and_requests_per_core():
    rows = [
        _row("direct", 1, 0.5, 0),
        _row("litellm", 1, 8.5, 40),  # adds 8 ms
        _row("forge-a", 1, 2.8, 300),  # adds 2.3 ms: 0.29×
        _row("forge-b", 1, 3.4, 300),  # adds 2.9 ms: 0.36×, which issue 12's 0.4× passed
        _row("forge-c", 1, 3.7, 300),  # adds 3.2 ms: 0.4×, over 3 ms
        _row("direct", 16, 5.0, 0),
        _row("litellm", 16, 200.0, 40),
        _row("forge-a", 16, 50.0, 320),  # 8×
        _row("forge-b", 16, 50.0, 300),  # 7.5×, which issue 12's 4× passed
    ]
    verdict = {(e["path"], e["concurrency"]): e["target_met"] for e in side_by_side(rows)}
    assert verdict == {
        ("forge-a", 1): True,
        ("forge-b", 1): False,
        ("forge-c", 1): False,
        ("forge-a", 16): True,
        ("forge-b", 16): False,
    }
