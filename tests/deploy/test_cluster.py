"""cluster/ (the ArgoCD app-of-apps) and scripts/drills/, offline.

No ArgoCD or cluster here, so: every file the root Application syncs parses and is an ArgoCD
object; the Applications validate against a JSON schema of the fields we use (written from
ArgoCD's Application CRD, strict where ArgoCD would silently drop a misspelt field); every source
in this repository points at a path (and values files) that exist; syncs are automated with prune
and selfHeal, chart versions pinned, waves ordered CRDs → operators → observability → Forge. The
gate before traffic (issue 32, item 8): every source of this repository follows the ref CI moves
after the gate (``production``), and the post-switch hook runs only read-only checks. The
observability stack (item 10): the OTLP endpoint Forge exports to is the Collector's Service, the
Collector exports to Tempo, Grafana reads Tempo, Alertmanager routes to a receiver (amtool),
ArgoCD's notification triggers fire on a failed sync (evaluated), the GPU exporter fits GKE and
feeds the dashboard's GPU panels, and Ray's Serve dashboards ship with the chart. The hook Job, the
GPU exporter and the drills' load Job validate as Kubernetes objects (kubernetes-validate
--strict); CI's tag bump is run on a copy; the drill scripts pass ``bash -n``. Each check is fed a
broken input and must catch it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tokenize
from io import StringIO
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.conftest import ROOT, ToolFailed, Tools

CLUSTER = ROOT / "cluster"
APPS = CLUSTER / "apps"
DRILLS = ROOT / "scripts" / "drills"
EVAL_GATE = CLUSTER / "forge" / "eval-gate.yaml"
GPU_METRICS = CLUSTER / "gpu-metrics"
WORKFLOW = ROOT / ".github" / "workflows" / "deploy.yml"
GUIDE = ROOT / "docs" / "deploy.md"
LOAD_JOB = DRILLS / "load-job.yaml"
MARKER = "# forge-image-tag"


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def root_app() -> dict:
    (app,) = docs(CLUSTER / "root.yaml")
    return app


def this_repo() -> str:
    """The root Application's repoURL is, by definition, this repository's."""
    return root_app()["spec"]["source"]["repoURL"]


def applications() -> dict[str, dict]:
    """Every Application: the root and those in cluster/apps/, by name."""
    found = {"forge-root": root_app()}
    for path in sorted(APPS.iterdir()):
        for doc in docs(path):
            if doc["kind"] == "Application":
                found[doc["metadata"]["name"]] = doc
    return found


def project() -> dict:
    (proj,) = [d for p in APPS.iterdir() for d in docs(p) if d["kind"] == "AppProject"]
    return proj


def sources(app: dict) -> list[dict]:
    spec = app["spec"]
    return spec["sources"] if "sources" in spec else [spec["source"]]


def wave(app: dict) -> int:
    return int(app["metadata"].get("annotations", {}).get("argocd.argoproj.io/sync-wave", "0"))


# --- what every file in cluster/apps is ------------------------------------------------------


def test_the_root_syncs_every_file_in_cluster_apps():
    source = root_app()["spec"]["source"]
    assert source["path"] == "cluster/apps"
    # A directory source reads *.yaml, *.yml and *.json; without recurse, only the top level.
    assert source.get("directory", {}).get("recurse", False) is False
    for path in APPS.rglob("*"):
        assert path.parent == APPS, f"{path}: the root does not recurse into subdirectories"
        assert path.suffix in (".yaml", ".yml"), f"{path}: the root would not sync this file"
        for doc in docs(path):
            assert doc["apiVersion"] == "argoproj.io/v1alpha1", path
            assert doc["kind"] in ("Application", "AppProject"), path
            assert doc["metadata"]["namespace"] == "argocd", path
    names = set(applications())
    assert {"kuberay-crds", "kuberay-operator", "kube-prometheus-stack", "forge"} <= names
    assert {"tempo", "opentelemetry-collector", "gpu-metrics"} <= names


# --- the Application schema ------------------------------------------------------------------

SYNC_OPTIONS = (
    r"^(CreateNamespace=true|ServerSideApply=true|SkipDryRunOnMissingResource=true|Replace=true"
    r"|PruneLast=true|ApplyOutOfSyncOnly=true|RespectIgnoreDifferences=true|Validate=false"
    r"|FailOnSharedResource=true|PrunePropagationPolicy=(foreground|background|orphan))$"
)

_SOURCE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["repoURL"],
    "properties": {
        "repoURL": {"type": "string", "pattern": "^https://"},
        "targetRevision": {"type": "string", "minLength": 1},
        "path": {"type": "string"},
        "chart": {"type": "string"},
        "ref": {"type": "string"},
        "helm": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "releaseName": {"type": "string"},
                "valueFiles": {"type": "array", "items": {"type": "string"}},
                "values": {"type": "string"},
                "valuesObject": {"type": "object"},
                "parameters": {"type": "array"},
                "skipCrds": {"type": "boolean"},
                "ignoreMissingValueFiles": {"type": "boolean"},
                "namespace": {"type": "string"},
            },
        },
        "directory": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "recurse": {"type": "boolean"},
                "include": {"type": "string"},
                "exclude": {"type": "string"},
            },
        },
    },
    # A Helm repository source names a chart; a git source names a path.
    "oneOf": [{"required": ["chart"]}, {"required": ["path"]}],
}

APPLICATION_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "The subset of ArgoCD's Application (argoproj.io/v1alpha1) cluster/ uses",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "argoproj.io/v1alpha1"},
        "kind": {"const": "Application"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"const": "argocd"},
                "labels": {"type": "object"},
                "annotations": {
                    "type": "object",
                    "properties": {
                        "argocd.argoproj.io/sync-wave": {"type": "string", "pattern": "^-?[0-9]+$"}
                    },
                },
                "finalizers": {
                    "type": "array",
                    "items": {"enum": ["resources-finalizer.argocd.argoproj.io"]},
                },
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["project", "destination", "syncPolicy"],
            "properties": {
                "project": {"type": "string"},
                "source": _SOURCE,
                "sources": {"type": "array", "minItems": 1, "items": _SOURCE},
                "destination": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["server", "namespace"],
                    "properties": {"server": {"type": "string"}, "namespace": {"type": "string"}},
                },
                "ignoreDifferences": {"type": "array"},
                "syncPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["automated"],
                    "properties": {
                        "automated": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["prune", "selfHeal"],
                            "properties": {
                                "prune": {"const": True},
                                "selfHeal": {"const": True},
                                "allowEmpty": {"type": "boolean"},
                            },
                        },
                        "syncOptions": {
                            "type": "array",
                            "items": {"type": "string", "pattern": SYNC_OPTIONS},
                        },
                        "retry": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "limit": {"type": "integer"},
                                "backoff": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "duration": {"type": "string"},
                                        "factor": {"type": "integer"},
                                        "maxDuration": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
            "oneOf": [{"required": ["source"]}, {"required": ["sources"]}],
        },
    },
}


def schema_check(tools: Tools, apps: dict[str, dict], tmp: Path) -> subprocess.CompletedProcess:
    schema = tmp / "application.schema.json"
    schema.write_text(json.dumps(APPLICATION_SCHEMA))
    files = []
    for name, app in apps.items():
        files.append(tmp / f"{name}.json")
        files[-1].write_text(json.dumps(app))
    return tools.run("check-jsonschema", "--schemafile", str(schema), *map(str, files))


def test_applications_match_the_schema(tools: Tools, tmp_path: Path):
    done = schema_check(tools, applications(), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_rejects_a_misspelt_or_manual_sync(tools: Tools, tmp_path: Path):
    apps = applications()
    misspelt = copy.deepcopy(apps["forge"])
    auto = misspelt["spec"]["syncPolicy"]["automated"]
    auto["selfheal"] = auto.pop("selfHeal")  # ArgoCD would drop it and never self-heal
    manual = copy.deepcopy(apps["kuberay-operator"])
    manual["spec"]["syncPolicy"]["automated"]["prune"] = False
    for broken in (misspelt, manual):
        done = schema_check(tools, {"broken": broken}, tmp_path)
        assert done.returncode != 0, done.stdout


# --- where the sources point -----------------------------------------------------------------


def source_problems(app: dict, repo: str, root: Path) -> list[str]:
    """What would make ArgoCD fail to render ``app`` from a checkout at ``root``."""
    problems = []
    for source in sources(app):
        if source["repoURL"] != repo:
            continue
        path = root / source.get("path", "")
        if not source.get("path") or not path.is_dir():
            problems.append(f"{app['metadata']['name']}: no directory {source.get('path')!r}")
            continue
        for values in source.get("helm", {}).get("valueFiles", []):
            if not (path / values).is_file():
                problems.append(f"{app['metadata']['name']}: no values file {path / values}")
        if source.get("helm") and not (path / "Chart.yaml").is_file():
            problems.append(f"{app['metadata']['name']}: {path} is not a chart")
    return problems


def test_sources_in_this_repository_point_at_paths_that_exist():
    repo = this_repo()
    problems = [p for app in applications().values() for p in source_problems(app, repo, ROOT)]
    assert problems == []


def test_a_source_path_that_does_not_exist_is_caught():
    repo = this_repo()
    app = copy.deepcopy(applications()["forge"])
    app["spec"]["sources"][1]["path"] = "cluster/no-such-directory"
    assert any("no-such-directory" in p for p in source_problems(app, repo, ROOT))
    chart = copy.deepcopy(applications()["forge"])
    chart["spec"]["sources"][0]["helm"]["valueFiles"] = ["values-staging-typo.yaml"]
    assert any("values-staging-typo" in p for p in source_problems(chart, repo, ROOT))


def test_the_project_admits_every_source_and_destination():
    spec = project()["spec"]
    repos = set(spec["sourceRepos"])
    destinations = {(d["server"], d["namespace"]) for d in spec["destinations"]}
    for name, app in applications().items():
        if name == "forge-root":
            assert app["spec"]["project"] == "default"
            continue
        assert app["spec"]["project"] == project()["metadata"]["name"], name
        assert {s["repoURL"] for s in sources(app)} <= repos, name
        dest = app["spec"]["destination"]
        assert (dest["server"], dest["namespace"]) in destinations, name


# --- versions, waves, what Forge deploys -----------------------------------------------------

EXACT_VERSION = re.compile(r"^v?\d+\.\d+\.\d+$")


def test_third_party_sources_are_pinned_to_a_release():
    for name, app in applications().items():
        for source in sources(app):
            if source["repoURL"] == this_repo():
                continue
            assert EXACT_VERSION.match(source.get("targetRevision", "")), (name, source)
    apps = applications()
    crds_tag = apps["kuberay-crds"]["spec"]["source"]["targetRevision"]
    operator = apps["kuberay-operator"]["spec"]["source"]
    assert crds_tag == "v" + operator["targetRevision"], "CRDs and operator from one release"
    assert operator["helm"]["valuesObject"]["image"]["tag"] == crds_tag
    assert operator["helm"]["skipCrds"] is True, "the CRDs are kuberay-crds' alone"


def test_sync_waves_put_crds_and_operators_before_forge():
    apps = applications()
    assert wave(project()) < min(wave(a) for n, a in apps.items() if n != "forge-root")
    assert wave(apps["kuberay-crds"]) < wave(apps["kuberay-operator"]) < wave(apps["forge"])
    assert wave(apps["kube-prometheus-stack"]) < wave(apps["kuberay-operator"])
    # The observability apps after the monitoring CRDs, before Forge whose spans and GPUs they take;
    # Tempo no later than the Collector that exports to it.
    for name in ("tempo", "opentelemetry-collector", "gpu-metrics"):
        assert wave(apps["kube-prometheus-stack"]) < wave(apps[name]) < wave(apps["forge"]), name
    assert wave(apps["tempo"]) <= wave(apps["opentelemetry-collector"])
    # Big CRDs need server-side apply (client-side apply's annotation is capped at 256 KiB).
    for name in ("kuberay-crds", "kube-prometheus-stack"):
        assert "ServerSideApply=true" in apps[name]["spec"]["syncPolicy"]["syncOptions"], name


def forge_sources() -> tuple[dict, dict]:
    chart, extra = sources(applications()["forge"])
    return chart, extra


def test_forge_deploys_the_chart_with_production_values_and_the_hook():
    chart, extra = forge_sources()
    assert chart["path"] == "helm/forge"
    assert chart["helm"]["valueFiles"] == ["values-production.yaml"]
    assert extra["path"] == "cluster/forge"
    assert {p.name for p in (ROOT / extra["path"]).iterdir()} == {"eval-gate.yaml"}
    values = chart["helm"]["valuesObject"]
    assert values["image"]["tag"] == values["gpuImage"]["tag"], "one commit, both images"


# The chart as ArgoCD renders it for this Application: chart defaults < valueFiles < valuesObject,
# the chart's values.schema.json checked, release `forge` in namespace `forge`.
RENDER = """
import json, sys
import yaml
import helm_python as helm
chart_dir, values, release, namespace = sys.argv[1:5]
chart = helm.Chart.load(chart_dir)
chart.validate_schema(json.loads(values))
out = chart.render(json.loads(values), name=release, namespace=namespace, is_install=True)
print(json.dumps([d for text in out.values() for d in yaml.safe_load_all(text) if d]))
"""


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def render_forge(tools: Tools, app: dict) -> list[dict]:
    chart, _ = sources(app)
    path = ROOT / chart["path"]
    values: dict = {}
    for name in chart["helm"].get("valueFiles", []):
        values = merged(values, yaml.safe_load((path / name).read_text()) or {})
    values = merged(values, chart["helm"].get("valuesObject", {}))
    release = chart["helm"].get("releaseName", app["metadata"]["name"])
    namespace = app["spec"]["destination"]["namespace"]
    return tools.python(RENDER, str(path), json.dumps(values), release, namespace)


def test_the_forge_application_renders_the_images_it_names(tools: Tools):
    app = applications()["forge"]
    rendered = render_forge(tools, app)
    (service,) = [d for d in rendered if d["kind"] == "RayService"]
    values = forge_sources()[0]["helm"]["valuesObject"]
    image = "{repository}:{tag}".format(**values["image"])
    gpu_image = "{repository}:{tag}".format(**values["gpuImage"])
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert {c["image"] for c in head if c["name"] != "autoscaler"} == {image}
    groups = {
        g["groupName"]: g["template"]["spec"]["containers"] for g in cluster["workerGroupSpecs"]
    }
    gpu_groups = [n for n, cs in groups.items() if any(c["image"] == gpu_image for c in cs)]
    assert len(gpu_groups) == 1, groups
    # What the gate and the drills assume of the rendered chart.
    serve = service["spec"]["serveService"]["metadata"]["name"]
    gate_env = {
        e["name"]: e for e in gate_job()["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert gate_env["FORGE_BASE_URL"]["value"] == f"http://{serve}:8000"
    assert f"http://{serve}:8000" in (DRILLS / "lib.sh").read_text()
    assert f"ray.io/group={gpu_groups[0]}" in (DRILLS / "lib.sh").read_text()


def test_a_value_the_chart_refuses_is_caught(tools: Tools):
    app = copy.deepcopy(applications()["forge"])
    app["spec"]["sources"][0]["helm"]["valuesObject"]["image"]["tag"] = "latest"
    with pytest.raises(ToolFailed):
        render_forge(tools, app)


def gate_job(path: Path = EVAL_GATE) -> dict:
    (job,) = docs(path)
    return job


def test_the_post_switch_check_is_a_postsync_hook_running_evals_with_keys_from_secrets():
    job = gate_job()
    annotations = job["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/hook"] == "PostSync"
    pod = job["spec"]["template"]["spec"]
    (gate,) = pod["containers"]
    assert gate["command"] == ["python", "-m", "evals"]
    args = gate["args"]
    for flag in ("--base-url", "--key", "--admin-key"):
        assert flag in args, flag
    env = {e["name"]: e for e in gate["env"]}
    for flag, var in (("--key", "FORGE_EVAL_KEY"), ("--admin-key", "FORGE_EVAL_ADMIN_KEY")):
        assert args[args.index(flag) + 1] == f"$({var})"
        assert "secretKeyRef" in env[var]["valueFrom"], var  # never a value in git
    assert env["FORGE_BASE_URL"]["value"].endswith(":8000")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert job["spec"]["backoffLimit"] == 0
    # The gate runs the image the chart deploys.
    chart, _ = forge_sources()
    image = chart["helm"]["valuesObject"]["image"]
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["image"] == f"{image['repository']}:{image['tag']}", container["name"]


def test_the_eval_gate_reaches_the_admin_routes_on_the_admin_port():
    """The chart's release is `forge`: its admin Service is forge-admin, on configs/gke.yaml's
    FORGE_ADMIN_PORT, admitting the pods networkPolicy.adminFrom names; the gate is one."""
    pod = gate_job()["spec"]["template"]
    (gate,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gate["env"]}
    serve = yaml.safe_load((ROOT / "configs" / "gke.yaml").read_text())
    port = serve["controller_options"]["runtime_env"]["env_vars"]["FORGE_ADMIN_PORT"]
    assert env["FORGE_ADMIN_URL"] == f"http://forge-admin:{port}"
    values = yaml.safe_load((ROOT / "helm" / "forge" / "values.yaml").read_text())
    labels = pod["metadata"]["labels"]
    assert any(
        peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
        and "namespaceSelector" not in peer
        for peer in values["networkPolicy"]["adminFrom"]
    ), labels


# ArgoCD's health customisations run as Lua with the object as ``obj``; they return
# {status, message}. Here the same scripts run in Lua (lupa) on each status, not grepped.
RUN_HEALTH = """
import json, sys
from lupa import LuaRuntime
scripts, cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, (kind, obj) in cases.items():
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(scripts[kind])
    out[name] = {"status": hs["status"], "message": hs["message"]}
print(json.dumps(out))
"""


def _condition(kind: str, status: str, **extra) -> dict:
    return {"type": kind, "status": status, **extra}


def _apps(**statuses: str) -> dict:
    return {
        "applicationStatuses": {
            name: {"status": status, "message": f"{name} says {status}"}
            for name, status in statuses.items()
        }
    }


READY = _condition("Ready", "True", reason="NonZeroServeEndpoints", message="serving")
UPGRADING = _condition("UpgradeInProgress", "True", message="pending cluster coming up")
NOT_UPGRADING = _condition("UpgradeInProgress", "False", reason="NoPendingCluster")
# (kind, the object's status) → the health ArgoCD must see.
HEALTH_CASES = {
    "rayservice-unreported": ("RayService", None, "Progressing"),
    "rayservice-ready": (
        "RayService",
        {"conditions": [READY, NOT_UPGRADING], "activeServiceStatus": _apps(forge="RUNNING")},
        "Healthy",
    ),
    "rayservice-upgrading": (
        "RayService",
        {
            "conditions": [READY, UPGRADING],
            "activeServiceStatus": _apps(forge="RUNNING"),
            "pendingServiceStatus": _apps(forge="DEPLOYING"),
        },
        "Progressing",
    ),
    "rayservice-initializing": (
        "RayService",
        {"conditions": [_condition("Ready", "False", reason="Initializing")]},
        "Progressing",
    ),
    "rayservice-new-cluster-failed": (
        "RayService",
        {
            "conditions": [READY, UPGRADING],
            "activeServiceStatus": _apps(forge="RUNNING"),
            "pendingServiceStatus": _apps(
                forge="RUNNING", **{"forge-pool-primary": "DEPLOY_FAILED"}
            ),
        },
        "Degraded",
    ),
    "rayservice-unhealthy": (
        "RayService",
        {"conditions": [READY, NOT_UPGRADING], "activeServiceStatus": _apps(forge="UNHEALTHY")},
        "Degraded",
    ),
    "application-healthy": ("Application", {"health": {"status": "Healthy"}}, "Healthy"),
    "application-degraded": (
        "Application",
        {"health": {"status": "Degraded", "message": "a hook failed"}},
        "Degraded",
    ),
    "application-unassessed": ("Application", {}, "Progressing"),
}


def health_scripts(path: Path = CLUSTER / "argocd-cm-health.yaml") -> dict[str, str]:
    (patch,) = docs(path)
    data = patch["data"]
    return {
        "Application": data["resource.customizations.health.argoproj.io_Application"],
        "RayService": data["resource.customizations.health.ray.io_RayService"],
    }


def run_health(tools: Tools, scripts: dict[str, str]) -> dict[str, dict]:
    cases = {
        name: (kind, {"status": status} if status is not None else {})
        for name, (kind, status, _) in HEALTH_CASES.items()
    }
    return tools.python(RUN_HEALTH, json.dumps(scripts), json.dumps(cases))


def test_argos_health_checks_say_healthy_progressing_and_degraded(tools: Tools):
    """Executed, on KubeRay's statuses: Healthy once Ready with no upgrade, Progressing while
    one runs, Degraded when a Serve application of either cluster failed (issue 32, item 7)."""
    seen = run_health(tools, health_scripts())
    assert {name: seen[name]["status"] for name in HEALTH_CASES} == {
        name: want for name, (_, _, want) in HEALTH_CASES.items()
    }
    assert "forge-pool-primary DEPLOY_FAILED" in seen["rayservice-new-cluster-failed"]["message"]


def test_the_health_check_run_catches_a_script_that_is_never_degraded(tools: Tools):
    """The script as it was: a failed deploy stayed Progressing for ever."""
    scripts = health_scripts()
    start = scripts["RayService"].index("for _, side in ipairs")
    end = scripts["RayService"].index("if obj.status.conditions == nil")
    scripts["RayService"] = scripts["RayService"][:start] + scripts["RayService"][end:]
    seen = run_health(tools, scripts)
    assert seen["rayservice-new-cluster-failed"]["status"] == "Progressing"
    assert seen["rayservice-unhealthy"]["status"] == "Healthy"


# --- Kubernetes objects: the hook Job and the drills' load Job ------------------------------


def test_the_jobs_are_valid_kubernetes(tools: Tools):
    gpu = [str(GPU_METRICS / "dcgm-exporter.yaml"), str(GPU_METRICS / "counters.yaml")]
    done = tools.run("kubernetes-validate", "--strict", str(EVAL_GATE), str(LOAD_JOB), *gpu)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_validate_rejects_a_misspelt_field(tools: Tools, tmp_path: Path):
    broken = tmp_path / "job.yaml"
    broken.write_text(
        EVAL_GATE.read_text().replace("restartPolicy: Never", "restartPolicyy: Never")
    )
    done = tools.run("kubernetes-validate", "--strict", str(broken))
    assert done.returncode != 0, done.stdout


# --- CI's image-tag bump ---------------------------------------------------------------------

BUMP = CLUSTER / "bump-image-tag.sh"


def bump(tree: Path, tag: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(BUMP), tag, str(tree)], capture_output=True, text=True)


def copy_cluster(tmp: Path) -> Path:
    shutil.copytree(CLUSTER, tmp / "cluster")
    return tmp


def test_the_bump_moves_every_marked_tag_and_nothing_else(tmp_path: Path):
    tree = copy_cluster(tmp_path)
    tag = "0123456789abcdef0123456789abcdef01234567"
    done = bump(tree, tag)
    assert done.returncode == 0, done.stderr
    for rel in ("apps/forge.yaml", "forge/eval-gate.yaml"):
        before = (CLUSTER / rel).read_text().splitlines()
        after = (tree / "cluster" / rel).read_text().splitlines()
        changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert changed and all(MARKER in a and tag in b for a, b in changed), rel
        assert len(changed) == sum(
            MARKER in line and not line.lstrip().startswith("#") for line in before
        )
    forge = next(d for d in docs(tree / "cluster/apps/forge.yaml"))
    values = forge["spec"]["sources"][0]["helm"]["valuesObject"]
    assert values["image"]["tag"] == values["gpuImage"]["tag"] == tag
    pod = gate_job(tree / "cluster/forge/eval-gate.yaml")["spec"]["template"]["spec"]
    assert all(c["image"].endswith(":" + tag) for c in pod["containers"] + pod["initContainers"])


def test_the_bump_refuses_a_bad_tag_and_a_changed_layout(tmp_path: Path):
    tree = copy_cluster(tmp_path)
    assert bump(tree, "x; rm -rf /").returncode != 0
    forge = tree / "cluster/apps/forge.yaml"
    forge.write_text(
        forge.read_text().replace('tag: "bootstrap"  # forge', "tag: bootstrap  # forge")
    )
    done = bump(tree, "abc123")
    assert done.returncode != 0 and "marked lines" in done.stderr


# --- the drills ------------------------------------------------------------------------------


def test_the_drill_scripts_parse():
    scripts = sorted(DRILLS.glob("*.sh")) + sorted(CLUSTER.glob("*.sh"))
    assert {p.name for p in scripts} >= {"pod-kill.sh", "node-preemption.sh", "lib.sh"}
    for script in scripts:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


def test_bash_n_catches_a_broken_script(tmp_path: Path):
    broken = tmp_path / "broken.sh"
    broken.write_text((DRILLS / "pod-kill.sh").read_text().replace("fi\n", "\n", 1))
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True).returncode != 0


def test_the_drills_do_what_they_say():
    kill = (DRILLS / "pod-kill.sh").read_text()
    assert "kubectl delete pod" in kill
    preempt = (DRILLS / "node-preemption.sh").read_text()
    assert "gcloud compute instances simulate-maintenance-event" in preempt
    for text in (kill, preempt):
        assert "start_load" in text and "finish " in text


def test_the_load_job_reads_what_lib_sh_provides():
    (job,) = docs(LOAD_JOB)
    assert job["kind"] == "Job"
    (load,) = job["spec"]["template"]["spec"]["containers"]
    lib = (DRILLS / "lib.sh").read_text()
    for var in load["env"]:
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert ref["name"] == "forge-drill-load"
            assert f"--from-literal={ref['key']}=" in lib, ref["key"]
    assert "--from-file=drill_load.py=" in lib and "/drill/drill_load.py" in load["command"]
    assert "# drill-image" in LOAD_JOB.read_text()
    secret = next(v for v in load["env"] if v["name"] == "FORGE_DRILL_KEY")
    assert "secretKeyRef" in secret["valueFrom"]


# kubectl and gcloud stand-ins: each logs its arguments and answers what the drills ask, so the
# scripts run end to end here (the flow, the Job they apply, the command that kills, the table).
FAKE_KUBECTL = r"""#!/usr/bin/env bash
echo "kubectl $*" >>"$FAKE_LOG"
case "$*" in
  "get pods"*"ray.io/group"*"status.phase=Running"*) [ -n "${FAKE_NO_GPU:-}" ] || echo victim-pod ;;
  "get pods"*"ray.io/group"*"{.items[*].metadata.name}"*) echo victim-pod ;;
  "get pods"*"ray.io/group"*) printf 'victim-pod True\nnew-pod True\n' ;;
  "get pods"*"job-name="*) echo pod/load ;;
  "create configmap"*) echo "kind: ConfigMap" ;;
  "apply"*) cat >>"$FAKE_APPLIED" ;;
  "get job"*) echo "1/" ;;
  "get pod"*"nodeName"*) echo gke-node-1 ;;
  "get node"*) echo us-central1-a ;;
  "logs"*)
    now=$(date +%s)
    for dt in -20 -10 5 15; do
      backend=primary; status=200
      [ "$dt" -gt 0 ] && backend=fallback
      [ "$dt" -eq 15 ] && status=503
      fmt='DRILL {"start": %s, "end": %s, "status": %s, "backend": "%s", "error_event": false}'
      printf "$fmt\n" "$((now + dt))" "$((now + dt + 1))" "$status" "$backend"
    done ;;
esac
"""
FAKE_GCLOUD = '#!/usr/bin/env bash\necho "gcloud $*" >>"$FAKE_LOG"\n'


def stand_in_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("kubectl", FAKE_KUBECTL), ("gcloud", FAKE_GCLOUD)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "calls"),
        "FAKE_APPLIED": str(tmp_path / "applied"),
        "EVENT_AFTER_S": "0",
        "DRILL_DURATION_S": "1",
        "DRILL_OUT": str(tmp_path),
        "GCP_PROJECT": "forge-prod",
    }
    return env


def run_drill(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DRILLS / script)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("script", ["pod-kill.sh", "node-preemption.sh"])
def test_the_drills_run_against_stand_ins(tmp_path: Path, script: str):
    done = run_drill(script, stand_in_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (tmp_path / "calls").read_text()
    if script == "pod-kill.sh":
        assert "kubectl delete pod -n forge victim-pod --wait=false" in calls
    else:
        assert (
            "gcloud compute instances simulate-maintenance-event gke-node-1 "
            "--zone us-central1-a --project forge-prod"
        ) in calls
    # The load Job went in with the image the eval gate (and so the chart) runs.
    gate_image = gate_job()["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"image: {gate_image}  # drill-image" in (tmp_path / "applied").read_text()
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("window"))
    assert header.split() == [
        "window",
        "requests",
        "served_by_fallback",
        "5xx",
        "client_visible_errors",
        "total_p50_ms",
        "total_p95_ms",
    ]
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()}
    assert rows["before"][:4] == ["2", "0", "0", "0"], done.stdout
    assert rows["after"][:4] == ["2", "2", "1", "1"], done.stdout
    assert "new GPU worker new-pod Ready" in done.stdout


@pytest.mark.parametrize("script", ["pod-kill.sh", "node-preemption.sh"])
def test_a_drill_without_a_gpu_worker_stops_before_any_load(tmp_path: Path, script: str):
    env = {**stand_in_env(tmp_path), "FAKE_NO_GPU": "1"}
    done = run_drill(script, env)
    assert done.returncode != 0 and "the pool is at zero" in done.stderr
    assert "apply" not in (tmp_path / "calls").read_text()


def drill_load():
    spec = importlib.util.spec_from_file_location("drill_load", DRILLS / "drill_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_drill_table_counts_what_the_seed_table_counts():
    module = drill_load()

    def sample(start, status=200, backend="primary", error_event=False, total=1.0):
        return {
            "start": start,
            "end": start + total,
            "status": status,
            "backend": backend,
            "error_event": error_event,
        }

    samples = [
        sample(0, total=1.0),
        sample(10, total=2.0),
        sample(100, backend="fallback", total=3.0),
        sample(101, status=503, backend="none"),
        sample(102, error_event=True),
    ]
    rows = dict(module.table(samples, event_at=100.0))
    assert rows["before"] == {
        "requests": 2,
        "served_by_fallback": 0,
        "5xx": 0,
        "client_visible_errors": 0,
        "total_p50_ms": 1000,
        "total_p95_ms": 2000,
    }
    assert rows["after"]["requests"] == 3
    assert rows["after"]["served_by_fallback"] == 1
    assert rows["after"]["5xx"] == 1
    assert rows["after"]["client_visible_errors"] == 2
    assert rows["all"]["requests"] == 5
    assert "+0s..+60s" in rows and rows["+0s..+60s"]["requests"] == 3
    lines = [module.PREFIX + json.dumps(s) for s in samples] + ["a log line that is not a sample"]
    assert module.read_samples(lines) == samples


# --- the Secrets docs/deploy.md tells an operator to create -----------------------------------


def documented_secrets(text: str) -> set[tuple[str, str]]:
    """(namespace, name) of every ``kubectl -n NS create secret generic NAME`` in the text."""
    return set(re.findall(r"kubectl -n (\S+) create secret generic (\S+)", text))


def needed_secrets() -> set[tuple[str, str]]:
    """Every Secret something in git references by name: the chart's (production values; the
    Gemini key only exists for auth: api_key, which configs/gke.yaml does not use), the Ray
    token, the eval gate's keys, and Grafana's admin (kube-prometheus-stack's existingSecret)."""
    values = yaml.safe_load((ROOT / "helm" / "forge" / "values.yaml").read_text())
    chart = {
        ref["name"]
        for role, ref in values["secrets"].items()
        if ref["name"] and role != "geminiApiKey"
    }
    needed = {("forge", name) for name in chart | {"forge-ray-token", "forge-eval-keys"}}
    monitoring = yaml.safe_dump(docs(APPS / "kube-prometheus-stack.yaml"))
    for name in re.findall(r"existingSecret: (\S+)", monitoring):
        needed.add(("monitoring", name))
    # Alertmanager's receivers (alertmanagerSpec.secrets): without them its pod cannot start.
    for name in kube_prometheus_values()["alertmanager"]["alertmanagerSpec"]["secrets"]:
        needed.add(("monitoring", name))
    return needed


def test_the_deploy_guide_creates_every_secret_the_files_reference():
    """Without Grafana's admin Secret the monitoring wave never turns Healthy, and nothing
    after it syncs (issue 32, item 11): the guide creates each Secret, in its namespace."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert needed_secrets() - documented_secrets(guide) == set()
    assert ("monitoring", "grafana-admin") in needed_secrets()
    assert ("monitoring", "alertmanager-receivers") in needed_secrets()


def test_the_secrets_check_catches_the_missing_grafana_admin():
    guide = (ROOT / "docs" / "deploy.md").read_text()
    without = guide.replace("kubectl -n monitoring create secret generic grafana-admin", "")
    assert needed_secrets() - documented_secrets(without) == {("monitoring", "grafana-admin")}


# --- the gate before traffic (issue 32, item 8) -----------------------------------------------
#
# ArgoCD follows `production`, which only CI's deploy job moves, after the tests, the local gate
# and the whole eval gate against the pushed image (tests/deploy/test_images_and_workflow.py runs
# the workflow's job graph and its promotion step). A merge to main changes nothing in the
# cluster; a failed gate leaves `production`, and so every Application, where it was.

PRODUCTION_REF = "production"


def gate_problems(apps: dict[str, dict], workflow_text: str) -> list[str]:
    """Where a commit could reach the cluster without the gate: a source of this repository that
    follows another ref than the one CI moves after it, and a workflow that never moves it."""
    problems = []
    for name, app in apps.items():
        for source in sources(app):
            if source["repoURL"] != this_repo():
                continue
            if source.get("targetRevision") != PRODUCTION_REF:
                problems.append(
                    f"{name}: {source.get('path')} follows {source.get('targetRevision')!r}, "
                    f"not {PRODUCTION_REF!r}"
                )
    if not re.search(rf"git push\b.*HEAD:refs/heads/{PRODUCTION_REF}\b", workflow_text):
        problems.append(f"the workflow never pushes {PRODUCTION_REF}")
    return problems


def test_argocd_follows_only_the_ref_ci_moves_after_the_gate():
    apps = applications()
    assert gate_problems(apps, WORKFLOW.read_text()) == []
    # The root, Forge's chart and hook, and the GPU exporter's manifests all come from here.
    ours = [n for n, a in apps.items() for s in sources(a) if s["repoURL"] == this_repo()]
    assert {"forge-root", "forge", "gpu-metrics"} <= set(ours)


def test_an_application_following_main_is_caught():
    """The defect as it was: every source of this repository followed `main`."""
    apps = copy.deepcopy(applications())
    apps["forge"]["spec"]["sources"][0]["targetRevision"] = "main"
    apps["forge-root"]["spec"]["source"]["targetRevision"] = "HEAD"
    problems = gate_problems(apps, WORKFLOW.read_text())
    assert len(problems) == 2 and all("not 'production'" in p for p in problems), problems
    untouched = WORKFLOW.read_text().replace("HEAD:refs/heads/production", "HEAD:refs/heads/x")
    assert gate_problems(applications(), untouched) == [
        f"the workflow never pushes {PRODUCTION_REF}"
    ]


# The post-switch hook runs after traffic moved: nothing in it may load or break production, and
# ArgoCD's sync retries may run it again. Checks by name prefix (evals/cli.py's groups).
LOADING_OR_BREAKING = (
    "isolation:",
    "failover:",
    "store:",
    "slo:",
    "quota:",
    "disconnect:",
    "canary:",
)


def selected_checks(args: list[str]) -> list[str]:
    """What ``python -m evals list`` selects with these arguments (the hook's $(VAR)s unexpanded:
    list needs no value)."""
    done = subprocess.run(
        [sys.executable, "-m", "evals", "list", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if ":" in line and " " not in line]


def post_switch_problems(job: dict) -> list[str]:
    pod = job["spec"]["template"]["spec"]
    (check,) = pod["containers"]
    chosen = selected_checks(check["args"])
    problems = [
        f"runs {name} against production" for name in chosen if name.startswith(LOADING_OR_BREAKING)
    ]
    if not any(n.startswith("protocol:") for n in chosen) or not any(
        n.startswith("prompt:") for n in chosen
    ):
        problems.append("checks neither the protocol nor the prompts")
    env = {
        e["name"]
        for c in pod["containers"] + pod.get("initContainers", [])
        for e in c.get("env", [])
    }
    for var in ("FORGE_EVAL_FLOOD_KEY", "FORGE_EVAL_QUOTA_KEY", "FORGE_EVAL_REDIS_URL"):
        if var in env:
            problems.append(f"{var} reaches it")
    if job["spec"].get("backoffLimit") != 0:
        problems.append("its pod is retried")
    return problems


def test_the_post_switch_check_runs_nothing_that_loads_or_breaks_production():
    """Issue 32, item 8: the hook ran the whole gate after the switch, the isolation flood and the
    failover drill included, against production, and again on each sync retry."""
    assert post_switch_problems(gate_job()) == []


def test_the_whole_gate_as_a_hook_is_caught():
    job = copy.deepcopy(gate_job())
    (check,) = job["spec"]["template"]["spec"]["containers"]
    check["args"] = check["args"][: check["args"].index("--only")]
    check["env"] = [*check["env"], {"name": "FORGE_EVAL_FLOOD_KEY", "value": "x"}]
    job["spec"]["backoffLimit"] = 2
    problems = post_switch_problems(job)
    assert "runs isolation:victim-within-slo against production" in problems
    assert "runs failover:drill against production" in problems
    assert "FORGE_EVAL_FLOOD_KEY reaches it" in problems and "its pod is retried" in problems


# --- the observability stack (issue 32, item 10) ----------------------------------------------

OBSERVABILITY_APPS = ("tempo", "opentelemetry-collector", "gpu-metrics")


def chart_values(name: str) -> dict:
    (source,) = sources(applications()[name])
    return source["helm"]["valuesObject"]


def kube_prometheus_values() -> dict:
    return chart_values("kube-prometheus-stack")


def test_the_observability_apps_are_well_formed():
    apps = applications()
    for name in OBSERVABILITY_APPS:
        app = apps[name]
        assert app["spec"]["project"] == project()["metadata"]["name"], name
        assert app["spec"]["destination"]["namespace"] == "monitoring", name
        for source in sources(app):
            revision = source["targetRevision"]
            if source["repoURL"] == this_repo():
                assert revision == PRODUCTION_REF, name
            else:
                assert EXACT_VERSION.match(revision), (name, revision)
        assert "latest" not in yaml.safe_dump(app).lower(), name
        assert "CreateNamespace=true" in app["spec"]["syncPolicy"]["syncOptions"], name


# Values keys each chart has, from its values.yaml as the search tool stores it (no chart
# repository is reachable here): a key an Application sets must be one of these, or lie under one
# marked free-form ("…*": the chart passes it on whole). Sources:
# - kube-prometheus-stack: prometheus-community/helm-charts charts/kube-prometheus-stack/values.yaml
#   (alertmanager.config, alertmanager.alertmanagerSpec.secrets, grafana.additionalDataSources,
#   grafana.sidecar.dashboards.*, prometheus.prometheusSpec.*); grafana.admin.* is the grafana
#   subchart's;
# - opentelemetry-collector: its values.yaml and README.md (open-telemetry/opentelemetry-helm-
#   charts): mode, image.repository, command.name, ports.<name>.enabled, serviceMonitor, config;
# - tempo: grafana-community/helm-charts charts/tempo/values.yaml.
CHART_VALUES = {
    "kube-prometheus-stack": {
        "prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues",
        "prometheus.prometheusSpec.serviceMonitorSelectorNilUsesHelmValues",
        "prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues",
        "prometheus.prometheusSpec.retention",
        "prometheus.prometheusSpec.resources*",
        "prometheus.prometheusSpec.storageSpec*",
        "alertmanager.alertmanagerSpec.secrets",
        "alertmanager.config*",
        "grafana.additionalDataSources",
        "grafana.admin.existingSecret",
        "grafana.admin.userKey",
        "grafana.admin.passwordKey",
        "grafana.sidecar.dashboards.enabled",
        "grafana.sidecar.dashboards.label",
        "grafana.sidecar.dashboards.labelValue",
        "grafana.sidecar.dashboards.searchNamespace",
    },
    "opentelemetry-collector": {
        "fullnameOverride",
        "mode",
        "replicaCount",
        "image.repository",
        "command.name",
        "resources*",
        "ports.otlp.enabled",
        "ports.otlp-http.enabled",
        "ports.metrics.enabled",
        "serviceMonitor.enabled",
        "config*",
    },
    "tempo": {
        "fullnameOverride",
        "tempo.retention",
        "tempo.reportingEnabled",
        "tempo.resources*",
        "persistence.enabled",
        "persistence.size",
        "serviceMonitor.enabled",
    },
}


def leaf_paths(values: dict, prefix: str = "") -> list[str]:
    """Dotted paths to every value that is not a mapping (a list is a value)."""
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += leaf_paths(value, path + ".")
        else:
            out.append(path)
    return out


def unknown_values(chart: str, values: dict) -> list[str]:
    known = CHART_VALUES[chart]
    exact = {k for k in known if not k.endswith("*")}
    free = [k[:-1] for k in known if k.endswith("*")]
    return [
        path
        for path in leaf_paths(values)
        if path not in exact and not any(path == f or path.startswith(f + ".") for f in free)
    ]


def test_the_apps_set_only_values_their_charts_have():
    for name in CHART_VALUES:
        chart = sources(applications()[name])[0]["chart"]
        assert chart == name, name
        assert unknown_values(name, chart_values(name)) == [], name


def test_a_misspelt_chart_value_is_caught():
    tempo = copy.deepcopy(chart_values("tempo"))
    tempo["tempo"]["retension"] = tempo["tempo"].pop("retention")
    assert unknown_values("tempo", tempo) == ["tempo.retension"]
    collector = copy.deepcopy(chart_values("opentelemetry-collector"))
    collector["ports"]["otlphttp"] = collector["ports"].pop("otlp-http")
    assert unknown_values("opentelemetry-collector", collector) == ["ports.otlphttp.enabled"]


# Where the spans go. Forge's exporter speaks OTLP over HTTP (serve_app/tracing.py: the
# opentelemetry-exporter-otlp-proto-http exporter, to OTEL_EXPORTER_OTLP_ENDPOINT); the chart's
# OTLP/HTTP port is `otlp-http` on 4318 and its gRPC one `otlp` on 4317 (opentelemetry-collector
# values.yaml); Tempo's chart receives OTLP/gRPC on 4317 and serves queries on 3200 (tempo
# values.yaml: tempo.receivers, tempo.server.http_listen_port), under its fullname.
COLLECTOR_OTLP_HTTP_PORT = 4318
TEMPO_OTLP_GRPC_PORT = 4317
TEMPO_HTTP_PORT = 3200


def service_address(app: dict) -> tuple[str, str]:
    """(Service name, namespace) of a chart release that overrides its fullname."""
    (source,) = sources(app)
    return source["helm"]["valuesObject"]["fullnameOverride"], app["spec"]["destination"][
        "namespace"
    ]


def in_cluster(host: str) -> tuple[str, str] | None:
    """(service, namespace) of `<svc>.<ns>.svc[.cluster.local]`."""
    parts = host.split(".")
    if len(parts) >= 3 and ".".join(parts[2:]) in ("svc", "svc.cluster.local"):
        return parts[0], parts[1]
    return None


def otlp_endpoints(rendered: list[dict]) -> set[str]:
    """OTEL_EXPORTER_OTLP_ENDPOINT of every Ray container of the rendered RayService."""
    (service,) = [d for d in rendered if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]
    ]
    found = set()
    for pod in pods:
        for container in pod["spec"]["containers"]:
            if container["name"] == "autoscaler":
                continue
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            found.add(env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return found


def trace_path_problems(endpoints: set[str], apps: dict[str, dict]) -> list[str]:
    """Forge → Collector → Tempo ← Grafana: each hop names the next one's Service and port."""
    problems = []
    collector = apps["opentelemetry-collector"]
    values = sources(collector)[0]["helm"]["valuesObject"]
    if len(endpoints) != 1 or None in endpoints:
        return [f"the Ray containers export to {sorted(map(str, endpoints))}, not one endpoint"]
    (endpoint,) = endpoints
    url = urlsplit(endpoint)
    if url.scheme != "http" or in_cluster(url.hostname or "") != service_address(collector):
        problems.append(
            f"Forge exports to {endpoint}, not the Collector {service_address(collector)}"
        )
    if url.port != COLLECTOR_OTLP_HTTP_PORT or not values["ports"]["otlp-http"]["enabled"]:
        problems.append(f"Forge exports to port {url.port}, not the Collector's OTLP/HTTP")
    pipeline = values["config"]["service"]["pipelines"]["traces"]
    if "otlp" not in pipeline["receivers"]:
        problems.append("the Collector's traces pipeline does not receive OTLP")
    tempo = service_address(apps["tempo"])
    for exporter in pipeline["exporters"]:
        target = values["config"]["exporters"].get(exporter, {}).get("endpoint", "")
        host, _, port = target.rpartition(":")
        if in_cluster(host) != tempo or port != str(TEMPO_OTLP_GRPC_PORT):
            problems.append(f"the Collector exports to {target!r}, not Tempo {tempo}")
        if not exporter.startswith("otlp_grpc"):
            problems.append(f"{exporter}: OTLP/gRPC is `otlp_grpc` since Collector 0.144")
    grafana = kube_prometheus_values()["grafana"]["additionalDataSources"]
    sources_ = [d for d in grafana if d["type"] == "tempo"]
    url = urlsplit(sources_[0]["url"]) if sources_ else None
    if not url or in_cluster(url.hostname or "") != tempo or url.port != TEMPO_HTTP_PORT:
        problems.append("Grafana has no Tempo data source on Tempo's query port")
    return problems


def test_forges_spans_reach_the_collector_and_tempo(tools: Tools):
    """Issue 32, item 10: traces went to an `otel-collector` nothing deployed. The endpoint the
    chart renders into every Ray container is the Collector's Service, which exports to Tempo."""
    rendered = render_forge(tools, applications()["forge"])
    endpoints = otlp_endpoints(rendered)
    assert endpoints == {"http://otel-collector.monitoring.svc:4318"}
    assert trace_path_problems(endpoints, applications()) == []


def test_an_endpoint_no_collector_answers_is_caught():
    apps = applications()
    for wrong in (
        "http://otel-collector.observability.svc:4318",  # no Collector in that namespace
        "http://opentelemetry-collector.monitoring.svc:4318",  # the chart's name without override
        "http://otel-collector.monitoring.svc:4317",  # the gRPC port, to an HTTP exporter
    ):
        assert trace_path_problems({wrong}, apps) != [], wrong
    without_tempo = copy.deepcopy(apps)
    values = sources(without_tempo["opentelemetry-collector"])[0]["helm"]["valuesObject"]
    values["config"]["exporters"] = {"otlp_grpc/tempo": {"endpoint": "tempo.tracing.svc:4317"}}
    assert trace_path_problems({"http://otel-collector.monitoring.svc:4318"}, without_tempo) != []


# Alertmanager. The chart's own default config (kube-prometheus-stack values.yaml,
# alertmanager.config), which Helm merges ours over: every alert to the receiver "null".
KPS_DEFAULT_ALERTMANAGER_CONFIG = {
    "global": {"resolve_timeout": "5m"},
    "inhibit_rules": [
        {
            "source_matchers": ["severity = critical"],
            "target_matchers": ["severity =~ warning|info"],
            "equal": ["namespace", "alertname"],
        },
        {
            "source_matchers": ["severity = warning"],
            "target_matchers": ["severity = info"],
            "equal": ["namespace", "alertname"],
        },
        {
            "source_matchers": ["alertname = InfoInhibitor"],
            "target_matchers": ["severity = info"],
            "equal": ["namespace"],
        },
        {"target_matchers": ["alertname = InfoInhibitor"]},
    ],
    "route": {
        "group_by": ["namespace"],
        "group_wait": "30s",
        "group_interval": "5m",
        "repeat_interval": "12h",
        "receiver": "null",
        "routes": [{"receiver": "null", "matchers": ['alertname = "Watchdog"']}],
    },
    "receivers": [{"name": "null"}],
    "templates": ["/etc/alertmanager/config/*.tmpl"],
}
ALERTMANAGER_SECRETS = "/etc/alertmanager/secrets/"


def alertmanager_config(values: dict | None = None) -> dict:
    values = kube_prometheus_values() if values is None else values
    return merged(KPS_DEFAULT_ALERTMANAGER_CONFIG, values.get("alertmanager", {}).get("config", {}))


def routes(route: dict) -> list[dict]:
    return [route, *(r for child in route.get("routes", []) for r in routes(child))]


def receiver_problems(config: dict, mounted: list[str]) -> list[str]:
    """Alerts that would go nowhere: a route to an undefined receiver, a default route to a
    receiver with no integration, a secret file Alertmanager reads from a Secret not mounted."""
    receivers = {r["name"]: r for r in config.get("receivers", [])}
    problems = [
        f"a route sends to {r['receiver']!r}, which is not defined"
        for r in routes(config["route"])
        if r.get("receiver") and r["receiver"] not in receivers
    ]
    default = receivers.get(config["route"].get("receiver"), {})
    if not any(k.endswith("_configs") and v for k, v in default.items()):
        problems.append(f"the default route's receiver {default.get('name')!r} sends nowhere")
    for name, receiver in receivers.items():
        for key, integrations in receiver.items():
            for integration in integrations if key.endswith("_configs") else []:
                for field, value in integration.items():
                    if field.endswith("_file"):
                        secret = value.removeprefix(ALERTMANAGER_SECRETS).split("/")[0]
                        if not value.startswith(ALERTMANAGER_SECRETS) or secret not in mounted:
                            problems.append(f"{name}: {field} {value} is in no mounted Secret")
    return problems


def amtool_check(config: dict, tmp: Path) -> subprocess.CompletedProcess:
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (.ci/run installs Debian's prometheus-alertmanager)")
    path = tmp / "alertmanager.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True)


def test_alertmanager_sends_every_alert_to_a_receiver(tmp_path: Path):
    """Issue 32, item 10: Alertmanager had no receiver but "null". The config ArgoCD renders
    (the chart's default with ours merged over it) passes amtool and routes to Slack, by a URL
    read from the mounted Secret docs/deploy.md creates."""
    config = alertmanager_config()
    mounted = kube_prometheus_values()["alertmanager"]["alertmanagerSpec"]["secrets"]
    assert receiver_problems(config, mounted) == []
    done = amtool_check(config, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_alertmanager_that_sends_nowhere_is_caught(tmp_path: Path):
    assert receiver_problems(KPS_DEFAULT_ALERTMANAGER_CONFIG, []) == [
        "the default route's receiver 'null' sends nowhere"
    ]
    config = alertmanager_config()
    assert receiver_problems(config, []) != []  # the webhook's Secret not mounted
    typo = copy.deepcopy(config)
    typo["receivers"][1]["slack_configs"][0]["api_url_fil"] = typo["receivers"][1]["slack_configs"][
        0
    ].pop("api_url_file")
    assert amtool_check(typo, tmp_path).returncode != 0


def secret_keys_read(config: dict) -> set[tuple[str, str]]:
    """(Secret, key) of every file Alertmanager reads from a mounted Secret."""
    found = set()
    for receiver in config["receivers"]:
        for key, integrations in receiver.items():
            for integration in integrations if key.endswith("_configs") else []:
                for field, value in integration.items():
                    if field.endswith("_file") and value.startswith(ALERTMANAGER_SECRETS):
                        secret, name = value.removeprefix(ALERTMANAGER_SECRETS).split("/")
                        found.add((secret, name))
    return found


def notification_secret_keys() -> set[str]:
    """The argocd-notifications-secret keys the notifications ConfigMap reads (`$key`)."""
    (patch,) = docs(CLUSTER / "argocd-notifications.yaml")
    services = [v for k, v in patch["data"].items() if k.startswith("service.")]
    return {key for text in services for key in re.findall(r"\$([\w-]+)", text)}


def guide_key_problems(guide: str) -> list[str]:
    """Each key the files read from a Secret made by hand is given a value in docs/deploy.md."""
    problems = []
    for secret, key in secret_keys_read(alertmanager_config()):
        if not re.search(
            rf"create secret generic {secret}\b[^\n]*(\\\n[^\n]*)*--from-literal={key}=", guide
        ):
            problems.append(f"monitoring/{secret}: the guide does not set {key}")
    for key in notification_secret_keys():
        if not re.search(rf"argocd-notifications-secret\b(?:[^\n]*\\\n)*[^\n]*\b{key}\b", guide):
            problems.append(f"argocd/argocd-notifications-secret: the guide does not set {key}")
    return problems


def test_the_guide_fills_every_secret_key_alertmanager_and_argocd_read():
    guide = GUIDE.read_text()
    assert secret_keys_read(alertmanager_config()) == {
        ("alertmanager-receivers", "slack-webhook-url")
    }
    assert notification_secret_keys() == {"slack-token"}
    assert guide_key_problems(guide) == []


def test_a_guide_without_the_receivers_secrets_is_caught():
    guide = GUIDE.read_text()
    without = guide.replace("slack-webhook-url", "webhook").replace("slack-token", "token")
    assert len(guide_key_problems(without)) == 2


# ArgoCD notifications: its triggers' `when` are expr-language conditions on the Application. The
# subset used here (attribute paths, nil, ==, !=, in, and, or, list and string literals) means the
# same in Python once nil is None, so each is evaluated on Application statuses, not grepped.
_WHEN_NAMES = {"app", "nil", "and", "or", "not", "in"}


class _Fields(dict):
    """An object's fields as attributes, nil (None) where absent, as expr reads a map."""

    def __getattr__(self, name):
        value = self.get(name)
        return _Fields(value) if isinstance(value, dict) else value


def when(condition: str, app: dict) -> bool:
    for token in tokenize.generate_tokens(StringIO(condition).readline):
        if token.type == tokenize.NAME and token.string not in _WHEN_NAMES:
            previous = condition[: token.start[1]].rstrip()
            assert previous.endswith("."), f"not in the evaluated subset: {token.string}"
    python = re.sub(r"\bnil\b", "None", condition)
    return bool(eval(python, {"__builtins__": {}}, {"app": _Fields(app)}))


def notifications(cm: dict, app: dict) -> set[tuple[str, str]]:
    """(recipient, template) of every message the controller would send for ``app``."""
    data = cm["data"]
    sent = set()
    for subscription in yaml.safe_load(data.get("subscriptions", "[]")) or []:
        for trigger in subscription["triggers"]:
            for condition in yaml.safe_load(data[f"trigger.{trigger}"]):
                if when(condition["when"], app):
                    for template in condition["send"]:
                        assert f"template.{template}" in data, template
                        for recipient in subscription["recipients"]:
                            service = recipient.split(":")[0]
                            assert f"service.{service}" in data, service
                            sent.add((recipient, template))
    return sent


def _app(phase: str | None, health: str) -> dict:
    status = {"health": {"status": health}}
    if phase:
        status["operationState"] = {"phase": phase, "message": f"sync {phase}"}
    return {"metadata": {"name": "forge"}, "status": status}


NOTIFIED = {
    "a failed hook (the post-switch check)": (_app("Failed", "Healthy"), {"app-sync-failed"}),
    "a sync error": (_app("Error", "Progressing"), {"app-sync-failed"}),
    "a RayService whose new cluster failed": (
        _app("Succeeded", "Degraded"),
        {"app-health-degraded"},
    ),
    "a sync that succeeded": (_app("Succeeded", "Healthy"), set()),
    "a sync running": (_app("Running", "Progressing"), set()),
    "never synced": (_app(None, "Missing"), set()),
}


def notifications_cm() -> dict:
    (patch,) = docs(CLUSTER / "argocd-notifications.yaml")
    return patch


@pytest.mark.parametrize("case", list(NOTIFIED))
def test_argocd_notifies_a_failed_sync_and_a_degraded_app(case: str):
    """Issue 32, item 10: a failed sync said nothing anywhere."""
    app, templates = NOTIFIED[case]
    assert notifications(notifications_cm(), app) == {("slack:forge-deploys", t) for t in templates}


def test_notifications_without_a_subscription_are_caught():
    cm = copy.deepcopy(notifications_cm())
    del cm["data"]["subscriptions"]
    assert notifications(cm, _app("Failed", "Healthy")) == set()
    broken = copy.deepcopy(notifications_cm())
    broken["data"]["trigger.on-sync-failed"] = broken["data"]["trigger.on-sync-failed"].replace(
        "['Error', 'Failed']", "['Error']"
    )
    assert notifications(broken, _app("Failed", "Healthy")) == set()
    with pytest.raises(AssertionError, match="evaluated subset"):
        when("len(app.status) > 0", _app("Failed", "Healthy"))


# GPU metrics: dcgm-exporter on the T4 nodes, and the dashboard's GPU panels on its series.
GPU_PANELS_NEED = {
    "utilization": "DCGM_FI_DEV_GPU_UTIL",
    "memory": "DCGM_FI_DEV_FB_USED",
    "SM clock": "DCGM_FI_DEV_SM_CLOCK",
}


def gpu_objects() -> dict[str, dict]:
    return {d["kind"]: d for p in sorted(GPU_METRICS.glob("*.yaml")) for d in docs(p)}


def exported_fields(counters: dict) -> set[str]:
    return {
        line.split(",")[0].strip()
        for line in counters["data"]["counters.csv"].splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    }


def gpu_panel_problems(dashboard: dict, fields: set[str]) -> list[str]:
    exprs = [
        t["expr"]
        for p in dashboard["panels"]
        for p in [p, *p.get("panels", [])]
        for t in p.get("targets", [])
    ]
    used = {m for e in exprs for m in re.findall(r"\bDCGM_FI_\w+", e)}
    problems = [
        f"no panel shows the GPU {what} ({field})"
        for what, field in GPU_PANELS_NEED.items()
        if field not in used
    ]
    problems += [
        f"a panel queries {field}, which the exporter does not export"
        for field in sorted(used - fields)
    ]
    return problems


def dashboard() -> dict:
    return json.loads((ROOT / "observability" / "grafana" / "forge-overview.json").read_text())


def test_the_dashboard_shows_gpu_utilization_memory_and_sm_clocks():
    """Issue 32, item 10: no GPU metrics at all."""
    fields = exported_fields(gpu_objects()["ConfigMap"])
    assert gpu_panel_problems(dashboard(), fields) == []


def test_a_gpu_panel_on_a_field_the_exporter_drops_is_caught():
    fields = exported_fields(gpu_objects()["ConfigMap"]) - {"DCGM_FI_DEV_SM_CLOCK"}
    assert gpu_panel_problems(dashboard(), fields) == [
        "a panel queries DCGM_FI_DEV_SM_CLOCK, which the exporter does not export"
    ]
    bare = {**dashboard(), "panels": [p for p in dashboard()["panels"] if "GPU" not in p["title"]]}
    assert len(gpu_panel_problems(bare, fields)) == 3


def terraform_gpu_taint() -> dict[str, str]:
    """The T4 pool's taint (terraform/modules/gke/main.tf, local gpu_taint)."""
    text = (ROOT / "terraform" / "modules" / "gke" / "main.tf").read_text()
    block = re.search(r"gpu_taint\s*=\s*\{([^}]*)\}", text).group(1)
    return dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', block))


def gpu_exporter_problems(objects: dict[str, dict]) -> list[str]:
    """What dcgm-exporter needs on a GKE T4 node (cluster/gpu-metrics/dcgm-exporter.yaml)."""
    problems = []
    pod = objects["DaemonSet"]["spec"]["template"]
    spec = pod["spec"]
    taint = terraform_gpu_taint()
    if not any(
        t["key"] == taint["key"]
        and t.get("effect") == taint["effect"]
        and (t["operator"] == "Exists" or t.get("value") == taint["value"])
        for t in spec.get("tolerations", [])
    ):
        problems.append(f"does not tolerate the T4 pool's taint {taint}")
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for term in terms["nodeSelectorTerms"] for e in term["matchExpressions"]}
    if "cloud.google.com/gke-accelerator" not in keys:
        problems.append("not kept to GPU nodes")
    (exporter,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in exporter["volumeMounts"]}
    driver = volumes.get(mounts.get("/usr/local/nvidia"), {}).get("hostPath", {}).get("path")
    if driver != "/home/kubernetes/bin/nvidia":
        problems.append("GKE's driver directory is not at /usr/local/nvidia")
    env = {e["name"]: e.get("value", "") for e in exporter.get("env", [])}
    if "/usr/local/nvidia/lib64" not in env.get("LD_LIBRARY_PATH", "").split(":"):
        problems.append("NVML is not on LD_LIBRARY_PATH")
    if "nvidia.com/gpu" in json.dumps(exporter.get("resources", {})):
        problems.append("asks for a GPU (vLLM's)")
    if not exporter.get("securityContext", {}).get("privileged"):
        problems.append("cannot open the GPU's device nodes")
    if not any(
        "libnvidia-ml" in " ".join(c.get("command", [])) for c in spec.get("initContainers", [])
    ):
        problems.append("starts before GKE has installed the driver")
    counters_file = exporter["args"][exporter["args"].index("-f") + 1]
    counters_mount = next(m for m in exporter["volumeMounts"] if m["mountPath"] == counters_file)
    if (
        volumes[counters_mount["name"]]["configMap"]["name"]
        != objects["ConfigMap"]["metadata"]["name"]
    ):
        problems.append("reads another counters file than counters.yaml")
    monitor = objects["PodMonitor"]["spec"]
    labels = pod["metadata"]["labels"]
    if not monitor["selector"]["matchLabels"].items() <= labels.items():
        problems.append("the PodMonitor does not select it")
    ports = {p["name"] for p in exporter["ports"]}
    if any(e["port"] not in ports for e in monitor["podMetricsEndpoints"]):
        problems.append("the PodMonitor scrapes a port it does not have")
    return problems


def test_the_gpu_exporter_runs_on_gkes_t4_nodes():
    objects = gpu_objects()
    assert set(objects) == {"DaemonSet", "ConfigMap", "PodMonitor"}
    assert all(o["metadata"]["namespace"] == "monitoring" for o in objects.values())
    assert gpu_exporter_problems(objects) == []


def test_a_plain_dcgm_exporter_on_gke_is_caught():
    """NVIDIA's example manifest as it is: no host driver, no wait, no toleration."""
    objects = copy.deepcopy(gpu_objects())
    spec = objects["DaemonSet"]["spec"]["template"]["spec"]
    spec["tolerations"] = []
    spec["initContainers"] = []
    (exporter,) = spec["containers"]
    exporter["env"] = [e for e in exporter["env"] if e["name"] != "LD_LIBRARY_PATH"]
    exporter["volumeMounts"] = [
        m for m in exporter["volumeMounts"] if m["mountPath"] != "/usr/local/nvidia"
    ]
    assert len(gpu_exporter_problems(objects)) == 4


# Ray's Serve dashboards, from the Ray release Forge runs, in the chart's dashboard ConfigMap.
RAY_DASHBOARDS = ROOT / "observability" / "grafana" / "ray"
# Client-side apply (ArgoCD's, for the forge Application) keeps the object in an annotation, and
# annotations are capped at 256 KiB altogether.
APPLY_ANNOTATION_LIMIT = 256 * 1024


def ray_dashboards_module():
    path = ROOT / "observability" / "grafana" / "ray_dashboards.py"
    spec = importlib.util.spec_from_file_location("ray_dashboards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_ray_dashboards(files: dict[str, str]) -> list[str]:
    generated = ray_dashboards_module().dashboards()
    return sorted(n for n in generated if files.get(n) != generated[n])


def test_rays_serve_dashboards_are_this_rays_and_ship_with_the_chart(tools: Tools):
    """Issue 32, item 10: Ray's Serve dashboards existed only inside a running head pod."""
    files = {p.name: p.read_text() for p in RAY_DASHBOARDS.glob("*.json")}
    assert set(files) == {"ray-serve.json", "ray-serve-deployment.json"}
    assert stale_ray_dashboards(files) == []
    rendered = render_forge(tools, applications()["forge"])
    (config_map,) = [
        d
        for d in rendered
        if d["kind"] == "ConfigMap"
        and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    for name, text in files.items():
        assert json.loads(config_map["data"][name]) == json.loads(text), name
    assert json.loads(config_map["data"]["forge-overview.json"]) == dashboard()
    assert len(json.dumps(config_map)) < APPLY_ANNOTATION_LIMIT


def test_a_ray_dashboard_from_another_ray_is_caught():
    files = {p.name: p.read_text() for p in RAY_DASHBOARDS.glob("*.json")}
    files["ray-serve.json"] = files["ray-serve.json"].replace('"rayServeDashboard"', '"old"')
    assert stale_ray_dashboards(files) == ["ray-serve.json"]
