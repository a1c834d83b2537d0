"""One Ray instance and one Forge graph per test session, driven over real HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from loadtest import fairness, inprocess
from serve_app.replica import admin as replica_admin
from serve_app.tools import haproxy_loopback
from tests.polling import eventually
from tests.tools import forge_haproxy

APP = "forge"
ALPHA_KEY = "sk-test-alpha"
BETA_KEY = "sk-test-beta"
FALLBACK_KEY = "sk-test-upstream-secret"
ADMIN_KEY = "sk-test-admin"
METERED_POOL = "metered"  # its replicas and the mock fallback serve only the metering test
METERED_TENANT = "meter"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenant_key(name: str) -> str:
    return f"sk-test-{name}"


# Tenants with budgets for the quota tests; each test uses its own so they cannot interfere.
LIMITED_TENANTS = {
    # 10 requests, then one a minute: "exactly 10 admitted" holds for the test's duration.
    "shared": {"rpm": 1, "burst_requests": 10},
    "tokens": {"tpm": 600},
    "abandon": {"tpm": 60, "burst_tokens": 100_000},
    "streams": {"max_concurrent_streams": 2},
    "outage": {"rpm": 1, "burst_requests": 3},
    METERED_TENANT: {"tpm": 10_000_000},
    # The eval gate's tenants (tests/e2e/test_evals.py): its own, with a stream cap to watch,
    # and one with a small budget for its quota check.
    "gate": {"max_concurrent_streams": 8},
    "gate-quota": {"rpm": 1, "burst_requests": 5},
    # No budgets: the agent and the client matrix (test_agent.py, test_clients.py).
    "agents": {},
    # The fuzzer's and the hostile cases' own (test_fuzz.py, test_hostile.py): a stream cap and
    # a token bucket that refills slowly, so a leaked lease or reservation shows afterwards.
    "fuzz": {"tpm": 60, "burst_tokens": 1_000_000, "max_concurrent_streams": 4},
    "hostile": {"tpm": 60, "burst_tokens": 1_000_000, "max_concurrent_streams": 2},
    "hygiene": {},  # markers that must reach no log file or metric (test_log_hygiene.py)
}
ROUTED_POLICIES = ("prefix_affinity", "kv_aware")
# Tenants of the fair-admission pool: one floods, one is light.
FAIR_TENANTS = ("flood", "light")

# A GPU's feel (the fairness drill's engine): ~10 ms a step whatever the batch, ~20 ms prefill.
REALISTIC = fairness.ENGINE


SYNC_INTERVAL_S = 0.2  # how soon gateway replicas hear of a breaker change
BREAKER_THRESHOLD = 3
COLD_POOL = "cold"  # starts at zero replicas
GATEWAY = "gateway"  # the ingress deployment's name (serve_app/app.py)
# The e2e graphs' usage ledger: one file per test session (its gateway replicas share it).
LEDGER_PATH = os.path.join(tempfile.gettempdir(), f"forge-e2e-usage-{os.getpid()}.sqlite3")


def front_of_pool_app(pool: str, model: str, pool_app: str) -> dict:
    """A small gateway's args (alpha's key, the session's ledger) in front of one pool that runs
    as an application of its own (``pool_app``), for the drills that deploy both beside the
    session's graph."""
    return {
        "metering": {"sqlite_path": LEDGER_PATH},
        "tenants": [{"name": "alpha", "key_hashes": [_sha(ALPHA_KEY)]}],
        "pools": [{"name": pool, "model": model, "app": pool_app, "fallback": False}],
        "gateway": {"deployment": {"ray_actor_options": {"num_cpus": 0}}},
    }


def forge_args(port: int, redis_url: str | None) -> dict:
    fast = {"prefill_base_s": 0.002, "decode_base_s": 0.004, "max_num_seqs": 32}
    # Two gateway replicas when they can share Redis: budgets must hold across replicas.
    gateway = {"num_replicas": 2 if redis_url else 1, "ray_actor_options": {"num_cpus": 0}}
    return {
        "gateway": {"max_body_bytes": 64 * 1024, "deployment": gateway},
        "store": {"redis_url": redis_url, "key_prefix": "forge-e2e:"},
        # The session's own ledger, shared by its gateway replicas (never the user's file).
        "metering": {"sqlite_path": LEDGER_PATH},
        "faults": {"enabled": True},  # the drills and the admin tests inject faults
        "admin": {"key_hashes": [_sha(ADMIN_KEY)]},
        "tenants": [
            {"name": "alpha", "key_hashes": [_sha(ALPHA_KEY)]},
            {"name": "beta", "key_hashes": [_sha(BETA_KEY)]},
            *(
                {
                    "name": name,
                    "key_hashes": [_sha(tenant_key(name))],
                    "limits": limits,
                    # The outage test's tenant chose to be served unmetered while Redis is down
                    # (the default, a local share per gateway replica: tests/gateway).
                    **({"on_store_failure": "open"} if name == "outage" else {}),
                }
                for name, limits in LIMITED_TENANTS.items()
            ),
            *({"name": name, "key_hashes": [_sha(tenant_key(name))]} for name in FAIR_TENANTS),
        ],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": fast,
                # Bursts of 50 streams on 2 cores busy with the whole suite can take seconds
                # to be assigned; a connect timeout is not what the tests on this pool test.
                "connect_timeout_s": 15.0,
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            },
            {
                # Metering's ground truth: two replicas nobody else sends to, and the fallback.
                "name": METERED_POOL,
                "model": "forge-metered",
                "engine": fast,
                "routing": {"policy": "round_robin"},
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            },
            {
                # One replica, one slot, a queue of one, no fallback: for the failure statuses.
                "name": "solo",
                "model": "forge-solo",
                "engine": fast,
                "fallback": False,
                "first_token_timeout_s": 1.5,
                "request_timeout_s": 2.0,
                "deployment": {
                    "num_replicas": 1,
                    "max_ongoing_requests": 1,
                    "max_queued_requests": 1,
                    "ray_actor_options": {"num_cpus": 0},
                },
            },
            {
                # Fair admission in front of one replica: 8 slots (2 kept as headroom from any
                # one tenant), small per-tenant queues.
                "name": "fair",
                "model": "forge-fair",
                "engine": REALISTIC,
                "fallback": False,
                "admission": {
                    "max_inflight": 8,
                    "queue_cap": 4,
                    "deadline_s": 5,
                    "max_tenant_share": 0.75,
                },
                "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            },
            {
                # Scaled to zero: served by the fallback at once while a replica starts.
                "name": COLD_POOL,
                "model": "forge-cold",
                "engine": fast,
                "deployment": {
                    "autoscaling_config": {
                        "min_replicas": 0,
                        "initial_replicas": 0,
                        "max_replicas": 1,
                        "upscale_delay_s": 0,
                        "downscale_delay_s": 3600,  # once woken, it stays for the session
                    },
                    "ray_actor_options": {"num_cpus": 0},
                },
            },
            {
                # Chaos: two replicas with short timeouts, failing over to the fallback.
                "name": "chaos",
                "model": "forge-chaos",
                "engine": fast,
                "connect_timeout_s": 2.0,
                "first_token_timeout_s": 1.0,
                "idle_timeout_s": 1.0,
                "request_timeout_s": 5.0,  # a hung non-streaming call waits this long
                "routing": {"policy": "round_robin"},  # the bad replica gets its share
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            },
            {
                # /v1/embeddings for the client matrix (test_clients.py): never failed over.
                "name": "embed",
                "model": "forge-embed",
                "task": "embed",
                "engine": {**fast, "embedding_dim": 256},
                "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            },
            *(
                {
                    # Routing policies that keep a prompt prefix on the replica that has it.
                    "name": policy.replace("_", "-"),
                    "model": f"forge-{policy.replace('_', '-')}",
                    "engine": fast,
                    "fallback": False,
                    "routing": {"policy": policy, "stats_period_s": 0.2},
                    "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
                }
                for policy in ROUTED_POLICIES
            ),
        ],
        "resilience": {
            "sync_interval_s": SYNC_INTERVAL_S,
            "breaker": {"failure_threshold": BREAKER_THRESHOLD, "cooldown_s": 2.0},
            # Generous per-window floor: tests in a row must not starve each other of retries.
            "retry_budget": {"min_retries": 10},
        },
        "fallback": {
            "base_url": f"http://127.0.0.1:{port}/mock/v1",
            "model": "mock-gemini",
            "api_key_env": "FORGE_TEST_FALLBACK_KEY",
            "kinds": ["chat", "completion"],  # as configs/local.yaml's mock
        },
    }


class RedisServer:
    """A private redis-server the tests may stop and start (the machine's own is shared)."""

    def __init__(self) -> None:
        self.port = inprocess.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        eventually(
            self._answers_ping,
            timeout_s=10,
            interval_s=0.05,
            what=f"redis-server on port {self.port} to answer PING",
        )

    def _answers_ping(self) -> bool:
        try:
            return self._command(b"PING").startswith(b"+PONG")
        except OSError:
            return False

    def flush(self) -> None:
        """Empty it: every tenant's buckets start full again."""
        assert self._command(b"FLUSHALL").startswith(b"+OK")

    def _command(self, command: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
            s.sendall(command + b"\r\n")
            return s.recv(16)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server():
    if shutil.which("redis-server") is None:
        yield None  # the graph runs on the embedded store; Redis-only tests skip themselves
        return
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return inprocess.free_port()


@pytest.fixture(scope="session")
def serve_proxy(metrics_port) -> Iterator[str]:
    """The session's one Ray instance and Serve, with no application yet: Serve's proxy URL.
    The soak run alone (``.ci/run``, beside vLLM's tests) deploys its graph here, without the
    session's (~20 processes it would never call)."""
    import ray
    from ray import serve

    # Ray's workers inherit the driver's environment; a runtime_env would carry the key too,
    # but Ray's runtime_env agent writes every runtime_env, env_vars included, to its log.
    os.environ["FORGE_TEST_FALLBACK_KEY"] = FALLBACK_KEY
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    port = inprocess.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    # No serve.shutdown(): direct-ingress replicas are held 5 s each; the session is over anyway.
    ray.shutdown()


@pytest.fixture(scope="session")
def forge_url(serve_proxy, redis_server):
    """The session's graph (``forge_args``) and its mock fallback, behind Serve's proxy."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.mock_openai import build_mock

    serve.run(
        build_mock({"model": "mock-gemini", "api_key_env": "FORGE_TEST_FALLBACK_KEY"}),
        name="mock-fallback",
        route_prefix="/mock",
    )
    redis_url = redis_server.url if redis_server else None
    port = urlsplit(serve_proxy).port
    serve.run(build_app(forge_args(port, redis_url)), name=APP, route_prefix="/")
    # Every pool up (but the one at zero), not just the fallback.
    inprocess.wait_ready(
        serve_proxy, lambda up: all(v for name, v in up.items() if name != COLD_POOL)
    )
    yield serve_proxy


@pytest.fixture(scope="session")
def split_fronts(forge_url, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Forge's HAProxy as configs/gke.yaml runs it, with an admin port
    (``FORGE_ADMIN_PORT``): (the clients' URL, the operator's)."""
    replicas = [urlsplit(url) for url in replica_admin.direct_ingress_urls(APP)]
    if not replicas:
        pytest.skip("direct ingress is off")
    servers = [(url.hostname, url.port) for url in replicas]
    port = forge_haproxy.free_port()
    environ = {haproxy_loopback.ADMIN_PORT_SETTING: str(port)}
    directory = tmp_path_factory.mktemp("haproxy-split")
    with forge_haproxy.running(directory, servers, environ=environ) as url:
        yield url, f"http://127.0.0.1:{port}"


@pytest.fixture
def openai_client(forge_url):
    import openai

    with openai.OpenAI(base_url=f"{forge_url}/v1", api_key=ALPHA_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def faults(forge_url):
    """Set faults on replicas; every fault set in a test is cleared after it."""
    from serve_app.replica import admin as replica_admin

    touched: set[str] = set()

    class Faults:
        def set_all(self, deployment: str, spec: dict) -> list[str]:
            touched.add(deployment)
            return replica_admin.set_fault_all(APP, deployment, spec)

        def set_one(self, deployment: str, spec: dict) -> str:
            """Fault one replica (the first by id); returns its id."""
            touched.add(deployment)
            replica = replica_admin.replica_ids(APP, deployment)[0]
            replica_admin.set_fault(APP, deployment, replica, spec)
            return replica

    yield Faults()
    for deployment in touched:
        with contextlib.suppress(Exception):  # a replica a test killed may still be listed
            replica_admin.set_fault_all(APP, deployment, None)
    if touched:  # the next test starts with every backend trusted again
        # Every breaker the board knows: any state a gateway replica holds came from the board.
        known = list(replica_admin.describe_breakers(APP))
        replica_admin.reset_breakers(APP)
        eventually(
            lambda: breakers_closed_everywhere(known),
            timeout_s=30,  # a sync interval, on a busy machine (10 s once ran out)
            what="the board and every gateway replica's copy to show all breakers closed",
            explain=lambda: (replica_admin.breaker_states(APP), gateway_breaker_states(known)),
        )


def gateway_breaker_states(backends: Iterable[str]) -> list[dict[str, int]]:
    """Each gateway replica's own copy of these breakers: 0 closed, 1 half-open, 2 open. It is
    what its requests and its pools' routers act on, up to a sync interval behind the board.

    The copy lives in the gateway replica's process and nowhere else, so that is where this
    looks: Ray's ``__ray_call__`` runs a function on the replica's actor, and Serve's replica
    context holds the ``Gateway`` it serves. The function is defined in here so that it is
    pickled by value (the gateway's process cannot import the tests).
    """
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from serve_app.replica import admin as replica_admin

    def read_copy(_actor, backends: list[str]) -> dict[str, int]:
        from ray import serve

        breakers = serve.get_replica_context().servable_object.breakers
        return {b: int(breakers.state(b)) for b in backends}

    actors = [
        ray.get_actor(f"SERVE_REPLICA::{APP}#{GATEWAY}#{rid}", namespace=SERVE_NAMESPACE)
        for rid in replica_admin.replica_ids(APP, GATEWAY)
    ]
    backends = list(backends)
    return ray.get([a.__ray_call__.remote(read_copy, backends) for a in actors], timeout=10)


def breakers_closed_everywhere(backends: Iterable[str]) -> bool:
    """Nothing open or half-open on the board, nor in any gateway replica's copy of it."""
    from serve_app.replica import admin as replica_admin

    if replica_admin.breaker_states(APP):
        return False
    return not any(any(copy.values()) for copy in gateway_breaker_states(backends))


@pytest.fixture
def metric(metrics_port):
    """Sum of a Prometheus metric's series (optionally matching label fragments)."""

    def read(name: str, *labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(f"ray_{name}") and all(label in line for label in labels):
                total += float(line.rsplit(" ", 1)[1])
        return total

    return read
