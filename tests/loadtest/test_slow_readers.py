"""The slow-reader benchmark's own logic without a graph: its config admits every stream at once
and is still a valid Forge, and its table reads growth off the right samples."""

from __future__ import annotations

from loadtest import slow_readers
from loadtest.slow_readers import RssSample, RssWatch
from serve_app.config.live import serve_config_forge


def test_the_changed_config_fits_every_slow_stream_at_once_and_still_validates():
    config = serve_config_forge(slow_readers.slow_config(200, 2000))
    (primary,) = [p for p in config.pools if p.name == "primary"]
    assert primary.admission.max_inflight * primary.admission.max_tenant_share >= 200 + 4
    assert primary.engine.max_num_seqs >= 200  # on one replica, if the router sends them so
    blocks = primary.engine.num_kv_blocks * primary.engine.block_size
    assert blocks >= 200 * (2000 + 32)
    assert primary.deployment["max_ongoing_requests"] >= 200
    for tenant in config.tenants:
        assert tenant.limits.max_concurrent_streams >= 200
        assert tenant.limits.rpm >= 10_000


def test_growth_per_stream_is_the_peak_while_reading_over_the_baselines_end():
    watch = RssWatch.__new__(RssWatch)
    watch.samples = [
        RssSample(0, "baseline", {"gateway": 100.0}, {}, 0.0),
        RssSample(1, "baseline", {"gateway": 101.0}, {}, 0.0),
        RssSample(2, "filling", {"gateway": 140.0}, {}, 0.0),
        RssSample(3, "slow", {"gateway": 121.0}, {}, 0.0),
        RssSample(4, "after", {"gateway": 110.0}, {}, 0.0),
    ]
    (row,) = slow_readers.rss_table(watch, slow=100).values()
    assert (row["baseline_mib"], row["peak_mib"], row["after_mib"]) == (101.0, 140.0, 110.0)
    assert row["growth_per_slow_stream_kib"] == round(39 * 1024 / 100, 1)
