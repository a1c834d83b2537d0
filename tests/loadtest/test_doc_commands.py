"""Every command README.md and docs/*.md document has an entry in scripts/doc_commands.py's
table (its quick run in CI, or why it runs elsewhere), and every entry is still documented:
``scripts/doc_commands.py --check``, in milliseconds, so a new documented command without a
quick run fails the ordinary test run."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "doc_commands.py"


@pytest.fixture(scope="module")
def doc_commands():
    spec = importlib.util.spec_from_file_location("doc_commands", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_commands"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("doc_commands", None)


def test_every_documented_command_has_an_entry_and_every_entry_is_documented(doc_commands):
    problems = doc_commands.check()
    assert not problems, "\n".join(problems)


def test_a_new_documented_command_without_an_entry_is_named_with_its_file_and_line(
    doc_commands,
):
    text = "Run it:\n\n```bash\npython -m loadtest.brand_new --fast\n```\n"
    found = doc_commands.extract() + doc_commands.extract_text(text, "docs/new.md")
    problems = doc_commands.check(found)
    assert problems == [
        "docs/new.md:4: `python -m loadtest.brand_new --fast` is documented but has no entry "
        "'python -m loadtest.brand_new' in scripts/doc_commands.py's COMMANDS (a quick run, or "
        "why it runs elsewhere)"
    ]


def test_an_entry_nothing_documents_any_more_is_named(doc_commands):
    table = {**doc_commands.COMMANDS, "python -m loadtest.gone": doc_commands.Elsewhere("-")}
    problems = doc_commands.check(table=table)
    assert problems == [
        "COMMANDS['python -m loadtest.gone']: no longer documented in README.md or docs/*.md; "
        "remove it"
    ]


@pytest.mark.parametrize(
    ("markdown", "keys"),
    [
        # Inline, across a line break, with a mode flag; a program named alone is no command.
        ("see `python -m\nevals.local` and `forge breakers --reset [B]`; `serve` alone", [
            "python -m evals.local", "forge breakers --reset"]),
        # A fenced chain: variables, venv prefixes and comments dropped, one key per command.
        ("```bash\nX=1 .venv/bin/pip install -e . && RAY=0 .venv/bin/serve run configs/a.yaml"
         "  # why\n```", ["pip install", "serve run configs/a.yaml"]),
        # A backslash continuation and a quote open across lines (the README's curl).
        ("```bash\ncurl -N http://127.0.0.1:8000/v1/chat/completions \\\n  -d '{\"a\":\n 1}'\n```",
         ["curl /v1/chat/completions"]),
        # kubectl's namespace before its subcommand; a script run with bash; a yaml block skipped.
        ("```sh\nkubectl -n forge get pods\nbash scripts/x.sh --update\n```\n"
         "```yaml\nserve run: 1\n```", ["kubectl get", "scripts/x.sh --update"]),
        # An indented code block, as docs/benchmarks.md writes commands.
        ("Text:\n\n    python -m loadtest.soak --minutes 30\n", ["python -m loadtest.soak"]),
        # Paths that merely contain a program's name are not commands.
        ("`helm/forge` and `~/.cache/forge` and `python3 -m venv .venv`", ["python -m venv"]),
    ],
)  # fmt: skip
def test_the_extractor_keys(doc_commands, markdown, keys):
    assert [f.key for f in doc_commands.extract_text(markdown, "x.md")] == keys


def test_what_serves_8000_runs_in_one_lane_with_what_it_needs_and_the_rest_beside_it(
    doc_commands,
):
    """Two lanes at once: two graphs on :8000 (or Ray dashboards on :8265) would collide, a
    prerequisite (the tiny model) must be written before its reader starts, and a claim that
    depends on throughput runs after both, by itself."""
    quick = {n: e for n, e in doc_commands.COMMANDS.items() if isinstance(e, doc_commands.Quick)}
    (owner, rest), alone = doc_commands.lanes_of(list(quick), 2)
    assert sorted(owner + rest + alone) == sorted(quick)
    assert {n for n, e in quick.items() if e.alone} == set(alone)
    on_8000 = {n for n, e in quick.items() if e.group == "graph" or e.serves_8000}
    assert on_8000 - set(alone) <= set(owner)  # alone, nothing runs beside it
    assert not any(quick[n].group == "graph" or quick[n].serves_8000 for n in rest)
    for name in owner:
        if quick[name].needs is not None:
            assert owner.index(quick[name].needs) < owner.index(name)
    vllm = [quick[n].group == "vllm" for n in rest]
    assert vllm == sorted(vllm, reverse=True), "the second lane starts with its vLLM entries"
    graph = [i for i, n in enumerate(owner) if quick[n].group == "graph"]
    assert graph == list(range(graph[0], graph[-1] + 1)), "the graph group runs in one stretch"
    (serial,), after = doc_commands.lanes_of(list(quick), 1)
    assert sorted(serial) == sorted(quick) and after == []


def test_the_lane_done_with_its_own_takes_the_others_entries_from_the_back(doc_commands):
    """Each shared entry runs once: the second lane from the front, the :8000 lane from the
    back once its own are done; the vLLM ones, and one that needs another's output, are left
    to the second lane."""
    quick = [n for n, e in doc_commands.COMMANDS.items() if isinstance(e, doc_commands.Quick)]
    (_, rest), _ = doc_commands.lanes_of(quick, 2)
    shared = doc_commands.Shared(rest)
    front: list[str] = []
    back: list[str] = []
    while True:  # the two lanes in turn
        from_back = len(back) < len(front)
        name = shared.take(back=from_back)
        if name is None and from_back:
            name, from_back = shared.take(), False
        if name is None:
            break
        (back if from_back else front).append(name)
    assert sorted(front + back) == sorted(rest) and len(front + back) == len(rest)
    assert all(doc_commands.COMMANDS[n].group == "own" for n in back)
    assert [n for n in rest if n not in back] == front  # the second lane's, in their order

    table = doc_commands.Shared(["make help", "python -m loadtest.vllm_routing"])
    assert table.take(back=True) == "make help"
    assert table.take(back=True) is None  # a vLLM entry: the second lane's
    assert table.take() == "python -m loadtest.vllm_routing"


def test_no_two_vllm_entries_run_at_once_whichever_lanes_they_are_in(
    doc_commands, tmp_path, monkeypatch
):
    """Two vLLM engines starting at once on two cores fail; other entries run beside one."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    running: set[str] = set()
    seen: list[set[str]] = []  # what ran together, as each entry saw it
    company = threading.Condition()

    def run_entry(name, entry, tmp, values, env):
        with company:
            running.add(name)
            company.notify_all()
            company.wait_for(lambda: len(running) > 1, timeout=1)  # alone if the lock holds
            seen.append(set(running))
        time.sleep(0.05)  # both have looked before either leaves
        with company:
            running.discard(name)
        return True, ""

    monkeypatch.setattr(doc_commands, "run_entry", run_entry)
    state = doc_commands._Run(tmp_path, {}, tmp_path / "venv", keep_going=True)
    vllm = [n for n, e in doc_commands.COMMANDS.items() if getattr(e, "group", "") == "vllm"]
    own = [n for n, e in doc_commands.COMMANDS.items() if getattr(e, "group", "") == "own"]
    lanes = [[vllm[0], own[0]], [vllm[1], own[1]]]  # both start with a vLLM entry
    threads = [
        threading.Thread(target=doc_commands._Lane(state, i + 1).go, args=(names,))
        for i, names in enumerate(lanes)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(r[1] for r in state.results) == sorted(lanes[0] + lanes[1])
    assert all(r[3] == "ok" for r in state.results)
    assert max(len(s & set(vllm)) for s in seen) == 1
    assert any(s & set(vllm) and s & set(own) for s in seen), "the rest runs beside one"
