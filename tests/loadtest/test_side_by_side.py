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


def test_over_rounds_each_round_is_compared_within_itself_and_the_median_is_judged():
    def round_rows(number: int, litellm_ttft: float, forge_ttft: float, per_core: float) -> list:
        rows = [
            _row("direct", 1, 0.5, 0),
            _row("litellm", 1, litellm_ttft, 40),
            _row("forge", 1, forge_ttft, 300),
            _row("direct", 16, 5.0, 0),
            _row("litellm", 16, 200.0, 40),
            _row("forge", 16, 50.0, per_core),
        ]
        return [{**r, "round": number} for r in rows]

    rows = [
        # A slow round: both servers slower. Forge adds 4.5 ms (over 3 ms) at 0.3× LiteLLM's.
        *round_rows(0, 15.5, 5.0, 360),  # 9×
        *round_rows(1, 8.5, 2.5, 300),  # adds 2 ms: 0.25×; 7.5×
        *round_rows(2, 10.5, 2.7, 328),  # adds 2.2 ms: 0.22×; 8.2×
    ]
    entries = {e["concurrency"]: e for e in side_by_side(rows)}
    first = entries[1]
    assert first["added_ttft_p50_ms"] == 2.2  # the median of 4.5, 2, 2.2
    assert [round(r["added_ttft_ratio"], 2) for r in first["rounds"]] == [0.3, 0.25, 0.22]
    assert first["added_ttft_ratio"] == 0.25
    assert first["target_met"] is True  # one slow round does not decide it
    assert round(entries[16]["req_per_core_ratio"], 2) == 8.2  # median of 9, 7.5, 8.2
    assert entries[16]["target_met"] is True
    # Without the slow round's 9×, the median is 7.85×: missed.
    two = [r for r in rows if r["round"] != 0]
    assert {e["concurrency"]: e["target_met"] for e in side_by_side(two)} == {1: True, 16: False}
