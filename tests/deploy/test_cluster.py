"""cluster/ (the ArgoCD app-of-apps) and scripts/drills/, offline.

No ArgoCD or cluster here, so: every file the root Application syncs parses and is an ArgoCD
object; the Applications validate against a JSON schema of the fields we use (written from
ArgoCD's Application CRD, strict where ArgoCD would silently drop a misspelt field); every source
in this repository points at a path (and values files) that exist; syncs are automated with prune
and selfHeal, chart versions pinned, waves ordered CRDs → operators → Forge. The PostSync eval
gate and the drills' load Job validate as Kubernetes objects (kubernetes-validate --strict); CI's
tag bump is run on a copy; the drill scripts pass ``bash -n``. Each check is fed a broken input
and must catch it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT, ToolFailed, Tools

CLUSTER = ROOT / "cluster"
APPS = CLUSTER / "apps"
DRILLS = ROOT / "scripts" / "drills"
EVAL_GATE = CLUSTER / "forge" / "eval-gate.yaml"
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


def test_the_eval_gate_is_a_postsync_hook_running_evals_with_keys_from_secrets():
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
    done = tools.run("kubernetes-validate", "--strict", str(EVAL_GATE), str(LOAD_JOB))
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
    return needed


def test_the_deploy_guide_creates_every_secret_the_files_reference():
    """Without Grafana's admin Secret the monitoring wave never turns Healthy, and nothing
    after it syncs (issue 32, item 11): the guide creates each Secret, in its namespace."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert needed_secrets() - documented_secrets(guide) == set()
    assert ("monitoring", "grafana-admin") in needed_secrets()


def test_the_secrets_check_catches_the_missing_grafana_admin():
    guide = (ROOT / "docs" / "deploy.md").read_text()
    without = guide.replace("kubectl -n monitoring create secret generic grafana-admin", "")
    assert needed_secrets() - documented_secrets(without) == {("monitoring", "grafana-admin")}
