import os

# Ray must keep its traffic on loopback on these machines; set before Ray is imported anywhere.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The mode configs/local.yaml runs in (gRPC between deployments, direct ingress); see
# docs/benchmarks.md. RAY_SERVE_THROUGHPUT_OPTIMIZED=0 runs the suite on Serve's defaults.
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
# And configs/local.yaml's hold on a stopping gateway replica (5 s, not Serve's 30): a test that
# replaces or deletes one waits as long as a laptop's `serve run` does (docs/listeners.md).
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")


import pytest


@pytest.fixture(autouse=True)
def _usage_ledger_of_its_own(tmp_path, monkeypatch):
    """Every gateway a test builds in process keeps its usage in that test's own SQLite file,
    never the user's (``~/.local/share/forge``) nor another test's. The graphs of the e2e
    session name theirs in their config (``tests/e2e/conftest.py``)."""
    from serve_app.metering import ledger

    monkeypatch.setattr(ledger, "DEFAULT_SQLITE_PATH", str(tmp_path / "usage.sqlite3"))


# The tests that start Ray (one graph per session) or drive one, the slow drills among them, run
# in one xdist worker, in turn, as they would without xdist; the rest run in the other.
_RAY_TESTS = ("tests/e2e/", "tests/vllm/")


def pytest_xdist_make_scheduler(config, log):
    """Two work units, by where a test lives. Not ``--dist loadgroup``: under pytest 9 its
    ``xdist_group`` marks do not reach the scheduler (xdist 3.8 sets ``item._nodeid``, which
    pytest 9 no longer reads), and the graph's tests were split between two Ray sessions."""
    from xdist.scheduler import LoadScopeScheduling

    class RayAndTheRest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.startswith(_RAY_TESTS) else "units"

    return RayAndTheRest(config, log)
