"""Schemathesis against the gateway's own OpenAPI schema, on the real graph.

Every operation of ``/openapi.json`` (the inference routes, ``/v1/usage``, the admin API) gets
schema-valid and schema-invalid inputs, each sent over HTTP to the session's graph with the key
its route takes: the ``fuzz`` tenant's for ``/v1/*``, the admin key for ``/admin/*``. What must
hold for every case: no 5xx, no hang, a status the schema documents, a body that matches it,
and every 4xx in OpenAI's shape. Afterwards the gateway still serves, no breaker is left open,
and the fuzz tenant has its whole stream cap and exactly the token budget its metered usage
leaves.

Bounded for CI: 20 examples per operation and mode, derandomized, so a run is the same run
every time (~20 s on the 2-core machine, once the graph is up). ``FORGE_FUZZ_EXAMPLES=500``
runs a longer pass; ``-s`` prints the cases and statuses per operation, and
``FORGE_FUZZ_REPORT=path.json`` writes them with the 4xx by error code. Hypothesis derives its
derandomized cases from the test function, so an edit to ``one_case`` draws other cases.

Two operations change the session graph's shared state, and are fuzzed so that they cannot:

- ``POST /admin/faults`` injects a fault (crash, hang, ...) on every replica of a pool, which
  every later test would then meet. Every case's ``pool`` is pointed at a pool that does not
  exist, so its body is still validated field by field (400s) and the lookup answers (404),
  but no replica is ever reached.
- ``POST /admin/breakers/reset`` only closes breakers; on a graph the fuzz faults nothing there
  is none to close, so it runs as generated, and the check afterwards shows none open.

The throttle on wrong keys (``serve_app/auth/throttle.py``) counts every wrong key from this
address, so Schemathesis' own ``ignored_auth`` probes (a wrong key after every 2xx) are off;
each secured operation is asked once without a key and once with a wrong one instead.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import ignored_auth, response_schema_conformance

from tests.e2e.conftest import ADMIN_KEY, tenant_key
from tests.e2e.test_hostile import Books, assert_openai_error, assert_tenant_whole, openai_error

pytestmark = pytest.mark.e2e

TENANT = "fuzz"
EXAMPLES = int(os.environ.get("FORGE_FUZZ_EXAMPLES", "20"))
REPORT = os.environ.get("FORGE_FUZZ_REPORT")
NO_SUCH_POOL = "fuzz-no-such-pool"
# The served model a generated body is pointed at (three cases in four: the rest keep their
# generated name, an unknown model's 404); never the metered pool nor the fallback's own model,
# whose counts other tests read, nor the cold pool, which would wake.
SERVED_MODEL = {
    "/v1/chat/completions": "forge-sim",
    "/v1/completions": "forge-sim",
    "/v1/embeddings": "forge-embed",
    "/v1/responses": "forge-sim",
    "/v1/messages": "forge-sim",
    "/v1/messages/count_tokens": "forge-sim",
}
CASE_TIMEOUT_S = 20.0  # a case not answered by then is a hang
# What the fuzz finds today, each a gateway bug to fix: (method, path, mode) → the reason. The
# xfail is strict: once the bug is fixed the run passes, the test fails, and its line goes.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}
# Every operation of the schema (test_the_operations_are_the_schemas keeps this list honest).
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/responses/input_tokens"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/v1/usage"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/status"),
    ("GET", "/admin/breakers"),
    ("POST", "/admin/breakers/reset"),
    ("POST", "/admin/faults"),
]


def _auth(path: str) -> dict[str, str]:
    if path.startswith("/admin/"):
        return {"authorization": f"Bearer {ADMIN_KEY}"}
    if path.startswith("/v1/"):
        return {"authorization": f"Bearer {tenant_key(TENANT)}"}
    return {}  # /healthz, /readyz


def anthropic_error(content_type: str, content: bytes) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``: every error of the Messages routes."""
    assert content_type.startswith("application/json"), (content_type, content[:300])
    body = json.loads(content)
    assert body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), error
    assert "Traceback" not in error["message"], error
    return {"code": error["type"]}


def assert_named_events(content: bytes, last: set[str]) -> None:
    """A Responses or Messages stream: every event named, its data JSON of that type, and it
    ends with one of ``last`` (the answer's end, or the error that ends it)."""
    events = [e for e in content.decode().split("\n\n") if e.strip()]
    assert events, content[:300]
    kinds = []
    for event in events:
        lines = dict(line.split(": ", 1) for line in event.splitlines())
        assert json.loads(lines["data"])["type"] == lines["event"], event
        kinds.append(lines["event"])
    assert kinds[-1] in last, kinds


def assert_sse(content: bytes) -> None:
    """Every event a JSON chunk (or an OpenAI-shaped error that ends it), then ``[DONE]``."""
    events = [line[6:] for line in content.decode().splitlines() if line.startswith("data: ")]
    assert events, content[:300]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event
    if events[-1] != "[DONE]":
        assert "error" in json.loads(events[-1]), f"a stream that ends without [DONE]: {events}"
        openai_error("application/json", events[-1].encode())


class FuzzLog:
    """Cases sent and statuses answered, per operation: what the README and the benchmarks
    page report of a run."""

    def __init__(self) -> None:
        self.statuses: dict[str, Counter[int]] = defaultdict(Counter)
        self.modes: dict[str, Counter[str]] = defaultdict(Counter)
        self.codes: dict[str, Counter[str]] = defaultdict(Counter)  # the 4xx, by error code
        self.started = time.monotonic()

    def record(self, label: str, mode: str, status: int, code: str | None) -> None:
        self.statuses[label][status] += 1
        if code is not None:
            self.codes[label][f"{status} {code}"] += 1
        self.modes[label][mode] += 1

    def table(self) -> str:
        rows = [
            "| operation | cases | positive / negative | statuses |",
            "| --- | ---: | ---: | --- |",
        ]
        for label in sorted(self.statuses):
            statuses, modes = self.statuses[label], self.modes[label]
            seen = ", ".join(f"{s} ×{n}" for s, n in sorted(statuses.items()))
            rows.append(
                f"| `{label}` | {statuses.total()} | "
                f"{modes['positive']} / {modes['negative']} | {seen} |"
            )
        total = sum(c.total() for c in self.statuses.values())
        rows.append(f"| all | {total} | | |")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {
            "examples": EXAMPLES,
            "seconds": round(time.monotonic() - self.started, 1),
            "operations": {
                label: {
                    "statuses": dict(self.statuses[label]),
                    "modes": dict(self.modes[label]),
                    "errors": dict(self.codes[label]),
                }
                for label in sorted(self.statuses)
            },
        }


@pytest.fixture(scope="module")
def fuzz_log() -> Iterator[FuzzLog]:
    log = FuzzLog()
    yield log
    if log.statuses:
        print(f"\nFuzz: {EXAMPLES} examples per operation\n{log.table()}")
        if REPORT:
            with open(REPORT, "w") as f:
                json.dump(log.as_dict(), f, indent=2)


@pytest.fixture(scope="module")
def books(forge_url, metrics_port) -> Books:
    """Before the fuzz tenant's first request (its token bucket starts full)."""
    return Books.open(metrics_port)


@pytest.fixture(scope="module")
def api_schema(forge_url, books):
    config = schemathesis.Config.from_dict(
        {
            # Keys are set per route (``_aim``), never generated: a generated one is a wrong key.
            "generation": {"with-security-parameters": False},
            # Read streams to their end (Schemathesis stops at 20 events by default).
            "max-stream-events": 100_000,
            "checks": {
                # A schema-valid body can still be refused for what no schema says: a prompt
                # over the model's context, a model on the wrong route, a date range backwards.
                "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404", "429"]},
            },
        }
    )
    return schemathesis.openapi.from_url(f"{forge_url}/openapi.json", config=config)


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def _aim(case: schemathesis.Case) -> None:
    """The key the route takes; bodies pointed at what they may touch (see the docstring)."""
    path, body = case.operation.path, case.body
    case.headers = {**(case.headers or {}), **_auth(path)}
    if not isinstance(body, dict):
        return
    if path == "/admin/faults" and "pool" in body:
        body["pool"] = NO_SUCH_POOL
    model = body.get("model")
    served = SERVED_MODEL.get(path)
    # An empty name is what a negative case made of it: left so, the case stays negative.
    if served and isinstance(model, str) and model and zlib.crc32(repr(body).encode()) % 4:
        body["model"] = served


def _runs() -> Iterator:
    for method, path in OPERATIONS:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            reason = KNOWN_FAILURES.get((method, path, mode.value))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(method, path, mode, id=f"{method} {path} {mode.value}", marks=marks)


@pytest.mark.parametrize(("method", "path", "mode"), _runs())
def test_fuzz(api_schema, forge_url, fuzz_log, http, method, path, mode):
    operation = api_schema[path][method]
    if mode is GenerationMode.NEGATIVE and not (operation.body or operation.query):
        pytest.skip("nothing to get wrong: no body, no parameters")

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same cases every run
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing case is printed
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def one_case(case: schemathesis.Case) -> None:
        _aim(case)
        response = case.call(base_url=forge_url, session=http, timeout=CASE_TIMEOUT_S)
        try:
            check(case, response)
        except AssertionError as failure:  # Hypothesis shows a Case as "case=,"
            raise AssertionError(f"{failure}\nReproduce: {case.as_curl_command()}") from None

    def check(case: schemathesis.Case, response: schemathesis.Response) -> None:
        status, content_type = response.status_code, response.headers.get("content-type", [""])[0]
        code = None
        anthropic = path.startswith("/v1/messages")
        if 400 <= status < 500:
            error = (anthropic_error if anthropic else openai_error)(content_type, response.content)
            code = str(error["code"])
        fuzz_log.record(operation.label, case.meta.generation.mode.value, status, code)
        assert status < 500, f"{status} {response.text[:300]}"
        excluded = [ignored_auth]
        if content_type.startswith("text/event-stream"):
            # The schema's event description is not what Schemathesis reads it as (see
            # test_the_schema_describes_a_streamed_event): the stream is checked here instead.
            if anthropic:
                assert_named_events(response.content, {"message_stop", "error"})
            elif path == "/v1/responses":
                ends = {"response.completed", "response.incomplete", "response.failed"}
                assert_named_events(response.content, ends)
            else:
                assert_sse(response.content)
            excluded.append(response_schema_conformance)
        case.validate_response(response, excluded_checks=excluded)

    one_case()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_schema_describes_a_streamed_event(api_schema, forge_url, http, path):
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    body = {"model": "forge-sim", "max_tokens": 3, "stream": True, **prompt}
    case = api_schema[path]["POST"].Case(body=body, headers=_auth(path))
    response = case.call(base_url=forge_url, session=http, timeout=CASE_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert_sse(response.content)
    case.validate_response(response, checks=[response_schema_conformance])


UNSERVED = [
    (method, path)
    for path in dict.fromkeys(p for _, p in OPERATIONS)
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE")
    if (method, path) not in OPERATIONS
]


@pytest.mark.parametrize(("method", "path"), UNSERVED, ids=[f"{m} {p}" for m, p in UNSERVED])
def test_a_method_a_route_does_not_serve_is_405(forge_url, method, path):
    answer = httpx.request(method, f"{forge_url}{path}", headers=_auth(path), timeout=10)
    if path.startswith("/v1/messages"):  # Anthropic's shape on its routes
        assert answer.status_code == 405, answer.text
        error = anthropic_error(answer.headers["content-type"], answer.content)
        assert error == {"code": "invalid_request_error"}
    else:
        assert assert_openai_error(answer, 405)["code"] == "method_not_allowed"
    served = {m for m, p in OPERATIONS if p == path}
    assert served <= {m.strip() for m in answer.headers["allow"].split(",")}, answer.headers


SECURED = [(m, p) for m, p in OPERATIONS if p not in ("/healthz", "/readyz")]


def test_the_operations_are_the_schemas(forge_url):
    """A route added to the schema is fuzzed once it is added here; only health is open."""
    paths = httpx.get(f"{forge_url}/openapi.json", timeout=10).json()["paths"]
    operations = {
        (method.upper(), path): bool(operation.get("security"))
        for path, operations in paths.items()
        for method, operation in operations.items()
    }
    assert set(operations) == set(OPERATIONS)
    assert {op for op, secured in operations.items() if secured} == set(SECURED)


@pytest.mark.parametrize(("method", "path"), SECURED)
def test_every_secured_operation_refuses_a_missing_or_wrong_key(forge_url, method, path):
    body = {"pool": NO_SUCH_POOL, "fault": {"mode": "none"}} if path == "/admin/faults" else {}
    wrong = [{}, {"authorization": "Bearer sk-fuzz-wrong-key"}]
    if path.startswith("/v1/"):
        wrong.append({"x-api-key": "sk-fuzz-wrong-key"})  # the inference routes take it too
    for headers in wrong:
        response = httpx.request(
            method, f"{forge_url}{path}", json=body, headers=headers, timeout=10
        )
        if path.startswith("/v1/messages"):  # Anthropic's shape on its routes
            assert response.status_code == 401, response.text
            assert anthropic_error("application/json", response.content) == {
                "code": "authentication_error"
            }
        else:
            assert_openai_error(response, 401, "invalid_api_key")


def test_the_gateway_is_whole_after_the_fuzz(forge_url, books):
    """Served by its pools (no fault reached a replica), no breaker open, and the fuzz tenant
    has its whole stream cap and the token budget its metered usage leaves."""
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    for model, pool in (("forge-sim", "primary"), ("forge-solo", "solo")):
        answer = httpx.post(
            f"{forge_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers={"authorization": f"Bearer {tenant_key(TENANT)}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-forge-backend"] == pool
    breakers = httpx.get(f"{forge_url}/admin/breakers", headers=admin, timeout=10).json()
    assert {name: b["state"] for name, b in breakers.items() if b["state"] != "closed"} == {}
    assert_tenant_whole(forge_url, TENANT, books)
