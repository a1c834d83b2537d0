"""The concurrency benchmark's arithmetic without a server: added inter-token latency and TTFT
from the engine's stamps, the client's parsing of them, and the knee rule."""

from __future__ import annotations

import math
import time

from loadtest.concurrency import (
    StreamClock,
    StreamProtocol,
    Tally,
    knee,
    merge,
    percentile,
    rss_per_stream_kib,
)
from serve_app.engines.paced import ARRIVED, SENT, stamp


def test_added_itl_is_each_tokens_delay_less_the_previous_ones():
    tally = Tally(window=(0.0, 100.0))
    clock = StreamClock(tally, sent=10.0)
    clock.reached = 10.002  # the way in took 2 ms
    # The engine sends at 10.002 (at once), 10.202 and 10.402; the path adds 1, 1, then 7 ms.
    for emitted, arrival in ((10.002, 10.003), (10.202, 10.203), (10.402, 10.409)):
        clock.arrived(emitted, arrival)
    assert [round(v * 1000, 6) for v in tally.delay] == [1.0, 1.0, 7.0]
    assert [round(v * 1000, 6) for v in tally.added_itl] == [0.0, 6.0]
    # TTFT 3 ms at the client, 0 at the engine: all 3 added (2 in, 1 out).
    assert [round(v * 1000, 6) for v in tally.added_ttft] == [3.0]
    assert tally.tokens == 3


def test_only_tokens_arriving_in_the_window_count_but_the_first_token_always_does():
    tally = Tally(window=(5.0, 6.0))
    clock = StreamClock(tally, sent=1.0)
    clock.arrived(1.0, 1.001)  # before the window: its TTFT counts, its delay does not
    clock.arrived(5.0, 5.002)
    clock.arrived(6.0, 6.001)  # at the window's end: out
    assert tally.tokens == 1 and len(tally.delay) == 1
    assert [round(v * 1000, 6) for v in tally.added_itl] == [1.0]  # 2 ms after 1 ms
    assert len(tally.added_ttft) == 1


def _frame(text: str) -> bytes:
    return b'data: {"choices":[{"delta":{"content":"' + text.encode() + b'"}}]}\n\n'


def test_the_client_reads_stamps_split_across_reads_and_counts_a_refusal():
    tally = Tally(window=(0.0, math.inf))
    stream = StreamProtocol(b"", tally)
    stream.clock = StreamClock(tally, sent=0.0)
    body = _frame(stamp(ARRIVED, 0.5) + stamp(SENT, 0.5)) + _frame(stamp(SENT, 0.7))
    data = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body
    cut = len(data) - 12  # inside the second stamp
    stream.data_received(data[:cut])
    assert tally.tokens == 1
    stream.data_received(data[cut:])
    assert tally.tokens == 2 and not tally.errors
    assert stream.clock.reached == 0.5

    refused = Tally(window=(0.0, math.inf))
    stream = StreamProtocol(b"", refused)
    stream.clock = StreamClock(refused, sent=0.0)
    stream.data_received(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\n\r\n")
    assert refused.errors == {"http 429": 1}


def test_merge_reads_every_client_processes_values():
    one, two = Tally((0, 1)), Tally((0, 1))
    one.added_itl.extend([0.001, 0.002])
    two.added_itl.extend([0.003, 0.010])
    two.errors["closed by the server"] += 1
    merged = merge([one.as_dict(), two.as_dict()])
    assert merged["added_itl_p50_ms"] == 2.0
    assert merged["added_itl_p99_ms"] == 10.0
    assert merged["errors"] == 1 and merged["error_kinds"] == {"closed by the server": 1}
    assert math.isnan(merged["delay_p50_ms"])


def test_percentile_is_the_nearest_rank():
    values = sorted(range(1, 101))
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile([7.0], 99) == 7.0


def test_the_knee_is_the_first_step_over_5_ms_or_with_an_error():
    def row(streams: int, itl: float, errors: int = 0) -> dict:
        return {"streams": streams, "added_itl_p99_ms": itl, "errors": errors}

    assert knee([row(100, 1.0), row(500, 4.9), row(1000, 5.1), row(2000, 9.0)]) == 1000
    assert knee([row(500, 1.0, errors=1), row(100, 1.0)]) == 500
    assert knee([row(100, 1.0), row(500, float("nan"), errors=3)]) == 500
    assert knee([row(100, 1.0), row(500, 5.0)]) is None  # 5 ms itself is within the bound


def test_memory_per_stream_counts_the_streams_held_not_the_refused():
    assert rss_per_stream_kib(200.0, 100.0, streams=1000, errors=0) == 102.4
    assert rss_per_stream_kib(200.0, 100.0, streams=1000, errors=500) == 204.8


def test_each_hop_keeps_the_delay_of_the_stamps_that_reached_it_and_the_window_picks_them(
    tmp_path, monkeypatch
):
    from loadtest.concurrency import hop_table
    from serve_app import hop_delays

    monkeypatch.setattr(hop_delays, "DIR", str(tmp_path))
    now = time.monotonic()
    # A feed item's batch: two frames (one with the first token's arrival stamp) and usage.
    batch = [
        _frame(stamp(ARRIVED, now - 0.5) + stamp(SENT, now - 0.004)),
        _frame(stamp(SENT, now - 0.002)),
        {"usage": {"completion_tokens": 2}},
    ]
    hop_delays.note(hop_delays.FEED_OUT, batch)
    hop_delays.note(hop_delays.WRITTEN, _frame(stamp(SENT, now - 0.010)))
    hop_delays.flush()
    later = time.monotonic()
    hop_delays.note(hop_delays.WRITTEN, _frame(stamp(SENT, later - 0.5)))  # after the window
    hop_delays.flush()

    delays = hop_delays.read(tmp_path, now - 1, later)
    assert sorted(delays) == sorted([hop_delays.FEED_OUT, hop_delays.WRITTEN])
    # Only the engine's send stamps count, each with its age when noted: its offset from `now`
    # plus however long this test took to note it (on a busy machine, a millisecond or more).
    late_ms = (time.monotonic() - now) * 1000
    for hop, offsets_ms in ((hop_delays.FEED_OUT, (2, 4)), (hop_delays.WRITTEN, (10,))):
        ages_ms = sorted(d * 1000 for d in delays[hop])
        assert len(ages_ms) == len(offsets_ms), (hop, ages_ms)
        assert all(o <= a <= o + late_ms for o, a in zip(offsets_ms, ages_ms, strict=True)), (
            hop,
            ages_ms,
        )

    hops = hop_table(delays, {"delay_p50_ms": 11.0, "delay_p99_ms": 12.0})
    assert list(hops) == [hop_delays.FEED_OUT, hop_delays.WRITTEN, "client"]  # the path's order
    assert hops[hop_delays.FEED_OUT]["frames"] == 2
    assert hops["client"] == {"p50_ms": 11.0, "p99_ms": 12.0}
