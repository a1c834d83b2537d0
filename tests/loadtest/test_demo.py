"""The demo's own logic without a graph: phases, the table, and refusing a busy port."""

from __future__ import annotations

import socket

from loadtest import demo
from loadtest.traffic import Result


def r(start, backend="primary", status=200, truncated=False, total=0.5):
    error = None if status == 200 and not truncated else f"http_{status}"
    return Result("alpha", start, status, backend, None, None, 0.1, total, 5, 9, truncated, error)


def test_phases_split_at_the_fault_and_the_clear():
    fault = [r(41, "fallback"), r(50, "fallback"), r(60, None, 503)]
    results = [r(1), r(10), *fault, r(81, "fallback"), r(83), r(90, truncated=True)]
    breakers = {"primary": {"probes": 3, "probes_per_half_open": [1, 1, 1]}}
    s = demo.summarize_demo(results, breakers, 40, 80)
    assert [s["phases"][p]["requests"] for p in ("before", "fault", "after", "all")] == [2, 3, 3, 8]
    assert s["phases"]["fault"]["by_backend"] == {"fallback": 2, "none": 1}
    assert s["phases"]["all"]["5xx"] == 1 and s["phases"]["all"]["client_visible_errors"] == 2
    assert s["probes"] == 3 and s["probes_per_half_open"] == [1, 1, 1]
    assert s["first_primary_after_clear_s"] == 3
    table = demo.markdown(s, 40, 80)
    assert "| all | 8 | 4 | 3 | 0 | 0 | 1 | 2 |" in table
    assert "3 probe(s)" in table


def test_port_answers_only_when_something_listens():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert demo.port_answers(f"http://127.0.0.1:{port}")
    assert not demo.port_answers(f"http://127.0.0.1:{port}")


def test_refuses_to_start_over_a_running_gateway(monkeypatch, capsys):
    monkeypatch.setattr(demo, "port_answers", lambda url: True)
    monkeypatch.setattr(demo, "start_graph", lambda log: (_ for _ in ()).throw(AssertionError))
    assert demo.main([]) == 2
    assert "already answers" in capsys.readouterr().err
