"""No key, prompt or answer in anything the session graph wrote: every file under Ray's log
directory and every series on the metrics port, after traffic that carries marker strings.

The markers are new for each run, so a hit can only come from this run's traffic: one in the
API key (a bad key, refused), one in the prompt (of chats, completions and embeddings, served
and refused), one in the answer (the simulated model echoes an enum value of a JSON schema and
of a tool's parameters, so the generated text carries a string the prompt never does). The
traffic takes every path that writes something: served, streamed, cached, refused by the
gateway (401, 400, 413) and by the replica (400), and served by the fallback after the pool
failed. It goes to the chaos and embedding pools as tenant ``hygiene``, whom nothing else uses.

A scan that finds nothing proves something only if it looked where the requests were written:
each request's id must first show up in the log files, and the tenant's requests in the metrics.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import FALLBACK_KEY, tenant_key
from tests.hygiene import marked
from tests.polling import eventually

pytestmark = pytest.mark.e2e

TENANT = "hygiene"
AUTH = {"authorization": f"Bearer {tenant_key(TENANT)}"}
RUN = uuid.uuid4().hex[:12]
KEY_MARK = f"keymark{RUN}"
PROMPT_MARK = f"promptmark{RUN}"
ANSWER_MARK = f"answermark{RUN}"
MODEL_MARK = f"modelmark{RUN}"
QUOTED_MARK = f"quotedmark{RUN}"
CHAT_MODEL = "forge-chaos"  # failed over to the fallback on demand; nobody counts its traffic
EMBED_MODEL = "forge-embed"
CHAOS_DEPLOYMENT = "pool-chaos"
# Ray's runtime-env agent logs each runtime_env it creates, env_vars included: the session hands
# the fallback's key to its workers that way (test_rays_runtime_env_log_...).
RUNTIME_ENV_LOG = "runtime_env_agent"

MESSAGES, TAGGED, LOOKUP = marked(PROMPT_MARK, ANSWER_MARK)


class Traffic:
    """Sends requests with ids of this run; keeps the ids and what came back."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30)
        self.ids: list[str] = []
        self.tenant_requests = 0  # requests the tenant's key authenticated

    def send(
        self,
        path: str,
        body: dict | bytes | None,
        *,
        status: int,
        key: str | None = None,
        method: str = "POST",
    ) -> httpx.Response:
        request_id = f"hygiene-{RUN}-{len(self.ids)}"
        headers = {"x-request-id": request_id, **AUTH}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        else:
            self.tenant_requests += 1
        raw = body if isinstance(body, bytes) else None
        json = None if raw is not None else body
        response = self.client.request(method, path, json=json, content=raw, headers=headers)
        assert response.status_code == status, (path, response.status_code, response.text)
        self.ids.append(request_id)
        return response

    def chat(self, *, status: int = 200, **extra) -> httpx.Response:
        body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 64, **extra}
        return self.send("/v1/chat/completions", body, status=status)


class Leak(AssertionError):
    """A marker found where it must not be (any other failure, a control that never held, is
    a failure of the test itself)."""


def answer_text(response: httpx.Response) -> str:
    """The generated text and tool-call arguments, a stream's pieces joined."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.text
    pieces = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in orjson.loads(line[6:]).get("choices", ()):
            delta = choice.get("delta") or {}
            pieces.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                pieces.append((call.get("function") or {}).get("arguments") or "")
    return "".join(pieces)


def drive(traffic: Traffic, faults) -> None:
    # Served by the pool: answers that carry the marker, streamed and not; a repeat from the cache
    # (the entry is written once the first answer has ended: a repeat before that is a miss).
    for stream in (False, True):
        for extra in ({"response_format": TAGGED}, {"tools": [LOOKUP], "tool_choice": "required"}):
            answer = traffic.chat(stream=stream, temperature=0, **extra)
            assert ANSWER_MARK in answer_text(answer)

    def repeat() -> httpx.Response | None:
        answer = traffic.chat(response_format=TAGGED, temperature=0)
        return answer if answer.headers.get("x-forge-cache") == "hit" else None

    hit = eventually(repeat, timeout_s=10, what="a temperature-0 repeat to be a cache hit")
    assert ANSWER_MARK in answer_text(hit)
    for stream in (False, True):
        body = {"model": CHAT_MODEL, "prompt": PROMPT_MARK, "max_tokens": 8, "stream": stream}
        traffic.send("/v1/completions", body, status=200)
    embed = {"model": EMBED_MODEL, "input": [PROMPT_MARK, f"and {PROMPT_MARK}"]}
    traffic.send("/v1/embeddings", embed, status=200)

    # Refused by the gateway: a bad key (one with the marker), then malformed requests.
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        body = None if method == "GET" else {"model": CHAT_MODEL, "messages": MESSAGES}
        refused = traffic.send(path, body, status=401, key=f"sk-forge-{KEY_MARK}", method=method)
        assert KEY_MARK not in refused.text
    traffic.chat(status=400, max_tokens=0)
    traffic.chat(status=400, messages=[{"role": "wizard", "content": PROMPT_MARK}])
    cut = f'{{"model": "{CHAT_MODEL}", "messages": [{{"role": "user", "content": "{PROMPT_MARK}'
    traffic.send("/v1/chat/completions", cut.encode(), status=400)
    traffic.send("/v1/embeddings", {"model": EMBED_MODEL, "input": [PROMPT_MARK, ""]}, status=400)
    oversized = {"model": CHAT_MODEL, "messages": MESSAGES * 2000}  # over the session's 64 KiB
    traffic.send("/v1/chat/completions", oversized, status=413)
    # Refused by the replica, before the first byte: streamed and not.
    for stream in (False, True):
        traffic.chat(status=400, stream=stream, max_tokens=1_000_000)

    # Served by the fallback: the pool fails every request.
    faults.set_all(CHAOS_DEPLOYMENT, {"mode": "error"})
    for stream in (False, True):
        for extra in ({"response_format": TAGGED}, {"tools": [LOOKUP], "tool_choice": "required"}):
            answer = traffic.chat(stream=stream, **extra)
            assert answer.headers["x-forge-backend"] == "fallback"
            assert ANSWER_MARK in answer_text(answer)


def flush_serve_logs() -> None:
    """Write out what every Serve actor (replicas, proxy, controller) holds in its log buffer.

    Throughput-optimized Serve (the suite's default, tests/conftest.py) buffers a replica's log
    records until 1,000 are waiting or one is an error; the files are only complete after this.
    The function runs in each actor's process (``__ray_call__``), so it is defined in here to be
    pickled by value: those processes cannot import the tests.
    """
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    def flush(_actor) -> int:
        import logging

        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        handlers = {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
        for handler in handlers:
            handler.flush()
        return len(handlers)

    calls = []
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["namespace"] == SERVE_NAMESPACE:
            actor = ray.get_actor(named["name"], namespace=SERVE_NAMESPACE)
            calls.append(actor.__ray_call__.remote(flush))
    for call in calls:
        try:
            ray.get(call, timeout=10)
        except ray.exceptions.RayError:  # an actor a test killed, still listed
            pass


def log_files() -> list[Path]:
    """Every file under this Ray session's log directory (the replicas' Serve logs are in
    ``serve/``, the workers' stdout and stderr beside the core logs), recursively."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file()]


def find(markers: Iterable[str], files: Iterable[Path]) -> dict[str, list[str]]:
    """Each marker → where it occurs (``file: ...context...``)."""
    found: dict[str, list[str]] = {}
    wanted = [(m, m.encode()) for m in markers]
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:  # rotated or removed while we looked
            continue
        for marker, raw in wanted:
            at = data.find(raw)
            if at >= 0:
                context = data[max(at - 160, 0) : at + len(raw) + 80].decode(errors="replace")
                found.setdefault(marker, []).append(f"{path.name}: ...{context}...")
    return found


def wait_until_logged(request_ids: list[str]) -> None:
    """Until every one of these requests is in the log files: a scan that finds nothing then
    looked where they were written."""

    def unlogged() -> list[str]:
        flush_serve_logs()
        return sorted(set(request_ids) - set(find(request_ids, log_files())))

    eventually(
        lambda: not unlogged(),
        timeout_s=30,
        interval_s=1.0,
        what=f"the {len(request_ids)} request ids to be in Ray's log files",
        explain=unlogged,
    )


def metrics_text(metrics_port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text


def tenant_requests(metric) -> float:
    return metric("forge_requests_total", f'tenant="{TENANT}"')


def test_no_key_prompt_or_answer_in_any_log_file_or_metric(forge_url, faults, metric, metrics_port):
    before = tenant_requests(metric)
    traffic = Traffic(forge_url)
    drive(traffic, faults)

    # The scans below look where these requests were written: every id is in the log files
    # (the access line each request ends with), and the tenant's requests are exported.
    wait_until_logged(traffic.ids)
    eventually(
        lambda: tenant_requests(metric) - before == traffic.tenant_requests,
        timeout_s=30,
        interval_s=0.5,
        what=f"forge_requests_total to count the tenant's {traffic.tenant_requests} requests",
        explain=lambda: tenant_requests(metric) - before,
    )

    secrets = [KEY_MARK, PROMPT_MARK, ANSWER_MARK, tenant_key(TENANT)]
    files = log_files()
    leaks = find(secrets, files)
    # The fallback's key: nowhere either, but for the record Ray's runtime-env agent keeps of
    # how the session started its workers (the next test).
    leaks |= find([FALLBACK_KEY], [p for p in files if not p.name.startswith(RUNTIME_ENV_LOG)])
    metrics = metrics_text(metrics_port)
    leaks |= {m: ["the metrics port"] for m in [*secrets, FALLBACK_KEY] if m in metrics}
    if leaks:
        raise Leak(leaks)


def test_rays_runtime_env_log_holds_no_fallback_key(forge_url):
    records = [p for p in log_files() if p.name.startswith(RUNTIME_ENV_LOG)]
    assert records, "no runtime_env agent log to look in"
    if leaks := find([FALLBACK_KEY], records):
        raise Leak(leaks)


def test_a_refusal_that_quotes_the_request_stays_out_of_the_replica_log(forge_url):
    traffic = Traffic(forge_url)
    # vLLM's 400 (and the simulator's, in its words) quotes a tool_choice it refuses.
    refused = traffic.chat(status=400, tools=[LOOKUP], tool_choice=QUOTED_MARK)
    assert QUOTED_MARK in refused.text  # the client's own text, back to the client: fine

    wait_until_logged(traffic.ids)
    if leaks := find([QUOTED_MARK], log_files()):
        raise Leak(leaks)


def test_a_model_name_no_pool_serves_is_no_metric_label(forge_url, metric, metrics_port):
    def not_found() -> float:
        return metric("forge_requests_total", f'tenant="{TENANT}"', 'status="404"')

    before = not_found()
    traffic = Traffic(forge_url)
    body = {"model": f"forge-{MODEL_MARK}", "messages": MESSAGES, "max_tokens": 4}
    traffic.send("/v1/chat/completions", body, status=404)
    eventually(
        lambda: not_found() > before,
        timeout_s=30,
        interval_s=0.5,
        what="the 404 to be exported",
    )
    if MODEL_MARK in (metrics := metrics_text(metrics_port)):
        lines = [line for line in metrics.splitlines() if MODEL_MARK in line]
        raise Leak(lines[:3])
