"""loadtest.vllm_routing's arithmetic: vLLM's counters per replica, the hit rate, the index's
agreement with them and the margins of its table (the run itself needs vLLM: .ci/vllm)."""

from __future__ import annotations

import json

import pytest

from loadtest.vllm_routing import (
    agreement,
    counter_deltas,
    hit_rate,
    kv_bytes_per_token,
    margins,
    per_target,
    run_order,
)


def stats(replica: str, queries: int, hits: int) -> dict:
    return {"replica": replica, "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def test_each_replicas_counters_over_the_run():
    before = [stats("a", 1_000, 200), stats("b", 500, 0)]
    after = [stats("a", 4_000, 2_200), stats("b", 2_500, 640), stats("c", 300, 32)]

    assert counter_deltas(before, after) == {
        "a": {"prefix_cache_queries": 3_000, "prefix_cache_hits": 2_000},
        "b": {"prefix_cache_queries": 2_000, "prefix_cache_hits": 640},
        "c": {"prefix_cache_queries": 300, "prefix_cache_hits": 32},  # started during the run
    }


def test_the_hit_rate_is_hit_tokens_over_queried_tokens():
    assert hit_rate(2_640, 5_000) == pytest.approx(0.528)
    assert hit_rate(0, 0) is None  # no request, no rate (not 0 %)


def test_an_index_that_expected_exactly_what_each_replica_found_agrees_fully():
    result = agreement({"a": 2_000.0, "b": 640.0}, {"a": 2_000, "b": 640})

    assert result["expected_over_hits"] == 1.0
    assert result["misplaced_share"] == 0.0
    assert result["per_replica"]["b"] == {"index_expected_tokens": 640.0, "vllm_hit_tokens": 640}


def test_hits_expected_on_the_wrong_replica_are_misplaced_though_the_sums_agree():
    # The index sent a cached prompt to "a", but vLLM found its blocks on "b".
    result = agreement({"a": 1_000.0}, {"a": 500, "b": 500})

    assert result["expected_over_hits"] == 1.0
    assert result["misplaced_share"] == 1.0  # |1000 - 500| + |0 - 500| over 1000 hits


def test_no_hits_leaves_the_ratios_undefined():
    result = agreement({"a": 64.0}, {"a": 0})

    assert result["expected_over_hits"] is None and result["misplaced_share"] is None
    assert result["index_expected_tokens"] == 64.0


def test_a_counter_per_target_from_prometheus_text():
    text = "\n".join(
        [
            "# TYPE ray_forge_route_index_hit_tokens_total counter",
            'ray_forge_route_index_hit_tokens_total{pool="tiny",target="r1"} 640.0',
            'ray_forge_route_index_hit_tokens_total{pool="tiny",target="r2"} 32.0',
            'ray_forge_route_index_hit_tokens_total{pool="other",target="r1"} 64.0',
            'ray_forge_route_index_hit_tokens_total_other{target="r1"} 9.0',
        ]
    )

    assert per_target(text, "ray_forge_route_index_hit_tokens_total") == {
        "r1": 704.0,
        "r2": 32.0,
    }


def row(policy: str, hits: int, queries: int, p50: float, p95: float) -> dict:
    return {
        "policy": policy,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "ttft_p50_ms": p50,
        "ttft_p95_ms": p95,
    }


def test_margins_say_kv_awares_lead_in_points_and_as_a_ttft_ratio():
    rows = [row("kv_aware", 800, 1_000, 50.0, 100.0), row("round_robin", 300, 1_000, 100.0, 150.0)]

    assert margins(rows) == {"hit_rate_points": 50.0, "ttft_p50_ratio": 2.0, "ttft_p95_ratio": 1.5}
    assert margins(rows[:1]) == {}  # one policy alone: nothing to compare


def test_over_rounds_hit_rates_pool_the_counters_and_ttft_takes_the_median():
    rows = [
        row("kv_aware", 900, 1_000, 40.0, 90.0),
        row("round_robin", 200, 1_000, 90.0, 140.0),
        row("round_robin", 400, 1_000, 110.0, 160.0),
        row("kv_aware", 700, 3_000, 60.0, 110.0),
    ]

    # kv_aware 1600 / 4000 = 40 %, round robin 600 / 2000 = 30 %: 10 points.
    assert margins(rows) == {"hit_rate_points": 10.0, "ttft_p50_ratio": 2.0, "ttft_p95_ratio": 1.5}


def test_rounds_alternate_the_order_so_drift_weighs_on_both():
    policies = ["kv_aware", "round_robin"]

    assert run_order(policies, 1) == policies
    assert run_order(policies, 2) == ["kv_aware", "round_robin", "round_robin", "kv_aware"]


def test_the_kv_cache_is_sized_in_tokens_of_the_models_own_kv(tmp_path):
    # The tiny model's shape (serve_app/tools/tiny_model.py): 1 KiB of K and V a token in fp32.
    config = {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    assert kv_bytes_per_token(str(tmp_path)) == 1024

    # No head_dim: hidden size over attention heads, as transformers' Llama has it.
    small = {"num_hidden_layers": 6, "num_key_value_heads": 2, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({**small, "num_attention_heads": 4}))
    assert kv_bytes_per_token(str(tmp_path)) == 6 * 2 * 64 * 2 * 4
