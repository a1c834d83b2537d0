"""The timelapse figure: breaker bands from samples, and a PNG from results and events."""

from __future__ import annotations

import json

from loadtest import timelapse
from loadtest.traffic import DROPPED, Result, write_jsonl


def test_breaker_bands_run_from_the_first_non_closed_sample_to_the_next_closed_one():
    samples = [(0, "closed"), (1, "open"), (2, "half_open"), (3, "open"), (4, "closed")]
    assert timelapse.breaker_bands(samples, 10) == [(1, 4)]
    assert timelapse.breaker_bands([(0, "closed"), (5, "open")], 9) == [(5, 9)]
    assert timelapse.breaker_bands([], 9) == []


def results() -> list[Result]:
    out = []
    for i in range(60):
        t = i / 6
        backend = "fallback" if 4 <= t < 7 else "primary"
        out.append(Result("a", t, 200, backend, "miss", None, 0.05, 0.4, 10, 8, False, None))
    out.append(Result("a", 5.0, 503, None, None, None, None, 0.01, None, None, False, "http_503"))
    out.append(Result("a", 5.5, 200, "primary", None, None, 0.1, 0.2, 1, 1, True, "no_done"))
    out.append(Result("a", 6.0, 0, None, None, None, None, 0.0, None, None, False, DROPPED))
    return out


def test_render_writes_a_png(tmp_path):
    path = tmp_path / "img" / "t.png"
    timelapse.render(
        results(),
        path,
        title="t",
        faults=[(4.0, 7.0)],
        breaker=[(0.0, "closed"), (4.5, "open"), (7.5, "closed")],
        note="probes: [1]",
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reads_results_and_demo_events(tmp_path, capsys):
    write_jsonl(results(), tmp_path / "r.jsonl")
    events = {"events": {"faults": [[4, 7]], "breaker": [{"t": 4.5, "state": "open"}]}}
    (tmp_path / "demo.json").write_text(json.dumps(events))
    png = tmp_path / "r.png"
    timelapse.main([str(tmp_path / "r.jsonl"), str(png), "--events", str(tmp_path / "demo.json")])
    assert png.exists() and "wrote" in capsys.readouterr().out
