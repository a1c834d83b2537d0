"""The README's gateway command, checked as a new user runs it (``.ci/run`` step 4).

    python scripts/smoke_local.py   # from the repository root, with .venv installed

Starts ``serve run configs/local.yaml``, waits for the gateway's "is listening" line, sends a
chat completion (plain and streamed) and an embeddings request through
http://127.0.0.1:8000/v1 with the official ``openai`` client, checks that :8000 and HAProxy's
own listeners (stats 8404, metrics 9101, Serve's backup proxy 8500) listen on 127.0.0.1 only,
then presses Ctrl-C as a terminal does (SIGINT to ``serve run``'s whole process group, Ray's
daemons included) and checks that it exits 0, leaving nothing listening on those ports and
nothing running in its session, so the user's next ``serve run`` starts.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's loadtest/
from loadtest.local_graph import session_pids, stop_graph

KEY = "sk-demo-alpha-local-only"
PORTS = {8000: "the API (HAProxy)", 8404: "HAProxy stats", 9101: "HAProxy metrics", 8500: "backup"}
READY_WITHIN_S = 240


def listeners(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses listening on ``port``, from /proc/net/tcp{,6} (no ss needed)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            address, state = line.split()[1], line.split()[3]
            hex_host, hex_port = address.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                raw = b"".join(
                    bytes.fromhex(hex_host[i : i + 8])[::-1] for i in range(0, len(hex_host), 8)
                )
                found.append(ipaddress.ip_address(raw))
    return found


def _loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def main() -> int:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    log = Path("/tmp/forge-smoke-local.log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [".venv/bin/serve", "run", "configs/local.yaml"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            # A Ctrl-C it must not ignore, even where this runs with SIGINT ignored (nohup, a
            # shell's background job): Python then leaves it ignored in `serve run` too.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while "is listening" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                print(log.read_text()[-4000:], file=sys.stderr)
                raise SystemExit("smoke: the gateway did not start listening")
            time.sleep(1)
        line = next(x for x in log.read_text().splitlines() if "is listening" in x)
        print("smoke:", line.split("INFO ", 1)[-1])
        assert "via HAProxy" in line, line

        client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY, max_retries=5)
        ask = {"model": "forge-sim-1b", "messages": [{"role": "user", "content": "Hello, Forge"}]}
        answer = client.chat.completions.create(**ask, max_tokens=8)
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0, answer
        chunks = list(client.chat.completions.create(**ask, max_tokens=8, stream=True))
        assert any(c.choices and c.choices[0].delta.content for c in chunks), chunks
        print(f"smoke: chat through :8000: ok ({len(chunks)} chunks streamed)")
        vectors = client.embeddings.create(model="forge-embed", input=["checkout", "payments"])
        assert [len(item.embedding) for item in vectors.data] == [384, 384], vectors
        print("smoke: embeddings through :8000: ok (2 vectors of 384)")

        for port, what in PORTS.items():
            hosts = listeners(port)
            assert hosts, f"nothing listens on {port} ({what})"
            outside = [str(h) for h in hosts if not _loopback(h)]
            assert not outside, f"{port} ({what}) listens beyond loopback: {hosts}"
            print(f"smoke: {port} ({what}) listens on {', '.join(map(str, hosts))}")

        # Ctrl-C: Serve drains the gateway replica (5 s, configs/local.yaml) and shuts down,
        # then Ray (~16 s on a 2-core machine, docs/listeners.md).
        started = time.monotonic()
        killed = stop_graph(proc)
        took = time.monotonic() - started
        assert proc.returncode == 0, (
            f"Ctrl-C: `serve run` exited {proc.returncode} (negative: killed when Ctrl-C did "
            f"not stop it in 90 s); see {log}"
        )
        assert not killed, f"after Ctrl-C, still running in its session: pids {killed}"
        still = [f"{port} ({what})" for port, what in PORTS.items() if listeners(port)]
        assert not still, f"after Ctrl-C, still listening: {', '.join(still)}"
        print(f"smoke: Ctrl-C: exit 0 in {took:.1f} s, every port closed, no process left")
        return 0
    finally:
        # A check failed first (or `serve run` died starting): leave nothing of it running.
        if proc.returncode is None or session_pids(proc.pid):
            stop_graph(proc, drain=False)


if __name__ == "__main__":
    sys.exit(main())
