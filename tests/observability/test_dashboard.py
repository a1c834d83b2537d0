"""The Grafana dashboard and the Prometheus rules query only series that really exist.

Every PromQL expression (each dashboard target, each rule) is parsed with promql-parser, and
every selector must name a series Forge declares in ``serve_app/`` (read from the source, so a
renamed or removed series fails here rather than as an empty panel or a silent alert), one of
vLLM's listed below, one dcgm-exporter is told to export (cluster/gpu-metrics/), or one the rules
record. Label matchers and ``by``/``on`` labels must be
labels those series carry.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVE_APP = ROOT / "serve_app"
DASHBOARD = ROOT / "observability" / "grafana" / "forge-overview.json"
RULES = ROOT / "observability" / "prometheus" / "forge-rules.yaml"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# vLLM's own series, as vLLM documents them (`vllm:<name>`), exported through Ray's metrics agent
# as `ray_vllm_<name>` by vLLM's RayPrometheusStatLogger (serve_app/engines/vllm_engine.py).
# vLLM is not installed in the dev venv, so this list is kept by hand: only what the dashboard
# uses, with vLLM's labels.
VLLM_SERIES = {
    "ray_vllm_kv_cache_usage_perc": frozenset({"model_name", "engine"}),
    "ray_vllm_num_requests_running": frozenset({"model_name", "engine"}),
    "ray_vllm_num_requests_waiting": frozenset({"model_name", "engine"}),
}

# Ray Serve's own series the rules read (ray/serve/_private/deployment_state.py in Ray 2.60): a
# replica's health from the controller, per replica where Ray exports high-cardinality tags,
# else the deployment's count of healthy replicas (the rule holds for both: ">= 1").
RAY_SERVE_SERIES = {
    "ray_serve_deployment_replica_healthy": frozenset({"deployment", "application", "replica"}),
}

# The GPU series: the DCGM fields dcgm-exporter is configured to export on the cluster
# (cluster/gpu-metrics/counters.yaml, read here, so a field dropped there fails the panel that
# needs it), with the exporter's labels and those its PodMonitor adds (`node`).
GPU_METRICS = ROOT / "cluster" / "gpu-metrics"
DCGM_LABELS = frozenset({"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id"})


def dcgm_series() -> dict[str, frozenset[str]]:
    (counters,) = yaml.safe_load_all((GPU_METRICS / "counters.yaml").read_text())
    fields = [
        line.split(",")[0].strip()
        for line in counters["data"]["counters.csv"].splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    (monitor,) = yaml.safe_load_all((GPU_METRICS / "podmonitor.yaml").read_text())
    added = {
        relabel["targetLabel"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]
        for relabel in endpoint.get("relabelings", [])
    }
    return {field: DCGM_LABELS | added for field in fields}


# Labels Ray adds: Serve's replica context on every series declared inside a deployment
# (ray/serve/metrics.py), the metrics agent's session, and Prometheus' own scrape labels.
RAY_LABELS = frozenset({"application", "deployment", "replica", "SessionName", "instance", "job"})

# Grafana's interval variables stand for a duration; any other variable for a label value.
_GRAFANA_INTERVAL = re.compile(r"\$__(?:rate_interval|interval|range)\b")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
# `sum by (…)` and `on (…)` name the labels they keep; `without`/`ignoring` are not checked.
_KEEPING = (promql_parser.AggModifierType.By, promql_parser.LabelModifierType.Include)


# -- Forge's series, from the source ----------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    kind: str  # counter, gauge, histogram
    labels: frozenset[str]


# serve_app.metrics.counter/gauge/histogram(name, description, *tags), and Ray's
# Counter/Gauge/Histogram(name, description=..., tag_keys=(...)).
_DECLARERS = {
    "counter": "counter",
    "gauge": "gauge",
    "histogram": "histogram",
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
}


@functools.cache
def declared_series() -> dict[str, Declared]:
    """Every metric declared in serve_app/, by its name in Forge (``forge_*``)."""
    found: dict[str, Declared] = {}
    for path in sorted(SERVE_APP.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and _callee(call) in _DECLARERS and call.args):
                continue
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            for name in _metric_names(call.args[0], call, parents, where):
                found[name] = Declared(_DECLARERS[_callee(call)], _tag_keys(call, where))
    return found


def _callee(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _metric_names(arg: ast.expr, call: ast.Call, parents: dict, where: str) -> list[str]:
    """The ``forge_*`` names a declaration makes. Anything else is not one: the declaring
    helpers pass their argument on, and ``collections.Counter`` shares a name."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value] if arg.value.startswith("forge_") else []
    head = arg.values[0] if isinstance(arg, ast.JoinedStr) else None
    if isinstance(head, ast.Constant) and head.value.startswith("forge_"):
        # f"forge_engine_{name}" for each name of a literal tuple the enclosing loop walks.
        variable = next(v.value.id for v in arg.values if isinstance(v, ast.FormattedValue))
        values = _loop_values(variable, call, parents)
        assert values, f"{where}: cannot read the names {ast.unparse(arg)} stands for"
        template = "".join(
            "{}" if isinstance(v, ast.FormattedValue) else v.value for v in arg.values
        )
        return [template.format(value) for value in values]
    return []


def _loop_values(variable: str, node: ast.AST, parents: dict) -> list[str]:
    while node in parents:
        node = parents[node]
        loops = getattr(node, "generators", None) or ([node] if isinstance(node, ast.For) else [])
        for loop in loops:
            if isinstance(loop.target, ast.Name) and loop.target.id == variable:
                return _strings(loop.iter)
    return []


def _tag_keys(call: ast.Call, where: str) -> frozenset[str]:
    nodes = list(call.args[2:]) + [k.value for k in call.keywords if k.arg == "tag_keys"]
    keys = [key for node in nodes for key in _strings(node)]
    assert len(keys) == sum(map(_count_elements, nodes)), f"{where}: unreadable tag keys"
    return frozenset(keys)


def _strings(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Starred):
        return _strings(node.value)
    if isinstance(node, ast.Tuple | ast.List):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _count_elements(node: ast.expr) -> int:
    if isinstance(node, ast.Starred):
        return _count_elements(node.value)
    if isinstance(node, ast.Tuple | ast.List):
        return sum(map(_count_elements, node.elts))
    return 1


def exported_series() -> dict[str, frozenset[str]]:
    """Every series name Prometheus holds, with its labels: Ray's ``ray_`` prefix, a
    histogram's three series, vLLM's list."""
    series: dict[str, frozenset[str]] = {}
    for name, declared in declared_series().items():
        exported = f"ray_{name}"
        if declared.kind == "histogram":
            series[f"{exported}_bucket"] = declared.labels | {"le"}
            series[f"{exported}_sum"] = declared.labels
            series[f"{exported}_count"] = declared.labels
        else:
            series[exported] = declared.labels
    return {**series, **VLLM_SERIES, **RAY_SERVE_SERIES, **dcgm_series()}


# -- the expressions ----------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    """Panels in order, with those inside collapsed rows."""
    return [p for panel in panels for p in [panel, *all_panels(panel.get("panels", []))]]


def load_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def recorded_series() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


def expressions() -> list[tuple[str, str]]:
    found = [
        (f"dashboard {panel['title']!r} {target['refId']}", target["expr"])
        for panel in all_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]
    found += [
        (f"rule {rule.get('record') or rule['alert']}", rule["expr"]) for rule in load_rules()
    ]
    return found


def parse(expr: str) -> promql_parser.Expr:
    expr = _GRAFANA_INTERVAL.sub("5m", expr)
    return promql_parser.parse(_GRAFANA_VARIABLE.sub("grafana_variable", expr))


def nodes(expr: promql_parser.Expr) -> list:
    found: list = []
    promql_parser.walk(expr, pre_visit=found.append)
    return found


def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    return [n for n in nodes(expr) if isinstance(n, promql_parser.VectorSelector)]


# -- the tests ----------------------------------------------------------------------------------


def test_the_source_scan_sees_what_forge_metrics_and_the_board_declare():
    from ray.util.metrics import Metric

    from serve_app.metrics import ForgeMetrics
    from serve_app.resilience.board import BoardMetrics

    declared = declared_series()
    for holder in (ForgeMetrics(), BoardMetrics()):
        for metric in vars(holder).values():
            if not isinstance(metric, Metric):
                continue  # ForgeMetrics.store_errors_seen: an in-process tally, not a series
            expected = Declared(type(metric).__name__.lower(), frozenset(metric._tag_keys))
            assert declared.get(metric._name) == expected, metric._name
    # And the ones declared elsewhere (scheduler, router, replica).
    assert {"forge_queue_depth", "forge_slots_in_use", "forge_routed_total"} <= set(declared)
    assert "forge_engine_kv_cache_usage_perc" in declared


def test_counters_end_in_total():
    """Prometheus exporters append ``_total`` to a counter without it, which would make the
    exported name differ from what this test allows."""
    counters = [name for name, d in declared_series().items() if d.kind == "counter"]
    assert counters
    assert [name for name in counters if not name.endswith("_total")] == []


EXPRESSIONS = expressions()


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_every_expression_queries_real_series_and_labels(where: str, expr: str):
    known = exported_series()
    recorded = recorded_series()
    parsed = parse(expr)

    for selector in selectors(parsed):
        assert selector.name, f"{where}: a selector without a metric name: {selector}"
        assert selector.name in known or selector.name in recorded, (
            f"{where}: {selector.name} is not a series Forge, Ray Serve, vLLM or dcgm-exporter "
            "exports"
        )
        if selector.name in known:
            labels = {m.name for m in selector.matchers.matchers} - {"__name__"}
            unknown = labels - known[selector.name] - RAY_LABELS
            assert not unknown, f"{where}: {selector.name} has no label {sorted(unknown)}"

    for node in nodes(parsed):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            kept, subtrees = node.modifier, [node.expr]
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            kept, subtrees = node.modifier.matching, [node.lhs, node.rhs]
        else:
            continue
        if kept is None or kept.type not in _KEEPING:
            continue
        beneath = [s.name for tree in subtrees for s in selectors(tree)]
        if any(name not in known for name in beneath):
            continue  # a recorded series: its labels are whatever its rule kept
        available = set(RAY_LABELS).union(*(known[name] for name in beneath))
        missing = set(kept.labels) - available
        assert not missing, f"{where}: {sorted(missing)} not on {sorted(set(beneath))}"


def test_the_dashboard_is_forge_overview_on_a_prometheus_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "forge-overview"
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_panels_have_unique_ids_and_every_query_targets_the_datasource_variable():
    panels = all_panels(load_dashboard()["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), sorted(ids)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, (panel["title"], target["refId"])
            assert target["expr"].strip(), (panel["title"], target["refId"])
