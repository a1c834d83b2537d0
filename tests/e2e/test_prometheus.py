"""Forge's counters as an operator's Prometheus reads them: scraped from Ray's metrics port and
summed over the gateway replicas that counted them.

A real Prometheus (Debian's package; the test skips where there is none) scrapes the session
graph's metrics port every 2 s, as ``scripts/prometheus-local.sh`` does on a laptop through
the target list Ray writes. Prometheus runs on 127.0.0.1, keeps its data in the test's temporary
directory and is stopped however the test ends.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import httpx
import pytest

from loadtest import inprocess
from tests.e2e.conftest import APP, BETA_KEY
from tests.polling import eventually

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="no `prometheus` binary (Debian: apt-get install prometheus; .ci/run installs it)",
    ),
]

# Tenant "beta" (BETA_KEY) is in the session graph, and no other test sends as it: every request
# Prometheus counts for it is one of this test's, so the count must be exactly what was sent.
TENANT = "beta"
REQUESTS = 12
BODY = {"model": "forge-sim", "messages": [{"role": "user", "content": "count"}], "max_tokens": 4}


class Prometheus:
    """One Prometheus process scraping one target every second."""

    def __init__(self, workdir: Path, target: str) -> None:
        assert PROMETHEUS is not None
        self.url = f"http://127.0.0.1:{inprocess.free_port()}"
        self.log = workdir / "prometheus.log"
        config = workdir / "prometheus.yml"
        config.write_text(
            # Ray's metrics port answers every series of the session's graph: on 2 busy cores a
            # scrape can outlast 1 s, and Prometheus then records it as down.
            "global: {scrape_interval: 2s, scrape_timeout: 2s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: ray\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}): {self.tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> dict[str, float]:
        """An instant query's samples by their ``replica`` label ("" for a sample without one)."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        answer.raise_for_status()
        return {
            sample["metric"].get("replica", ""): float(sample["value"][1])
            for sample in answer.json()["data"]["result"]
        }

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def prometheus(metrics_port, tmp_path):
    server = Prometheus(tmp_path, f"127.0.0.1:{metrics_port}")
    try:
        eventually(
            server.ready,
            timeout_s=30,
            interval_s=0.2,
            what="Prometheus to answer /-/ready",
            explain=server.tail,
        )
        yield server
    finally:
        server.stop()


def gateway_entry_points(forge_url: str) -> list[tuple[str, str]]:
    """``(replica id, url)`` of each gateway replica's own port (direct ingress); without
    direct ingress, only Serve's proxy (``("", forge_url)``), which spreads over the replicas."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return [
        (target["name"].rsplit("#", 1)[-1], f"http://{target['ip']}:{target['port']}")
        for group in details.get("target_groups", [])
        if group.get("app_name") == APP and group.get("protocol", "HTTP") == "HTTP"
        for target in group.get("targets", [])
        if target["name"].startswith(f"SERVE_REPLICA::{APP}#")
    ] or [("", forge_url)]


def test_prometheus_counts_every_request_across_gateway_replicas(forge_url, prometheus):
    eventually(
        lambda: prometheus.query('up{job="ray"} == 1'),
        timeout_s=30,
        what="Prometheus to scrape Ray's metrics port",
        explain=prometheus.tail,
    )
    by_replica = f'sum by (replica) (ray_forge_requests_total{{tenant="{TENANT}"}})'
    assert prometheus.query(by_replica) == {}, (
        f"requests of tenant {TENANT} counted before this test sent any: another test sends "
        "as it; give this test a tenant of its own"
    )

    entries = gateway_entry_points(forge_url)
    sent: Counter[str] = Counter()
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {BETA_KEY}"}) as client:
        for i in range(REQUESTS):
            replica, url = entries[i % len(entries)]
            answer = client.post(f"{url}/v1/chat/completions", json=BODY)
            assert answer.status_code == 200, answer.text
            sent[replica] += 1

    total = f'sum(ray_forge_requests_total{{tenant="{TENANT}"}})'
    eventually(
        lambda: prometheus.query(total) == {"": REQUESTS},
        timeout_s=60,
        interval_s=0.5,
        what=f"Prometheus to count {REQUESTS} requests of tenant {TENANT}",
        explain=lambda: (prometheus.query(by_replica), dict(sent)),
    )
    if "" not in sent:  # sent to each replica's own port: each replica's series has its share
        assert prometheus.query(by_replica) == sent
