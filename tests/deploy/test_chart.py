"""helm/forge, the chart that renders Forge's RayService, validated offline.

No helm binary, cluster or KubeRay CRD here, so:

- Helm's own SDK (helm-python-sdk, run in the tools' virtualenv) lints the chart strictly and
  renders it with each values file; values.schema.json refuses bad values;
- the core kinds, and the RayService's head and worker pod templates taken out as Pods (checkov
  does not look inside a RayService), pass ``kubernetes-validate --strict`` and checkov;
- the RayService validates against tests/deploy/rayservice.schema.json (the fields the chart uses,
  written from KubeRay's CRD);
- serveConfigV2 is configs/gke.yaml plus the values' overrides, and loads with Ray's
  ``ServeDeploySchema`` and Forge's own config model; Forge's app is built from it as Serve builds
  it, which gives every deployment's resources and graceful_shutdown_timeout_s;
- Ray's own KubeRay autoscaler config (``_derive_autoscaling_config_from_ray_cr``) sees the GPU
  group's GPU, CPU, memory and accelerator_type:T4, so the pool can scale it from zero;
- each group's grace period covers its preStop sleep plus the longest drain of the replicas Serve
  can place there, inside a spot node's notice on spot groups;
- every pod has enableServiceLinks: false, secrets are only referenced, the NetworkPolicy opens
  only Serve's entry point to the outside, monitoring objects are the observability/ files.

Each check is a function fed a broken input too, and must catch it. Rendering is done once per
session, every case in one call of the tools' interpreter.
"""

from __future__ import annotations

import copy
import datetime
import functools
import importlib
import ipaddress
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT, Tools

CHART = ROOT / "helm" / "forge"
RAYSERVICE_SCHEMA = Path(__file__).with_name("rayservice.schema.json")
RELEASE = NAMESPACE = "forge"
KUBE_VERSION = "1.30.0"  # Chart.yaml's kubeVersion floor
SPOT_NOTICE_S = 30  # GKE: a spot VM gets 30 s between the preemption notice and its end
FORGE_APP = "forge"
# The GPU pools, each in its application of its own (configs/gke.yaml): application/deployment.
POOL_PRIMARY = "forge-pool-primary/pool-primary"
POOL_EMBED = "forge-pool-embed/pool-embed"
RAY_CONTAINERS = {"ray-head", "ray-worker"}

VALUES_FILES = {"default": None, "production": CHART / "values-production.yaml"}

# Checkov checks that do not apply, and why. Everything else must pass.
CHECKOV_SKIPS = {
    "CKV_K8S_8": "liveness: KubeRay injects Ray's own probes into a Ray container that has none",
    "CKV_K8S_9": "readiness: as CKV_K8S_8 (the raylet and dashboard agent, and Serve's "
    "/-/healthz on workers)",
    "CKV_K8S_35": "secrets as env: Forge reads the Redis URLs and the Gemini key from the "
    "variables its serve config names (store.redis_url_env, cache.store.redis_url_env, "
    "fallback.api_key_env); all come from secretKeyRef, and the key hashes are mounted files",
    "CKV_K8S_40": "high UID: Ray's images run as uid 1000 (ray), which owns /home/ray",
    "CKV_K8S_43": "digest: tags are immutable, one per commit, bumped by CI; image.digest pins "
    "by digest where wanted",
}


def deep_merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def values_of(name: str, override: dict | None = None) -> dict:
    path = VALUES_FILES[name]
    base = yaml.safe_load(path.read_text()) if path else {}
    return deep_merge(base, override or {})


# --- rendering (Helm's SDK in the tools' virtualenv) -----------------------------------------

RENDER = """
import json, sys
import helm_python as helm
helm.disable_logging()
chart_dir, release, namespace, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
out = {}
with helm.Chart.load(chart_dir) as chart:
    for name, values in json.loads(cases).items():
        try:
            manifests = chart.render(values=values, name=release, namespace=namespace,
                                     is_install=True)
            out[name] = {"manifests": manifests}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""

LINT = """
import json, sys
import helm_python as helm
helm.disable_logging()
namespace, kube_version, cases = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
for name, (chart_dir, values) in json.loads(cases).items():
    out[name] = helm.lint(chart_dir, values, strict=True, namespace=namespace,
                          kube_version=kube_version)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Render:
    """A render: its documents, or Helm's error."""

    docs: tuple[dict, ...] = ()
    error: str | None = None

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict:
        (doc,) = self.kind(kind)
        return doc


def parse_render(result: dict) -> Render:
    if "error" in result:
        return Render(error=result["error"])
    docs = []
    for path in sorted(result["manifests"]):
        docs += [d for d in yaml.safe_load_all(result["manifests"][path]) if d]
    return Render(docs=tuple(docs))


# Values that render; what they render must fail a check below.
BROKEN_BUT_RENDERING = {
    # Forge's config model refuses a negative tenant weight.
    "rejected-by-forge": {
        "serveConfig": {"forgeArgs": {"tenants": [{"name": "default", "weight": -1}]}}
    },
    # The gateways drain up to 120 s: 60 s cannot hold 5 s of preStop and the drain.
    "short-gateway-grace": {"workers": {"cpu": {"terminationGracePeriodSeconds": 60}}},
    # Gateways on spot: their drain cannot fit a spot node's notice.
    "spot-gateways": {"workers": {"cpu": {"spot": True}}},
    # A spot group whose grace outlasts the notice.
    "long-spot-grace": {"workers": {"gpu": {"terminationGracePeriodSeconds": 45}}},
    # The old cluster deleted while a 120 s stream may still run on it.
    "short-deletion-delay": {"upgradeStrategy": {"oldClusterDeletionDelaySeconds": 60}},
    # The head and the gateways evictable by any drain.
    "no-disruption-budgets": {"podDisruptionBudgets": {"enabled": False}},
    # A gateway more at steady state and at the peak, with the node pool left as it is.
    "more-cpu-workers": {"workers": {"cpu": {"replicas": 3, "minReplicas": 3, "maxReplicas": 5}}},
    # Room for 3 T4 pods while the pools can ask 4 GPUs.
    "small-gpu-group": {"workers": {"gpu": {"maxReplicas": 3}}},
    # The head's GCS in memory only: its loss is the whole Ray cluster's.
    "no-gcs-fault-tolerance": {"gcsFaultTolerance": {"enabled": False}},
    # The GCS's address from the budgets' Redis Secret.
    "gcs-on-the-budgets-redis": {
        "secrets": {"rayGcsRedisAddress": {"name": "forge-redis", "key": "url"}}
    },
    # No weights bucket: nothing mounted where the vLLM pools load from.
    "no-weights-bucket": {"modelWeights": {"bucket": ""}},
    # The T4 pods left to KubeRay's readiness probe: Serve endpoints while their HAProxy is up.
    "gpu-serve-endpoint": {"workers": {"gpu": {"serveEndpoint": True}}},
    # A key in the chart's values, in plain text.
    "literal-secret": {"extraEnv": [{"name": "GEMINI_API_KEY", "value": "AIza" + "x" * 35}]},
}
# Values that must render, exercising an override.
OVERRIDES = {
    "vertex-global": {"serveConfig": {"vertex": {"project": "forge-staging", "region": "global"}}},
    # Forge's code shipped as a Serve config change.
    "py-modules": {"serveConfig": {"runtimeEnv": {"py_modules": ["gs://forge/forge-abc123.zip"]}}},
    "renamed-cache-secret": {
        "secrets": {"cacheRedisUrl": {"name": "forge-cache-redis", "key": "url"}}
    },
    "api-key-fallback": {
        "serveConfig": {
            "forgeArgs": {
                "fallback": {
                    "auth": "api_key",
                    "api_key_env": "GEMINI_API_KEY",
                    "base_url": "https://generativelanguage.googleapis.com/v1beta/openai",
                }
            }
        }
    },
}
# Values the chart must refuse, and a fragment of Helm's message naming what is wrong.
REFUSED = {
    "negative-min-replicas": (
        {"workers": {"gpu": {"minReplicas": -1}}},
        "/workers/gpu/minReplicas",
    ),
    "grace-as-string": (
        {"head": {"terminationGracePeriodSeconds": "60"}},
        "/head/terminationGracePeriodSeconds",
    ),
    "unknown-upgrade-strategy": (
        {"upgradeStrategy": {"type": "BlueGreen"}},
        "/upgradeStrategy/type",
    ),
    "latest-tag": ({"image": {"tag": "latest"}}, "/image/tag"),
    "misspelt-key": ({"workers": {"gpu": {"minReplica": 0}}}, "minReplica"),
    "bad-secret-name": (
        {"secrets": {"redisUrl": {"name": "Forge_Redis"}}},
        "/secrets/redisUrl/name",
    ),
    "bad-cache-secret-name": (
        {"secrets": {"cacheRedisUrl": {"name": "Forge_Cache"}}},
        "/secrets/cacheRedisUrl/name",
    ),
    "bad-vertex-region": (
        {"serveConfig": {"vertex": {"project": "forge-prod", "region": "US Central"}}},
        "/serveConfig/vertex/region",
    ),
    # null deletes a default in Helm: a GPU group without a CPU limit.
    "gpu-without-cpu-limit": (
        {"workers": {"gpu": {"resources": {"limits": {"cpu": None}}}}},
        "/workers/gpu/resources/limits",
    ),
    "gsa-not-an-email": (
        {"serviceAccount": {"gcpServiceAccount": "forge-ray"}},
        "/serviceAccount/gcpServiceAccount",
    ),
    # Caught by the templates (cross-field).
    "vertex-half-set": (
        {"serveConfig": {"vertex": {"project": "forge-prod", "region": ""}}},
        "set both",
    ),
    "replicas-out-of-bounds": (
        {"workers": {"gpu": {"minReplicas": 3, "maxReplicas": 2}}},
        "minReplicas <= replicas <= maxReplicas",
    ),
}


@pytest.fixture(scope="session")
def renders(tools: Tools) -> dict[str, Render]:
    cases = {name: values_of(name) for name in VALUES_FILES}
    cases |= {name: values_of("production", v) for name, v in BROKEN_BUT_RENDERING.items()}
    cases |= {name: values_of("production", v) for name, v in OVERRIDES.items()}
    cases |= {name: values_of("production", v) for name, (v, _) in REFUSED.items()}
    out = tools.python(RENDER, str(CHART), RELEASE, NAMESPACE, json.dumps(cases))
    return {name: parse_render(result) for name, result in out.items()}


@pytest.fixture(scope="session", params=list(VALUES_FILES))
def rendered(request, renders) -> Render:
    """The chart as each values file renders it."""
    render = renders[request.param]
    assert render.error is None, render.error
    return render


# --- Helm: lint, render, schema --------------------------------------------------------------


@pytest.fixture(scope="session")
def lint_reports(tools: Tools, tmp_path_factory) -> dict[str, dict]:
    broken = tmp_path_factory.mktemp("chart") / "forge"
    shutil.copytree(CHART, broken, symlinks=False)  # the copy holds the files the links name
    (broken / "templates" / "broken.yaml").write_text("kind: {{ .Values.image.tag \n")
    cases = {name: (str(CHART), values_of(name)) for name in VALUES_FILES}
    cases["broken-template"] = (str(broken), values_of("default"))
    return tools.python(LINT, NAMESPACE, f"v{KUBE_VERSION}", json.dumps(cases))


def lint_problems(report: dict) -> list[str]:
    """Errors and warnings (strict lint fails on both); info ("icon is recommended") is not."""
    problems = list(report["errors"])
    problems += [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return problems


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_lint_is_clean_with_each_values_file(lint_reports, name):
    report = lint_reports[name]
    assert report["total_charts_linted"] == 1
    assert lint_problems(report) == []


def test_lint_fails_on_a_broken_template(lint_reports):
    assert any("broken.yaml" in p for p in lint_problems(lint_reports["broken-template"]))


def test_each_values_file_renders_every_object(rendered):
    kinds = sorted(d["kind"] for d in rendered.docs)
    assert kinds == [
        "ConfigMap",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "PodDisruptionBudget",
        "PodMonitor",
        "PrometheusRule",
        "RayService",
        "Service",
        "ServiceAccount",
    ]
    for doc in rendered.docs:
        assert doc["metadata"]["namespace"] == NAMESPACE, doc["kind"]


def test_the_chart_reads_the_repository_files_through_symlinks():
    """One source of truth: the chart's files/ are links to the files the rest of Forge uses
    (Helm's loader and ArgoCD follow links that stay inside the repository)."""
    links = {
        "serve-config.yaml": ROOT / "configs" / "gke.yaml",
        "forge-rules.yaml": ROOT / "observability" / "prometheus" / "forge-rules.yaml",
        "forge-overview.json": ROOT / "observability" / "grafana" / "forge-overview.json",
    }
    for name, target in links.items():
        link = CHART / "files" / name
        assert link.is_symlink() and not Path(link.readlink()).is_absolute(), link
        assert link.resolve() == target.resolve()


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_values_are_refused(renders, name):
    _, fragment = REFUSED[name]
    render = renders[name]
    assert render.error is not None, f"{name} rendered"
    assert fragment in render.error


# --- serveConfigV2: configs/gke.yaml, loaded by Serve and by Forge ---------------------------


def serve_config(render: Render) -> dict:
    return yaml.safe_load(render.one("RayService")["spec"]["serveConfigV2"])


def forge_app(config: dict) -> dict:
    (app,) = [a for a in config["applications"] if a["name"] == FORGE_APP]
    return app


def check_serve_config(config: dict) -> None:
    """What KubeRay's dashboard call and Forge's builders do with serveConfigV2: Serve's schema,
    then Forge's own config model on the app's args with its gateway's user_config over them
    (what a gateway replica serves) and each pool's own application held to the gateway's
    entry for it. Raises what they raise."""
    from ray.serve.schema import ServeDeploySchema

    from serve_app.config.live import serve_config_forge

    ServeDeploySchema.model_validate(config)
    serve_config_forge(config, FORGE_APP)


def gke_config() -> dict:
    return yaml.safe_load((ROOT / "configs" / "gke.yaml").read_text())


def test_serve_config_is_configs_gke_yaml(renders):
    assert serve_config(renders["default"]) == gke_config()


def test_production_overrides_only_the_vertex_endpoint(renders):
    expected = gke_config()
    forge_app(expected)["args"]["fallback"]["base_url"] = (
        "https://aiplatform.googleapis.com/v1/projects/forge-prod/locations/global/endpoints/openapi"
    )
    assert serve_config(renders["production"]) == expected


def test_shipped_code_reaches_the_gateway_and_every_pool_application(renders):
    """A pool in its own application runs Forge's code too: without the same py_modules it
    would keep the old code (or none) while the gateway runs the new."""
    apps = {a["name"]: a for a in serve_config(renders["py-modules"])["applications"]}
    for name in (FORGE_APP, "forge-pool-primary", "forge-pool-embed"):
        assert apps[name]["runtime_env"]["py_modules"] == ["gs://forge/forge-abc123.zip"], name
        assert apps[name]["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_HA_PROXY"] == "1", name


def test_vertex_global_endpoint(renders):
    fallback = forge_app(serve_config(renders["vertex-global"]))["args"]["fallback"]
    assert fallback["base_url"] == (
        "https://aiplatform.googleapis.com/v1/projects/forge-staging/locations/global"
        "/endpoints/openapi"
    )


# --- the fallback's model: Vertex's dated list --------------------------------------------------

VERTEX_MODELS = ROOT / "configs" / "vertex-models.yaml"
# Vertex blocks new access to a model this long before its retirement date (the source page of
# configs/vertex-models.yaml): a fresh project cannot call it from then on.
NEW_ACCESS_BLOCKED = datetime.timedelta(days=31)


def fallback_model_problems(
    config: dict, catalogue: dict, today: datetime.date | None = None
) -> list[str]:
    """The fallback's Vertex model is in configs/vertex-models.yaml, a month or more from its
    retirement date on ``today``, and served by the location of the fallback's endpoint (issue
    32, item 3): a retired id answers 404 and the fallback 5xx's every cold start."""
    today = today or datetime.date.today()
    fallback = forge_app(config)["args"]["fallback"]
    model = fallback["model"].removeprefix("google/")
    location = re.search(r"/locations/([^/]+)/", fallback["base_url"])
    entry = catalogue["models"].get(model)
    if entry is None:
        return [f"{model}: not in configs/vertex-models.yaml (no retirement date to check)"]
    problems = []
    if today >= entry["retires"] - NEW_ACCESS_BLOCKED:
        problems.append(
            f"{model}: retires {entry['retires']} (new access blocked a month before), "
            f"today is {today}; Vertex's replacement: {entry.get('replaced_by', 'see the page')}"
        )
    if location is None or location[1] not in entry["locations"]:
        where = location[1] if location else fallback["base_url"]
        problems.append(f"{model}: not served at {where} (served at {entry['locations']})")
    return problems


def vertex_models() -> dict:
    return yaml.safe_load(VERTEX_MODELS.read_text())


def test_the_fallback_model_is_listed_and_not_retiring(rendered):
    assert fallback_model_problems(serve_config(rendered), vertex_models()) == []


def test_every_listed_vertex_model_has_its_dates_and_source():
    catalogue = vertex_models()
    assert catalogue["source"].startswith("https://docs.cloud.google.com/")
    for model, entry in catalogue["models"].items():
        assert entry["released"] < entry["retires"], model
        assert entry["locations"], model


def test_fallback_model_check_catches_a_retired_unlisted_or_misplaced_model(renders):
    catalogue = vertex_models()
    config = serve_config(renders["production"])
    fallback = forge_app(config)["args"]["fallback"]
    fallback["model"] = "google/gemini-2.5-flash"  # the model the chart shipped with
    (problem,) = fallback_model_problems(config, catalogue)
    assert "retires 2026-10-20" in problem
    fallback["model"] = "google/gemini-9-flash"
    assert "not in configs/vertex-models.yaml" in fallback_model_problems(config, catalogue)[0]
    fallback["model"] = "google/gemini-3.8-flash"
    assert fallback_model_problems(config, catalogue) == []
    # The month before retirement already fails: new access is blocked then.
    a_month_before = catalogue["models"]["gemini-3.8-flash"]["retires"] - NEW_ACCESS_BLOCKED
    assert fallback_model_problems(config, catalogue, a_month_before)
    # A regional endpoint that does not serve Gemini 3.
    regional = serve_config(renders["default"])
    forge_app(regional)["args"]["fallback"]["base_url"] = (
        "https://us-central1-aiplatform.googleapis.com/v1/projects/forge-prod"
        "/locations/us-central1/endpoints/openapi"
    )
    (problem,) = fallback_model_problems(regional, catalogue)
    assert "not served at us-central1" in problem


@pytest.mark.parametrize("name", [*VALUES_FILES, *OVERRIDES])
def test_serve_config_loads_with_serve_and_forge(renders, name):
    check_serve_config(serve_config(renders[name]))


def test_a_serve_config_forge_rejects_fails(renders):
    from serve_app.config.models import ConfigError

    with pytest.raises(ConfigError, match="weight"):
        check_serve_config(serve_config(renders["rejected-by-forge"]))


def test_a_serve_config_serve_rejects_fails(renders):
    from pydantic import ValidationError

    config = serve_config(renders["production"])
    config["proxy_location"] = "Everywhere"
    with pytest.raises(ValidationError, match="proxy_location"):
        check_serve_config(config)


def test_haproxy_mode_reaches_every_ray_container(rendered):
    """configs/gke.yaml runs HAProxy's ingress mode from the controller's env: the chart exports
    the controller's env to every Ray container, so every Serve process agrees."""
    controller_env = serve_config(rendered)["controller_options"]["runtime_env"]["env_vars"]
    assert controller_env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for group, spec in pod_specs(rendered.one("RayService")).items():
        env = {e["name"]: e.get("value") for e in ray_container(spec)["env"]}
        for name, value in controller_env.items():
            assert env.get(name) == value, (group, name)


# --- the RayService --------------------------------------------------------------------------


def groups(rayservice: dict) -> dict[str, dict]:
    """The head ("headgroup", as Ray's autoscaler names it) and worker group specs, by name."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    found = {"headgroup": cluster["headGroupSpec"]}
    found |= {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    return found


def pod_specs(rayservice: dict) -> dict[str, dict]:
    return {name: g["template"]["spec"] for name, g in groups(rayservice).items()}


def ray_container(spec: dict) -> dict:
    """KubeRay runs Ray in the first container."""
    container = spec["containers"][0]
    assert container["name"] in RAY_CONTAINERS
    return container


def as_pods(render: Render) -> list[dict]:
    """The head and worker templates as the Pods KubeRay makes of them."""
    rayservice = render.one("RayService")
    pods = []
    for name, group in groups(rayservice).items():
        template = group["template"]
        metadata = {
            "name": f"{rayservice['metadata']['name']}-{name}",
            "namespace": rayservice["metadata"]["namespace"],
            "labels": template["metadata"]["labels"],
        }
        pods.append(
            {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
        )
    return pods


def check_jsonschema(tools: Tools, tmp_path: Path, doc: dict) -> str | None:
    """None if the RayService validates against the schema, else check-jsonschema's output."""
    instance = tmp_path / "rayservice.json"
    instance.write_text(json.dumps(doc))
    done = tools.run("check-jsonschema", "--schemafile", str(RAYSERVICE_SCHEMA), str(instance))
    return None if done.returncode == 0 else done.stdout + done.stderr


def test_rayservice_validates_against_kuberay_schema(tools, rendered, tmp_path):
    assert check_jsonschema(tools, tmp_path, rendered.one("RayService")) is None


@pytest.mark.parametrize(
    "breakage",
    ["misspelt group field", "number in rayStartParams", "unknown upgrade strategy"],
)
def test_rayservice_schema_catches(tools, renders, tmp_path, breakage):
    doc = copy.deepcopy(renders["production"].one("RayService"))
    cluster = doc["spec"]["rayClusterConfig"]
    if breakage == "misspelt group field":
        cluster["workerGroupSpecs"][1]["minReplica"] = cluster["workerGroupSpecs"][1].pop(
            "minReplicas"
        )
    elif breakage == "number in rayStartParams":
        cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    else:
        doc["spec"]["upgradeStrategy"]["type"] = "BlueGreen"
    assert check_jsonschema(tools, tmp_path, doc) is not None


def test_an_image_bump_rolls_out_on_one_t4(rendered):
    """NewCluster rolls a cluster change (an image tag) out, and needs no second T4 because
    every pool of the serve config starts with no GPU replica (the fallback serves meanwhile);
    a pool that starts one would make the new cluster wait for a T4 the old one holds."""
    service = rendered.one("RayService")
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    for app in serve_config["applications"]:
        args = app.get("args") or {}
        pools = args.get("pools", []) + ([args["pool"]] if "pool" in args else [])
        assert pools or app["name"] not in (FORGE_APP, "forge-pool-primary")
        for pool in pools:
            deployment = pool.get("deployment", {})
            gpus = deployment.get("ray_actor_options", {}).get("num_gpus", 0)
            autoscaling = deployment.get("autoscaling_config")
            if gpus:
                assert autoscaling is not None, f"{pool['name']}: a GPU pool needs autoscaling"
                assert autoscaling.get("initial_replicas", autoscaling.get("min_replicas")) == 0, (
                    f"pool {pool['name']} starts a GPU replica: a NewCluster upgrade would wait "
                    "for a second T4"
                )


KUBERAY_DELETION_DELAY_S = 60  # rayClusterDeletionDelaySeconds when the spec leaves it out
SWITCH_MARGIN_S = 30  # KubeRay's switch and the proxies' last reads, after the longest request


def deletion_delay_problems(rayservice: dict) -> list[str]:
    """After a NewCluster switch, KubeRay deletes the old cluster ``rayClusterDeletionDelaySeconds``
    later, with whatever it still serves: the delay must outlast the longest request a pool of
    its serve config allows (``request_timeout_s``), or every deploy cuts the longest streams."""
    from serve_app.config.live import serve_config_forge

    spec = rayservice["spec"]
    if spec.get("upgradeStrategy", {}).get("type") != "NewCluster":
        return []
    delay = spec.get("rayClusterDeletionDelaySeconds", KUBERAY_DELETION_DELAY_S)
    config = serve_config_forge(yaml.safe_load(spec["serveConfigV2"]), FORGE_APP)
    longest = max(pool.request_timeout_s for pool in config.pools)
    if delay < longest + SWITCH_MARGIN_S:
        return [
            f"rayClusterDeletionDelaySeconds {delay} s: the old cluster goes while a request of "
            f"up to {longest:g} s (request_timeout_s) may still run; need >= "
            f"{longest + SWITCH_MARGIN_S:g} s"
        ]
    return []


def test_the_old_cluster_outlives_its_longest_stream(rendered):
    assert deletion_delay_problems(rendered.one("RayService")) == []


def test_deletion_delay_check_catches_kuberays_default_and_a_short_delay(renders):
    service = copy.deepcopy(renders["production"].one("RayService"))
    del service["spec"]["rayClusterDeletionDelaySeconds"]  # as the chart rendered it before
    assert deletion_delay_problems(service), "KubeRay's 60 s default passed"
    short = renders["short-deletion-delay"]
    assert short.error is None, short.error
    assert deletion_delay_problems(short.one("RayService"))


# --- T4s: the attention kernels an SM 7.5 GPU runs ------------------------------------------

# vLLM's attention backends with kernels for SM 7.5 (a T4): FlashAttention 2, FlashInfer and the
# MLA backends need SM 8.0 or later.
SM75_ATTENTION = {"TRITON_ATTN", "TORCH_SDPA", "FLEX_ATTENTION"}


def pool_applications(rayservice: dict) -> list[dict]:
    """Each pool as whatever runs it configures it: its own application's ``args.pool``, or the
    gateway's ``pools`` entry for a pool with no ``app`` (an entry with one only names it)."""
    pools = []
    for app in yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]:
        args = app.get("args") or {}
        pools += [p for p in args.get("pools", []) if p.get("app") is None]
        pools += [args["pool"]] if "pool" in args else []
    return pools


def t4_attention_problems(rayservice: dict) -> list[str]:
    """Every generation pool of vLLM on a T4 pins an attention backend with SM 7.5 kernels
    (issue 32, item 13): left to vLLM, the choice is a guess that changes between releases."""
    problems = []
    for pool in pool_applications(rayservice):
        if pool.get("engine", {}).get("kind") != "vllm":
            continue
        options = pool.get("deployment", {}).get("ray_actor_options", {})
        if options.get("accelerator_type") != "T4" or pool.get("task", "generate") != "generate":
            continue
        backend = pool["engine"].get("engine_args", {}).get("attention_backend")
        if backend not in SM75_ATTENTION:
            problems.append(f"{pool['name']}: attention_backend {backend!r} on a T4")
    return problems


def test_t4_pools_pin_an_attention_backend_the_gpu_runs(rendered):
    assert t4_attention_problems(rendered.one("RayService")) == []


def test_attention_check_catches_an_unpinned_or_sm80_backend(renders):
    service = copy.deepcopy(renders["production"].one("RayService"))
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = [a for a in config["applications"] if a["name"] == "forge-pool-primary"]
    engine_args = app["args"]["pool"]["engine"]["engine_args"]
    for backend in (None, "FLASH_ATTN", "FLASHINFER"):
        engine_args.pop("attention_backend", None)
        if backend is not None:
            engine_args["attention_backend"] = backend
        service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
        assert t4_attention_problems(service), backend


# --- disruption: what a node drain may take ------------------------------------------------


def disruption_problems(render: Render) -> list[str]:
    """A drain (node upgrade, scale-down) never evicts the head while it is alone (its loss is
    the whole Ray cluster's) and takes the gateways one at a time; no budget holds the spot T4
    workers (preemption ignores it, and it would keep an idle T4 node from going away)."""
    budgets = render.kind("PodDisruptionBudget")
    problems = []
    for group, pod in zip(groups(render.one("RayService")), as_pods(render), strict=True):
        labels = pod["metadata"]["labels"]
        held = [
            b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        specs = [{k: v for k, v in b["spec"].items() if k != "selector"} for b in held]
        want = {
            "headgroup": [{"minAvailable": 1}],
            "cpu": [{"maxUnavailable": 1}],
        }.get(group, [])
        if specs != want:
            problems.append(f"{group}: disruption budgets {specs}, want {want}")
    return problems


def test_a_drain_never_takes_the_lone_head_nor_every_gateway(rendered):
    assert disruption_problems(rendered) == []


def test_disruption_check_catches_budgets_turned_off(renders):
    off = renders["no-disruption-budgets"]
    assert off.error is None, off.error
    assert len(disruption_problems(off)) == 2


# --- the usage journal: on a disk the gateway can write ------------------------------------


def journal_problems(rayservice: dict, home: str = "/home/ray") -> list[str]:
    """The gateway's usage journal (``metering/journal.py``) is on a writable mount of every
    Ray container with a read-only root: otherwise each replica starts without one (a
    warning), and a killed replica's unwritten usage is lost."""
    from unittest import mock

    from serve_app.config.models import MeteringConfig
    from serve_app.metering.ledger import journal_directory

    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = [a for a in config["applications"] if a["name"] == FORGE_APP]
    metering = MeteringConfig(**app["args"].get("metering", {}))
    if not metering.journal:
        return ["metering.journal is off: a killed gateway replica's unwritten usage is lost"]
    with mock.patch.dict(os.environ, {"HOME": home}):
        directory = str(journal_directory(metering)).rstrip("/") + "/"
    problems = []
    for group, spec in pod_specs(rayservice).items():
        container = ray_container(spec)
        if not container.get("securityContext", {}).get("readOnlyRootFilesystem"):
            continue
        writable = [
            m["mountPath"].rstrip("/") + "/"
            for m in container.get("volumeMounts", [])
            if not m.get("readOnly")
        ]
        if not any(directory.startswith(path) for path in writable):
            problems.append(f"{group}: the usage journal {directory} is on the read-only root")
    return problems


def test_the_usage_journal_is_on_a_writable_mount(rendered):
    assert journal_problems(rendered.one("RayService")) == []


def test_journal_check_catches_a_read_only_directory_and_the_journal_off(rendered):
    rayservice = copy.deepcopy(rendered.one("RayService"))
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = [a for a in config["applications"] if a["name"] == FORGE_APP]
    del app["args"]["metering"]["journal_dir"]  # the default: ~/.local/share, the root's
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    problems = journal_problems(rayservice)
    assert problems and all("read-only root" in p for p in problems)
    app["args"]["metering"]["journal"] = False
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert journal_problems(rayservice) == [
        "metering.journal is off: a killed gateway replica's unwritten usage is lost"
    ]


# --- the head's loss: GCS fault tolerance on a Redis of its own ---------------------------------


def projected_file(spec: dict, container: dict, path: str) -> dict | None:
    """The Secret item a container sees at ``path`` through a mounted projected volume."""
    directory, name = path.rsplit("/", 1)
    mounts = {m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == directory}
    for volume in spec["volumes"]:
        if volume["name"] not in mounts:
            continue
        for source in volume.get("projected", {}).get("sources", []):
            for item in source.get("secret", {}).get("items", []):
                if item["path"] == name:
                    return {"name": source["secret"]["name"], "key": item["key"]}
    return None


def gcs_fault_tolerance_problems(rayservice: dict) -> list[str]:
    """The head's GCS keeps its tables in a Redis of its own, over TLS, with its password and
    address from Secrets (issue 32, item 15): without it a lost head restarts the whole Ray
    cluster, and on the budgets' or the cache's instance a FLUSH or an eviction there would
    take the cluster's state."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    options = cluster.get("gcsFaultToleranceOptions")
    if options is None:
        return ["no gcsFaultToleranceOptions: a lost head restarts the whole Ray cluster"]
    spec = cluster["headGroupSpec"]["template"]["spec"]
    head = ray_container(spec)
    env = {e["name"]: e for e in head.get("env", [])}
    problems = []
    address = options.get("redisAddress", "")
    secret = None
    if reference := re.fullmatch(r"\$\((\w+)\)", address):
        secret = env.get(reference[1], {}).get("valueFrom", {}).get("secretKeyRef")
        if secret is None:
            problems.append(
                f"redisAddress names ${reference[1]}, which the head container does not take from "
                "a Secret: Kubernetes would not expand it"
            )
    elif not address.startswith("rediss://"):
        problems.append(f"redisAddress {address!r}: not TLS (rediss://)")
    password = options.get("redisPassword", {})
    if "secretKeyRef" not in password.get("valueFrom", {}):
        problems.append("redisPassword is not taken from a Secret")
    forge_stores = {
        env[name]["valueFrom"]["secretKeyRef"]["name"]
        for name in ("FORGE_REDIS_URL", "FORGE_CACHE_REDIS_URL")
        if name in env
    }
    if secret is not None and secret["name"] in forge_stores:
        problems.append(f"the GCS's Redis is {secret['name']}, Forge's budgets' or cache's")
    ca = env.get("RAY_REDIS_CA_CERT", {}).get("value")
    if ca is None or projected_file(spec, head, ca) is None:
        problems.append(f"RAY_REDIS_CA_CERT {ca!r}: no mounted CA to verify the Redis's TLS")
    return problems


def test_the_head_can_be_lost_without_the_cluster(rendered):
    assert gcs_fault_tolerance_problems(rendered.one("RayService")) == []


def test_gcs_fault_tolerance_check_catches_it_off_shared_or_unverified(renders):
    off = renders["no-gcs-fault-tolerance"]
    assert off.error is None, off.error
    (problem,) = gcs_fault_tolerance_problems(off.one("RayService"))
    assert "restarts the whole Ray cluster" in problem
    shared = renders["gcs-on-the-budgets-redis"]
    assert shared.error is None, shared.error
    (problem,) = gcs_fault_tolerance_problems(shared.one("RayService"))
    assert "Forge's budgets' or cache's" in problem
    service = copy.deepcopy(renders["production"].one("RayService"))
    cluster = service["spec"]["rayClusterConfig"]
    cluster["gcsFaultToleranceOptions"]["redisAddress"] = "redis://10.0.0.9:6379"
    cluster["gcsFaultToleranceOptions"]["redisPassword"] = {"value": "in-git"}
    head = ray_container(cluster["headGroupSpec"]["template"]["spec"])
    head["env"] = [e for e in head["env"] if e["name"] != "RAY_REDIS_CA_CERT"]
    assert len(gcs_fault_tolerance_problems(service)) == 3


# --- disk: what the emptyDirs may fill is asked for, and fits the node --------------------------

# Of a node's boot disk, what GKE leaves pods after the system's reservation and the images
# (the CUDA and vLLM image is ~15 GB): a conservative share.
POD_DISK_SHARE = 0.7


def node_disk_gb(pool: str, terraform: Path = ROOT / "terraform") -> float:
    text = (terraform / "modules" / "gke" / "main.tf").read_text()
    block = text[text.index(f'resource "google_container_node_pool" "{pool}"') :]
    return float(re.search(r"disk_size_gb\s*=\s*(\d+)", block).group(1))


def disk_problems(rayservice: dict) -> list[str]:
    """Each Ray pod asks for the ephemeral storage its emptyDirs may fill (a cold start writes
    the model's weights into the cache, ~6.6 GB, and vLLM its compile caches), and that fits the
    pod's node pool's disk (issue 32, item 12): without the request the scheduler counts none of
    it, and a full disk evicts every pod on the node."""
    problems = []
    for name, spec in pod_specs(rayservice).items():
        limits = sum(
            quantity(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"] if "emptyDir" in v
        )
        requested = quantity(
            ray_container(spec)["resources"]["requests"].get("ephemeral-storage", 0)
        )
        if requested < limits:
            problems.append(
                f"{name}: emptyDirs up to {limits:g} GiB, ephemeral-storage asks {requested:g}"
            )
        pool = "gpu" if "num-gpus" in groups(rayservice)[name].get("rayStartParams", {}) else "cpu"
        room = node_disk_gb(pool) * POD_DISK_SHARE * 1e9 / 2**30
        if requested > room:
            problems.append(
                f"{name}: asks {requested:g} GiB of a {pool} node's ~{room:.0f} for pods"
            )
    return problems


def test_every_ray_pod_asks_for_the_disk_its_caches_fill(rendered):
    assert disk_problems(rendered.one("RayService")) == []


def test_disk_check_catches_a_cache_without_its_request(renders):
    service = copy.deepcopy(renders["production"].one("RayService"))
    gpu = ray_container(gpu_group(service)["template"]["spec"])
    del gpu["resources"]["requests"]["ephemeral-storage"]  # as the chart rendered it before
    (problem,) = disk_problems(service)
    assert "ephemeral-storage asks 0" in problem


# --- weights: the bucket Terraform creates, mounted where the vLLM pools load from -------------

FUSE_DRIVER = "gcsfuse.csi.storage.gke.io"


def terraform_weights_bucket(tfvars: Path = ROOT / "terraform" / "terraform.tfvars.example") -> str:
    """The weights bucket's name as Terraform makes it (weights.tf) for the example inputs."""
    source = (ROOT / "terraform" / "weights.tf").read_text()
    resource = source[source.index('resource "google_storage_bucket" "weights"') :]
    template = re.search(r'name\s*=\s*"([^"]+)"', resource).group(1)
    values = tfvars.read_text()
    project = re.search(r'^project_id\s*=\s*"([^"]+)"', values, re.M).group(1)
    name = template.replace("${var.project_id}", project)
    name = name.replace("${var.cluster_name}", terraform_default("cluster_name"))
    assert "${" not in name, f"bucket name {template!r}: a reference this test cannot follow"
    return name


def weights_problems(rayservice: dict, bucket: str) -> list[str]:
    """Every vLLM pool on the GPU group loads its model from under the read-only GCS FUSE mount
    of Terraform's weights bucket in that group's Ray container, and the pod asks GKE for the
    FUSE sidecar (issue 32, item 12): otherwise each cold start downloads the weights from
    Hugging Face (or, with the mount and a Hub id, still does)."""
    group = gpu_group(rayservice)
    spec = group["template"]["spec"]
    mounts = {m["name"]: m for m in ray_container(spec).get("volumeMounts", [])}
    fuse = {
        v["name"]: v["csi"]
        for v in spec["volumes"]
        if v.get("csi", {}).get("driver") == FUSE_DRIVER and v["name"] in mounts
    }
    problems = []
    paths = {}
    for name, csi in fuse.items():
        if csi["volumeAttributes"].get("bucketName") != bucket:
            got = csi["volumeAttributes"].get("bucketName")
            problems.append(f"{name}: mounts {got!r}, Terraform's bucket is {bucket!r}")
        if not (csi.get("readOnly") and mounts[name].get("readOnly")):
            problems.append(f"{name}: not read-only")
        paths[name] = mounts[name]["mountPath"].rstrip("/") + "/"
    annotations = group["template"]["metadata"].get("annotations", {})
    if fuse and annotations.get("gke-gcsfuse/volumes") != "true":
        problems.append("the GPU pods do not ask for the GCS FUSE sidecar (gke-gcsfuse/volumes)")
    for pool in pool_applications(rayservice):
        engine = pool.get("engine", {})
        if engine.get("kind") != "vllm":
            continue
        if not any(engine["model"].startswith(path) for path in paths.values()):
            problems.append(
                f"{pool['name']}: loads {engine['model']!r}, not from the weights mount "
                f"({sorted(paths.values()) or 'none'})"
            )
    return problems


def test_the_gpu_pools_load_their_weights_from_terraforms_bucket(rendered):
    assert weights_problems(rendered.one("RayService"), terraform_weights_bucket()) == []


def test_weights_check_catches_a_hub_id_no_mount_and_another_bucket(renders):
    bucket = terraform_weights_bucket()
    assert bucket == "forge-prod-forge-weights"
    service = copy.deepcopy(renders["production"].one("RayService"))
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = [a for a in config["applications"] if a["name"] == "forge-pool-primary"]
    app["args"]["pool"]["engine"]["model"] = "Qwen/Qwen2.5-3B-Instruct"  # as the config was
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    (problem,) = weights_problems(service, bucket)
    assert "primary: loads 'Qwen/Qwen2.5-3B-Instruct'" in problem
    unmounted = renders["no-weights-bucket"]
    assert unmounted.error is None, unmounted.error
    assert len(weights_problems(unmounted.one("RayService"), bucket)) == 2  # both pools
    assert "Terraform's bucket" in weights_problems(renders["production"].one("RayService"), "x")[0]
    no_sidecar = copy.deepcopy(renders["production"].one("RayService"))
    del gpu_group(no_sidecar)["template"]["metadata"]["annotations"]
    assert "FUSE sidecar" in weights_problems(no_sidecar, bucket)[0]


# --- CPU nodes: the head and the gateways at steady state and through a NewCluster upgrade ---

# What a CPU node offers pods: GKE's allocatable (its documented reservations: CPU 6 % of the
# first core, 1 % of the next, 0.5 % of each of the next two; memory 25 % of the first 4 GiB,
# 20 % of the next 4, 10 % of the next 8, and 100 MiB for eviction), less what GKE's own
# DaemonSets ask on every node (kube-proxy, logging and metrics agents, CSI drivers: ~0.3 CPU,
# ~0.5 GiB).
MACHINES = {"e2-standard-4": (4.0, 16.0), "e2-standard-8": (8.0, 32.0)}  # vCPU, GiB
DAEMONSETS = (0.3, 0.5)


def allocatable(machine: str) -> tuple[float, float]:
    cpu, memory = MACHINES[machine]
    cpu_reserved = 0.06 + 0.01 * min(1, cpu - 1) + 0.005 * min(2, max(0, cpu - 2))
    tiers = [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06)]
    memory_reserved, left = 0.1, memory
    for size, share in tiers:
        memory_reserved += share * min(size, left)
        left -= min(size, left)
    return cpu - cpu_reserved - DAEMONSETS[0], memory - memory_reserved - DAEMONSETS[1]


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity as cores or GiB."""
    text = str(value)
    units = {"m": 1e-3, "Ki": 2**-20, "Mi": 2**-10, "Gi": 1.0, "Ti": 2**10}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def pod_requests(spec: dict, extra: Sequence[dict] = ()) -> tuple[float, float]:
    containers = [*spec["containers"], *extra]
    cpu = sum(quantity(c["resources"]["requests"]["cpu"]) for c in containers)
    memory = sum(quantity(c["resources"]["requests"]["memory"]) for c in containers)
    return cpu, memory


def nodes_needed(pods: list[tuple[float, float]], node: tuple[float, float]) -> int:
    """First fit, largest first: the nodes the cluster autoscaler needs for ``pods`` at least."""
    free: list[list[float]] = []
    for cpu, memory in sorted(pods, reverse=True):
        assert cpu <= node[0] and memory <= node[1], (
            f"a pod of {cpu:g} CPU, {memory:g} GiB fits no node"
        )
        for room in free:
            if room[0] >= cpu and room[1] >= memory:
                room[0] -= cpu
                room[1] -= memory
                break
        else:
            free.append([node[0] - cpu, node[1] - memory])
    return len(free)


def terraform_default(name: str, terraform: Path = ROOT / "terraform") -> object:
    variables = (terraform / "variables.tf").read_text()
    block = variables[variables.index(f'variable "{name}"') :]
    return yaml.safe_load(re.search(r"default\s*=\s*(.+)", block).group(1).strip())


def cpu_pool_problems(rayservice: dict, machine: str, max_nodes: int) -> list[str]:
    """The CPU pool's nodes hold the Ray cluster's CPU pods at steady state (the head with its
    autoscaler, the CPU group at ``replicas``), at the CPU group's ``maxReplicas``, and through a
    NewCluster upgrade, when KubeRay brings up a whole second cluster (head and CPU group at
    ``replicas``) before it deletes the old one (issue 32, item 1). GPU pods go to the T4 pool."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = pod_requests(
        cluster["headGroupSpec"]["template"]["spec"], [cluster["autoscalerOptions"]]
    )
    cpu_groups = [g for g in groups(rayservice).values() if g is not cluster["headGroupSpec"]]
    cpu_groups = [g for g in cpu_groups if "num-gpus" not in g.get("rayStartParams", {})]
    steady = [head] + [
        pod_requests(g["template"]["spec"]) for g in cpu_groups for _ in range(g["replicas"])
    ]
    peak = [head] + [
        pod_requests(g["template"]["spec"]) for g in cpu_groups for _ in range(g["maxReplicas"])
    ]
    node = allocatable(machine)
    problems = []
    for what, pods in (
        ("at steady state", steady),
        ("at the CPU group's maxReplicas", peak),
        (
            "during a NewCluster upgrade (the old cluster at its peak, the new one starting)",
            peak + steady,
        ),
    ):
        need = nodes_needed(pods, node)
        if need > max_nodes:
            problems.append(f"{what}: {need} {machine} nodes needed, cpu_max_nodes is {max_nodes}")
    return problems


def test_the_cpu_pool_holds_the_cluster_through_an_upgrade(rendered):
    zones = max(1, len(terraform_default("cpu_node_zones")))
    machine, max_nodes = terraform_default("cpu_machine_type"), terraform_default("cpu_max_nodes")
    assert cpu_pool_problems(rendered.one("RayService"), machine, max_nodes * zones) == []


def test_cpu_pool_check_catches_the_old_node_limit_and_fat_pods(renders):
    service = renders["production"].one("RayService")
    machine = terraform_default("cpu_machine_type")
    old_limit = cpu_pool_problems(service, machine, 4)  # the node pool's limit before
    assert any("NewCluster" in problem for problem in old_limit), old_limit
    more = renders["more-cpu-workers"]
    assert more.error is None, more.error
    assert cpu_pool_problems(more.one("RayService"), machine, terraform_default("cpu_max_nodes"))


def test_a_cpu_node_offers_what_gke_documents():
    cpu, memory = allocatable("e2-standard-4")
    assert (round(cpu + DAEMONSETS[0], 2), round(memory + DAEMONSETS[1], 1)) == (3.92, 13.3)


# --- GPUs: what the pools can ask, the group can hold, and Terraform can start ---------------


def terraform_gpu_nodes(terraform: Path = ROOT / "terraform") -> int:
    """The T4 nodes Terraform's defaults allow: ``gpu_max_nodes`` in all, when the pool caps
    its total (``total_max_node_count``), else per zone of ``gpu_node_zones`` (none listed:
    the cluster's one zone)."""
    module = (terraform / "modules" / "gke" / "main.tf").read_text()
    pool = module[module.index('resource "google_container_node_pool" "gpu"') :]
    if "total_max_node_count = var.gpu_max_nodes" in pool:
        return terraform_default("gpu_max_nodes")
    return terraform_default("gpu_max_nodes") * max(1, len(terraform_default("gpu_node_zones")))


def gpu_budget_problems(rayservice: dict, terraform_nodes: int) -> list[str]:
    """Every GPU replica the pools may run at once (``max_replicas`` x ``num_gpus``) has a place:
    the GPU group's ``maxReplicas`` pods hold them and Terraform's node pool can start those
    pods. Otherwise the last replica asked stays Pending, and when it is the embed pool's, the
    T4 it took from chat is the one a chat replica waits for (issue 32, item 9)."""
    problems = []
    demand = 0.0
    for pool in pool_applications(rayservice):
        deployment = pool.get("deployment", {})
        gpus = deployment.get("ray_actor_options", {}).get("num_gpus", 0)
        if gpus:
            replicas = (deployment.get("autoscaling_config") or {}).get(
                "max_replicas", deployment.get("num_replicas", 1)
            )
            demand += gpus * replicas
    group = gpu_group(rayservice)
    per_pod = float(
        ray_container(group["template"]["spec"])["resources"]["limits"]["nvidia.com/gpu"]
    )
    held = group["maxReplicas"] * per_pod
    if demand > held:
        problems.append(f"the pools can ask {demand:g} GPUs; the GPU group holds {held:g}")
    if group["maxReplicas"] > terraform_nodes:
        problems.append(
            f"the GPU group may grow to {group['maxReplicas']} pods; Terraform's node pool "
            f"starts at most {terraform_nodes} T4 nodes"
        )
    return problems


def test_every_gpu_replica_the_pools_can_ask_has_a_t4(rendered):
    assert gpu_budget_problems(rendered.one("RayService"), terraform_gpu_nodes()) == []


def test_gpu_budget_check_catches_a_group_or_node_pool_too_small(renders):
    small = renders["small-gpu-group"]
    assert small.error is None, small.error
    assert gpu_budget_problems(small.one("RayService"), terraform_gpu_nodes())
    service = renders["production"].one("RayService")
    assert gpu_budget_problems(service, 2), "Terraform's old 2 T4 nodes passed"
    grown = copy.deepcopy(service)  # the primary back at 4 replicas: 5 GPUs for 4 pods
    config = yaml.safe_load(grown["spec"]["serveConfigV2"])
    (app,) = [a for a in config["applications"] if a["name"] == "forge-pool-primary"]
    app["args"]["pool"]["deployment"]["autoscaling_config"]["max_replicas"] = 4
    grown["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert gpu_budget_problems(grown, terraform_gpu_nodes())


# --- the autoscaler: the GPU group scales from zero ------------------------------------------


@dataclass(frozen=True)
class Deployment:
    name: str
    resources: dict[str, float]  # a replica's demand, as Ray schedules it
    graceful_shutdown_timeout_s: float


@functools.cache
def _deployments(serve_config_text: str) -> tuple[Deployment, ...]:
    from ray.serve._private import constants
    from ray.serve._private.build_app import build_app

    config = yaml.safe_load(serve_config_text)
    controller_env = config.get("controller_options", {}).get("runtime_env", {})
    haproxy = controller_env.get("env_vars", {}).get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    # Serve's floor for an ingress replica in HAProxy's direct-ingress mode (deploy_utils).
    floor = (
        constants.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S
        + constants.RAY_SERVE_DIRECT_INGRESS_SHUTDOWN_BUFFER_S
    )
    found = []
    for app in config["applications"]:  # Forge's: the gateway's and each pool's own
        module, _, attr = app["import_path"].partition(":")
        if module != "serve_app.app":
            continue
        builder = getattr(importlib.import_module(module), attr)
        built = build_app(builder(app["args"]), name=app["name"])
        overrides = {d["name"]: d for d in app.get("deployments", [])}
        for d in built.deployments:
            resources = dict(d._replica_config.resource_dict)
            grace = d._deployment_config.graceful_shutdown_timeout_s
            override = overrides.get(d.name, {})
            grace = override.get("graceful_shutdown_timeout_s", grace)
            assert "ray_actor_options" not in override, "resources overridden in serveConfigV2"
            if haproxy and d.name == built.ingress_deployment_name:
                grace = max(grace, floor)
            name = d.name if app["name"] == FORGE_APP else f"{app['name']}/{d.name}"
            found.append(Deployment(name, resources, float(grace)))
    return tuple(found)


def deployments(render: Render) -> tuple[Deployment, ...]:
    return _deployments(render.one("RayService")["spec"]["serveConfigV2"])


def autoscaling_config(rayservice: dict) -> dict:
    """Ray's own reading of the cluster spec (what its KubeRay autoscaler scales from)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    ray_cr = {"metadata": rayservice["metadata"], "spec": rayservice["spec"]["rayClusterConfig"]}
    return _derive_autoscaling_config_from_ray_cr(ray_cr)


def fits(node: dict[str, float], demand: dict[str, float]) -> bool:
    # Ray keeps work that needs no GPU off GPU nodes while others have room (the scheduler's
    # avoid-GPU-nodes rule): count such work only on non-GPU groups.
    if not demand.get("GPU") and node.get("GPU"):
        return False
    return all(node.get(k, 0) >= v for k, v in demand.items() if v > 0)


def placements(rayservice: dict, deps: tuple[Deployment, ...]) -> dict[str, list[Deployment]]:
    """Where Serve can place each deployment's replicas: the node types whose advertised
    resources cover its demand. Fails if a deployment fits none: the autoscaler could never
    start a node for it (the GPU group's scale-from-zero, for the pool)."""
    node_types = autoscaling_config(rayservice)["available_node_types"]
    placed: dict[str, list[Deployment]] = {name: [] for name in node_types}
    for d in deps:
        homes = [n for n, t in node_types.items() if fits(t["resources"], d.resources)]
        if not homes:
            raise AssertionError(f"no worker group advertises what {d.name} needs: {d.resources}")
        for name in homes:
            placed[name].append(d)
    return placed


def gpu_group(rayservice: dict) -> dict:
    (group,) = [g for g in groups(rayservice).values() if "num-gpus" in g.get("rayStartParams", {})]
    return group


def test_gpu_group_advertises_what_the_pools_ask_for(rendered):
    """Every GPU pool (the chat model's and the embedding model's) fits one T4 worker."""
    rayservice = rendered.one("RayService")
    pools = [d for d in deployments(rendered) if d.resources.get("GPU")]
    assert {p.name for p in pools} == {POOL_PRIMARY, POOL_EMBED}
    name = gpu_group(rayservice)["groupName"]
    node = autoscaling_config(rayservice)["available_node_types"][name]
    assert node["min_workers"] == 0
    assert node["resources"]["accelerator_type:T4"] == 1
    assert node["resources"]["memory"] > 0
    for pool in pools:
        assert node["resources"]["GPU"] >= pool.resources["GPU"]
        assert node["resources"]["CPU"] >= pool.resources["CPU"]
        assert fits(node["resources"], pool.resources)


def test_every_deployment_has_a_group_to_scale(rendered):
    placed = placements(rendered.one("RayService"), deployments(rendered))
    names = {n: {d.name for d in ds} for n, ds in placed.items()}
    anchors = {"forge-pool-primary/ingress", "forge-pool-embed/ingress"}  # replica/pool_ingress.py
    control = {"forge-control/scheduler-primary", "forge-control/breaker-board"}
    assert names["headgroup"] == control | anchors
    assert names["cpu"] == {"gateway"} | control | anchors
    assert names["gpu-t4"] == {POOL_PRIMARY, POOL_EMBED}


def test_a_gpu_group_without_the_accelerator_resource_cannot_scale_the_pool(renders):
    rayservice = copy.deepcopy(renders["production"].one("RayService"))
    del gpu_group(rayservice)["rayStartParams"]["resources"]
    with pytest.raises(AssertionError, match="pool-primary"):
        placements(rayservice, deployments(renders["production"]))


def test_a_gpu_group_without_cpu_limits_cannot_be_scaled(renders):
    rayservice = copy.deepcopy(renders["production"].one("RayService"))
    container = ray_container(gpu_group(rayservice)["template"]["spec"])
    for kind in ("limits", "requests"):
        del container["resources"][kind]["cpu"]
    with pytest.raises(ValueError, match="CPU"):
        autoscaling_config(rayservice)


# --- drain arithmetic ------------------------------------------------------------------------


def prestop_sleep(container: dict) -> int:
    """Seconds the preStop hook sleeps (an exec of sleep, or the sleep action)."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    if command and Path(command[0]).name == "sleep":
        return int(command[1])
    assert not hook, f"a preStop hook the drain check cannot read: {hook}"
    return 0


def drain_problems(rayservice: dict, deps: tuple[Deployment, ...]) -> list[str]:
    """Per group: Kubernetes counts the preStop sleep inside terminationGracePeriodSeconds, then
    SIGTERMs `ray start`, whose drain (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) must outlast the
    longest graceful_shutdown_timeout_s of the replicas Serve can place there and end before
    the kubelet's SIGKILL. A spot group's grace must fit the spot notice."""
    from ray._private import ray_constants

    problems = []
    placed = placements(rayservice, deps)
    for name, spec in pod_specs(rayservice).items():
        container = ray_container(spec)
        grace = spec.get("terminationGracePeriodSeconds", 30)
        sleep = prestop_sleep(container)
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        ray_drain = float(
            env.get(
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S",
                ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S,
            )
        )
        drain = max((d.graceful_shutdown_timeout_s for d in placed[name]), default=0)
        if grace < sleep + drain:
            problems.append(f"{name}: grace {grace}s < preStop {sleep}s + drain {drain}s")
        if ray_drain < drain:
            problems.append(f"{name}: Ray's drain {ray_drain}s < replicas' drain {drain}s")
        if sleep + ray_drain > grace:
            problems.append(f"{name}: preStop {sleep}s + Ray's drain {ray_drain}s > grace {grace}s")
        if spec.get("nodeSelector", {}).get("cloud.google.com/gke-spot") == "true":
            if grace > SPOT_NOTICE_S:
                problems.append(f"{name}: spot, grace {grace}s > notice {SPOT_NOTICE_S}s")
    return problems


def test_grace_periods_cover_the_drain(rendered):
    assert drain_problems(rendered.one("RayService"), deployments(rendered)) == []


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("short-gateway-grace", "cpu: grace 60s < preStop 5s + drain 120.0s"),
        ("spot-gateways", "cpu: spot, grace 130s > notice 30s"),
        ("long-spot-grace", "gpu-t4: spot, grace 45s > notice 30s"),
    ],
)
def test_drain_arithmetic_catches(renders, name, problem):
    render = renders[name]
    assert problem in drain_problems(render.one("RayService"), deployments(render))


def test_drain_arithmetic_catches_a_drain_cut_by_the_kubelet(renders):
    rayservice = copy.deepcopy(renders["production"].one("RayService"))
    container = ray_container(pod_specs(rayservice)["gpu-t4"])
    (env,) = [e for e in container["env"] if e["name"] == "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]
    env["value"] = "30"
    assert "gpu-t4: preStop 2s + Ray's drain 30.0s > grace 20s" in drain_problems(
        rayservice, deployments(renders["production"])
    )


# --- the Serve Service: which pods KubeRay makes its endpoints ---------------------------------

SERVE_LABEL = "ray.io/serve"
NEVER_PASSES = (["false"], ["/bin/false"])


def serve_endpoint_groups(rayservice: dict) -> set[str]:
    """The groups whose pods can be endpoints of the Serve Service, as KubeRay 1.7.1 (the
    release cluster/apps pins) builds it: the selector is ``ray.io/cluster=<cluster>,
    ray.io/serve=true`` whatever ``spec.serveService`` says (common/service.go,
    BuildServeService: "ignore any custom ServeService selectors or labels"); BuildPod
    (common/pod.go) sets ``ray.io/serve=true`` on every RayService worker over the template's
    labels; the controller sets the head's to its proxy's health, or false with
    ``excludeHeadPodFromServeSvc``. So a worker is an endpoint while it is Ready, and its
    readiness is KubeRay's probe (the raylet, then the Serve proxy's /-/healthz on :8000: up
    whenever the pod's HAProxy is) unless its Ray container brings its own."""
    spec = rayservice["spec"]
    found = set()
    for name, group in groups(rayservice).items():
        if name == "headgroup":
            if not spec.get("excludeHeadPodFromServeSvc", False):
                found.add(name)
            continue
        labels = {**group["template"]["metadata"].get("labels", {}), SERVE_LABEL: "true"}
        probe = ray_container(group["template"]["spec"]).get("readinessProbe")
        never_ready = probe is not None and probe.get("exec", {}).get("command") in NEVER_PASSES
        if labels[SERVE_LABEL] == "true" and not never_ready:
            found.add(name)
    return found


def serve_endpoint_problems(rayservice: dict) -> list[str]:
    """Only the on-demand gateway workers are Serve endpoints (issue 32, item 5): a spot T4 pod
    in the Service relays client streams through HAProxy on a node that may be preempted with
    30 s notice, and the head's relays load the pod whose loss is the cluster's."""
    found = serve_endpoint_groups(rayservice)
    spot = {
        name
        for name, spec in pod_specs(rayservice).items()
        if spec.get("nodeSelector", {}).get("cloud.google.com/gke-spot") == "true"
    }
    cpu = {
        name
        for name, group in groups(rayservice).items()
        if name != "headgroup" and "num-gpus" not in group.get("rayStartParams", {})
    }
    problems = [f"{name}: a spot group's pods are Serve endpoints" for name in sorted(found & spot)]
    if "headgroup" in found:
        problems.append("headgroup: the head is a Serve endpoint (excludeHeadPodFromServeSvc)")
    problems += [
        f"{name}: not a CPU gateway group" for name in sorted(found - cpu - spot - {"headgroup"})
    ]
    if not found & cpu:
        problems.append("no CPU gateway group is a Serve endpoint: the Service has none")
    return problems


def test_only_the_cpu_gateways_are_serve_endpoints(rendered):
    service = rendered.one("RayService")
    assert serve_endpoint_groups(service) == {"cpu"}
    assert serve_endpoint_problems(service) == []


def test_serve_endpoint_check_catches_t4_pods_the_head_and_a_custom_selector(renders):
    gpu_endpoint = renders["gpu-serve-endpoint"]
    assert gpu_endpoint.error is None, gpu_endpoint.error
    (problem,) = serve_endpoint_problems(gpu_endpoint.one("RayService"))
    assert problem.startswith("gpu-t4: a spot group")
    # As the chart rendered before: KubeRay's own probes everywhere and the head included. A
    # selector in spec.serveService changes nothing: KubeRay overwrites it.
    before = copy.deepcopy(renders["production"].one("RayService"))
    del before["spec"]["excludeHeadPodFromServeSvc"]
    for group in groups(before).values():
        ray_container(group["template"]["spec"]).pop("readinessProbe", None)
    before["spec"]["serveService"]["spec"]["selector"] = {
        "app.kubernetes.io/component": "ray-worker-cpu"
    }
    assert serve_endpoint_groups(before) == {"headgroup", "cpu", "gpu-t4"}
    assert len(serve_endpoint_problems(before)) == 2
    # Nothing left at all.
    nobody = copy.deepcopy(renders["production"].one("RayService"))
    for group in groups(nobody).values():
        ray_container(group["template"]["spec"])["readinessProbe"] = {
            "exec": {"command": ["false"]}
        }
    assert "the Service has none" in serve_endpoint_problems(nobody)[-1]


# --- pods: scheduling, service links, secrets ------------------------------------------------


def test_gpu_workers_go_to_spot_t4_nodes_and_the_rest_off_spot(rendered):
    specs = pod_specs(rendered.one("RayService"))
    gpu = specs["gpu-t4"]
    assert gpu["nodeSelector"] == {
        "cloud.google.com/gke-spot": "true",
        "cloud.google.com/gke-accelerator": "nvidia-tesla-t4",
    }
    assert {t["key"] for t in gpu["tolerations"]} == {"cloud.google.com/gke-spot", "nvidia.com/gpu"}
    assert ray_container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for name in ("headgroup", "cpu"):
        terms = specs[name]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        (term,) = terms["nodeSelectorTerms"]
        assert {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"} in term[
            "matchExpressions"
        ]


def service_link_problems(render_docs: list[dict]) -> list[str]:
    """Every pod spec (RayService groups, and any workload) must set enableServiceLinks: false."""
    problems = []
    for doc in render_docs:
        specs = pod_specs(doc) if doc["kind"] == "RayService" else {}
        if doc["kind"] == "Pod":
            specs = {doc["metadata"]["name"]: doc["spec"]}
        for name, spec in specs.items():
            if spec.get("enableServiceLinks") is not False:
                problems.append(f"{doc['kind']} {name}")
    return problems


def test_no_service_links(rendered):
    assert service_link_problems(list(rendered.docs)) == []


def test_service_links_check_catches_a_pod_without_it(renders):
    rayservice = copy.deepcopy(renders["production"].one("RayService"))
    del pod_specs(rayservice)["gpu-t4"]["enableServiceLinks"]
    assert service_link_problems([rayservice]) == ["RayService gpu-t4"]


SECRET_NAME = re.compile(r"KEY|TOKEN|PASSWORD|SECRET|CREDENTIAL|REDIS_URL", re.IGNORECASE)
SECRET_TEXT = re.compile(
    r"AIza[0-9A-Za-z_-]{35}|sk-[A-Za-z0-9]{20,}|-----BEGIN [A-Z ]*PRIVATE KEY|rediss?://[^\s/@]+@"
)


def secret_problems(render: Render) -> list[str]:
    """Secrets only by reference: no Secret objects, no secret-looking text anywhere, and every
    secret-named variable (and those the serve config reads secrets from) from a secretKeyRef."""
    problems = [f"Secret {d['metadata']['name']}" for d in render.kind("Secret")]
    problems += [
        f"{d['kind']}: {m.group()[:8]}..."
        for d in render.docs
        for m in [SECRET_TEXT.search(json.dumps(d))]
        if m
    ]
    args = forge_app(serve_config(render))["args"]
    from_config = {
        args.get("store", {}).get("redis_url_env"),
        (args.get("cache", {}).get("store") or {}).get("redis_url_env"),
        args.get("metering", {}).get("database_url_env"),
        args["fallback"].get("api_key_env"),
    }
    for group, spec in pod_specs(render.one("RayService")).items():
        env = {e["name"]: e for e in ray_container(spec)["env"]}
        for name in from_config - {None}:
            if name not in env:
                problems.append(f"{group}: {name} missing")
        for name, entry in env.items():
            if SECRET_NAME.search(name) or name in from_config:
                if "secretKeyRef" not in entry.get("valueFrom", {}):
                    problems.append(f"{group}: {name} not from a Secret")
    return problems


@pytest.mark.parametrize("name", [*VALUES_FILES, "api-key-fallback"])
def test_secrets_are_only_referenced(renders, name):
    assert secret_problems(renders[name]) == []


def test_the_gemini_key_is_referenced_in_api_key_mode(renders):
    spec = pod_specs(renders["api-key-fallback"].one("RayService"))["cpu"]
    env = {e["name"]: e for e in ray_container(spec)["env"]}
    assert env["GEMINI_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "forge-gemini",
        "key": "api-key",
    }
    # workload identity (configs/gke.yaml) needs no key at all
    spec = pod_specs(renders["production"].one("RayService"))["cpu"]
    assert "GEMINI_API_KEY" not in {e["name"] for e in ray_container(spec)["env"]}


CACHE_SECRETS = {"default": "forge-redis-cache", "production": "forge-redis-cache"}


@pytest.mark.parametrize(
    ("name", "cache_secret"),
    [*CACHE_SECRETS.items(), ("renamed-cache-secret", "forge-cache-redis")],
)
def test_budgets_and_cache_read_their_own_redis_secrets(renders, name, cache_secret):
    """The budgets' Memorystore and the cache's are two instances, two URLs, two Secrets: each
    variable the serve config names comes from its own, in every group."""
    args = forge_app(serve_config(renders[name]))["args"]
    want = {
        args["store"]["redis_url_env"]: {"name": "forge-redis", "key": "url"},
        args["cache"]["store"]["redis_url_env"]: {"name": cache_secret, "key": "url"},
    }
    assert len(want) == 2  # two variables, not one named twice
    for group, spec in pod_specs(renders[name].one("RayService")).items():
        env = {e["name"]: e for e in ray_container(spec)["env"]}
        for variable, ref in want.items():
            assert env[variable]["valueFrom"]["secretKeyRef"] == ref, (group, variable)


def test_secret_check_catches_a_literal_key(renders):
    problems = secret_problems(renders["literal-secret"])
    assert "cpu: GEMINI_API_KEY not from a Secret" in problems
    assert any(p.startswith("RayService: AIza") for p in problems)


def test_key_hashes_are_mounted_where_the_serve_config_reads_them(rendered):
    """And the Memorystore CAs beside them, where terraform's redis_url and redis_cache_url name
    them (the cache's only while the cache has a store of its own), and the GCS Redis's where
    the head's RAY_REDIS_CA_CERT names it (while GCS fault tolerance is on)."""
    args = forge_app(serve_config(rendered))["args"]
    keys_dir = args["key_hashes_file"].rsplit("/", 1)[0]
    files = {args["key_hashes_file"], args["admin"]["key_hashes_file"], f"{keys_dir}/redis-ca.pem"}
    if args.get("cache", {}).get("store"):
        files.add(f"{keys_dir}/redis-cache-ca.pem")
    if "gcsFaultToleranceOptions" in rendered.one("RayService")["spec"]["rayClusterConfig"]:
        files.add(f"{keys_dir}/ray-gcs-redis-ca.pem")
    for group, spec in pod_specs(rendered.one("RayService")).items():
        (mount,) = [m for m in ray_container(spec)["volumeMounts"] if m["name"] == "forge-keys"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "forge-keys"]
        paths = {
            f"{mount['mountPath']}/{item['path']}"
            for source in volume["projected"]["sources"]
            for item in source["secret"]["items"]
        }
        assert paths == files, group
        assert mount["readOnly"] is True


def terraform_pods_account(tfvars: Path = ROOT / "terraform" / "terraform.tfvars.example") -> str:
    """The Google service account Terraform creates for the pods, as its output names it:
    ``account_id`` from workload_identity.tf with ``cluster_name`` (the tfvars', else the
    variable's default) and the tfvars' ``project_id``."""
    terraform = ROOT / "terraform"
    source = (terraform / "workload_identity.tf").read_text()
    resource = source[source.index('resource "google_service_account" "forge"') :]
    template = re.search(r'account_id\s*=\s*"([^"]+)"', resource).group(1)
    variables = (terraform / "variables.tf").read_text()
    block = variables[variables.index('variable "cluster_name"') :]
    cluster = re.search(r'default\s*=\s*"([^"]+)"', block).group(1)
    values = tfvars.read_text()
    if found := re.search(r'^cluster_name\s*=\s*"([^"]+)"', values, re.M):
        cluster = found.group(1)
    project = re.search(r'^project_id\s*=\s*"([^"]+)"', values, re.M).group(1)
    account_id = template.replace("${var.cluster_name}", cluster)
    assert "${" not in account_id, f"account_id {template!r}: a reference this test cannot follow"
    return f"{account_id}@{project}.iam.gserviceaccount.com"


def test_workload_identity_names_the_account_terraform_creates(renders):
    """The annotation is the Google service account Terraform makes (workload_identity.tf),
    not a name no one creates: without it the Vertex fallback gets no token, and it is the only
    backend while the pool is at zero (issue 32, item 2)."""
    (account,) = renders["production"].kind("ServiceAccount")
    assert account["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": terraform_pods_account()
    }
    assert terraform_pods_account() == "forge-pods@forge-prod.iam.gserviceaccount.com"
    assert account["automountServiceAccountToken"] is False
    rayservice = renders["production"].one("RayService")
    for spec in pod_specs(rayservice).values():
        assert spec["serviceAccountName"] == account["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False
    # The autoscaler sidecar alone mounts an API token (KubeRay's Role is bound to the account).
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (mount,) = cluster["autoscalerOptions"]["volumeMounts"]
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    head_volumes = {v["name"] for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert mount["name"] in head_volumes


# --- network policy --------------------------------------------------------------------------

SERVE_PORT = 8000
ADMIN_PORT = 8001  # FORGE_ADMIN_PORT in configs/gke.yaml
OPERATOR_PORTS = {8265, 52365}
METRICS_PORTS = {8080, 44217, 44227, 9101}


def exposure_problems(
    policy: dict, rayservice: dict, operator_ns: str, monitoring_ns: str, admin_from: list[dict]
) -> list[str]:
    """Only Serve's entry point from anywhere; the admin port from ``admin_from``; Ray's ports
    between the release's Ray pods; the dashboard from the KubeRay operator; metrics from the
    monitoring namespace."""
    problems = []
    spec = policy["spec"]
    selector = spec["podSelector"]["matchLabels"]
    for name, group in groups(rayservice).items():
        labels = group["template"]["metadata"]["labels"]
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"{name} pods are not selected")
    if "Ingress" not in spec["policyTypes"]:
        problems.append("no Ingress policy")
    for rule in spec.get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        peers = rule.get("from")
        if not peers:
            if ports != {SERVE_PORT}:
                problems.append(f"open to all: {sorted(ports) or 'every port'}")
            continue
        for peer in peers:
            if "ipBlock" in peer:
                problems.append(f"ipBlock {peer['ipBlock']}")
            elif "namespaceSelector" in peer:
                namespace = (
                    peer["namespaceSelector"]
                    .get("matchLabels", {})
                    .get("kubernetes.io/metadata.name")
                )
                allowed = {operator_ns: OPERATOR_PORTS, monitoring_ns: METRICS_PORTS}.get(namespace)
                if allowed is None or not ports or not ports <= allowed:
                    problems.append(f"namespace {namespace}: {sorted(ports) or 'every port'}")
            elif peer in admin_from:
                if ports != {ADMIN_PORT}:
                    problems.append(f"admins {peer}: {sorted(ports) or 'every port'}")
            elif peer.get("podSelector", {}).get("matchLabels") != selector:
                problems.append(f"pods {peer.get('podSelector')}: {sorted(ports) or 'every port'}")
    return problems


def policy_problems(render: Render, policy: dict | None = None) -> list[str]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    return exposure_problems(
        policy or render.one("NetworkPolicy"),
        render.one("RayService"),
        values["operatorNamespace"],
        values["monitoringNamespace"],
        values["adminFrom"],
    )


def test_only_serve_is_reachable_from_outside(rendered):
    assert policy_problems(rendered) == []


def test_network_policy_check_catches_an_open_dashboard(renders):
    policy = copy.deepcopy(renders["production"].one("NetworkPolicy"))
    policy["spec"]["ingress"][0]["ports"].append({"port": 8265, "protocol": "TCP"})
    assert policy_problems(renders["production"], policy) == ["open to all: [8000, 8265]"]


def test_network_policy_check_catches_ray_ports_open_to_the_namespace(renders):
    policy = copy.deepcopy(renders["production"].one("NetworkPolicy"))
    policy["spec"]["ingress"][1]["from"][0]["podSelector"] = {}
    assert policy_problems(renders["production"], policy) == ["pods {}: every port"]


# Who may reach each port of a Ray pod (docs/listeners.md, "GKE"), as the NetworkPolicy must
# admit it: Serve's entry point from anywhere, everything Ray-internal from the release's own Ray
# pods only, the dashboard from the KubeRay operator (people: kubectl port-forward, the kubelet's
# path), metrics from Prometheus. Ranges are every port Ray may pick: the raylet, object manager
# and agents' ports and each replica's inter-deployment gRPC server are random (the kernel's
# ephemeral range; the replicas' on every interface), workers' gRPC 10002-19999 (`ray start`).
# EVERYONE in a row: every source, in or out of the cluster.
EVERYONE = "anywhere"
RAY_PODS = "the release's Ray pods"
OPERATOR = "the KubeRay operator"
PROMETHEUS = "Prometheus"
ADMINS = "an admin pod"  # networkPolicy.adminFrom: the eval gate's Job, a toolbox pod
PORT_TABLE: dict[str, tuple[Sequence[int], frozenset[str]]] = {
    "Serve (HAProxy, Serve's proxy)": (range(8000, 8001), frozenset({EVERYONE})),
    "admin (HAProxy's admin frontend)": (range(8001, 8002), frozenset({RAY_PODS, ADMINS})),
    "GCS": (range(6379, 6380), frozenset({RAY_PODS})),
    "Ray client": (range(10001, 10002), frozenset({RAY_PODS})),
    "workers' gRPC": (range(10002, 20000), frozenset({RAY_PODS})),
    "direct ingress": (range(30000, 31001), frozenset({RAY_PODS})),
    "Serve's backup proxy": (range(8500, 8501), frozenset({RAY_PODS})),
    "HAProxy stats": (range(8404, 8405), frozenset({RAY_PODS})),
    # Linux's ephemeral range, but the fixed ports below that lie in it.
    "raylet, object manager, agents, replicas' gRPC (random)": (
        tuple(p for p in range(32768, 61000) if p not in {44217, 44227, 52365}),
        frozenset({RAY_PODS}),
    ),
    "dashboard": (range(8265, 8266), frozenset({RAY_PODS, OPERATOR})),
    "dashboard agent HTTP": (range(52365, 52366), frozenset({RAY_PODS, OPERATOR})),
    "Ray metrics": (range(8080, 8081), frozenset({RAY_PODS, PROMETHEUS})),
    "autoscaler metrics": (range(44217, 44218), frozenset({RAY_PODS, PROMETHEUS})),
    "dashboard metrics": (range(44227, 44228), frozenset({RAY_PODS, PROMETHEUS})),
    "HAProxy Prometheus exporter": (range(9101, 9102), frozenset({RAY_PODS, PROMETHEUS})),
}


@dataclass(frozen=True)
class Peer:
    """Where a connection comes from: an address, and for a pod its namespace and labels."""

    ip: str
    namespace: str | None = None  # None: not a pod (a client outside the cluster)
    labels: tuple[tuple[str, str], ...] = ()


def peers(render: Render) -> dict[str, Peer]:
    """One of each kind of source the policy tells apart, plus the ones it must refuse."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    ray_labels = groups(render.one("RayService"))["cpu"]["template"]["metadata"]["labels"]
    return {
        EVERYONE: Peer("203.0.113.7"),
        "a pod in another namespace": Peer("10.8.3.4", "default", (("app", "web"),)),
        "another pod of the namespace": Peer("10.8.0.9", NAMESPACE, (("app", "redis-proxy"),)),
        RAY_PODS: Peer("10.8.0.5", NAMESPACE, tuple(sorted(ray_labels.items()))),
        OPERATOR: Peer(
            "10.8.1.2",
            values["operatorNamespace"],
            (("app.kubernetes.io/name", "kuberay-operator"),),
        ),
        PROMETHEUS: Peer(
            "10.8.2.3", values["monitoringNamespace"], (("app.kubernetes.io/name", "prometheus"),)
        ),
        ADMINS: Peer("10.8.0.12", NAMESPACE, (("forge.dev/admin", "true"),)),
    }


def _matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels; matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(rule_peer: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        address = ipaddress.ip_address(peer.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if peer.namespace is None:  # pod and namespace selectors select pods only
        return False
    if "namespaceSelector" in rule_peer:
        namespace_labels = {"kubernetes.io/metadata.name": peer.namespace}
        if not _matches(rule_peer["namespaceSelector"], namespace_labels):
            return False
    elif peer.namespace != policy_namespace:
        return False
    return _matches(rule_peer.get("podSelector", {}), dict(peer.labels))


def admits(policy: dict, peer: Peer, port: int) -> bool:
    """Whether the policy's ingress rules let ``peer`` open a TCP connection to ``port``."""
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports") or [{}]  # none listed: every port
        port_ok = any(
            p.get("protocol", "TCP") == "TCP"
            and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
            for p in ports
        )
        sources = rule.get("from") or [{"ipBlock": {"cidr": "0.0.0.0/0"}}]  # none: everyone
        namespace = policy["metadata"]["namespace"]
        if port_ok and any(_peer_matches(s, peer, namespace) for s in sources):
            return True
    return False


def admission_problems(render: Render, policy: dict | None = None) -> list[str]:
    """The policy selects every Ray pod, and admits to each port of PORT_TABLE exactly the
    sources the table names: one line per role and source that differ."""
    policy = policy or render.one("NetworkPolicy")
    sources = peers(render)
    problems = []
    if "Ingress" not in policy["spec"].get("policyTypes", []):
        problems.append("no Ingress policy: every port open")
    for name, group in groups(render.one("RayService")).items():
        if not _matches(policy["spec"]["podSelector"], group["template"]["metadata"]["labels"]):
            problems.append(f"{name} pods are not selected: every port open")
    if any(
        isinstance(p.get("port"), str)
        for r in policy["spec"].get("ingress", [])
        for p in r.get("ports") or []
    ):
        problems.append("a named port: not checked here")
    for role, (ports, allowed) in PORT_TABLE.items():
        for source, peer in sources.items():
            expected = EVERYONE in allowed or source in allowed
            wrong = [port for port in ports if admits(policy, peer, port) != expected]
            if wrong:
                verb = "admits" if not expected else "refuses"
                span = f"{wrong[0]}" if len(wrong) == 1 else f"{wrong[0]}-{wrong[-1]}"
                problems.append(f"{role} ({span}): {verb} {source}")
    return problems


def test_network_policy_admits_each_port_exactly_its_sources(rendered):
    assert admission_problems(rendered) == []


def test_port_table_names_every_port_the_ray_pods_declare(rendered):
    """A port a Ray container declares (the head's and workers' named ports) is in the table."""
    tabled = set().union(*(set(ports) for ports, _ in PORT_TABLE.values()))
    for name, spec in pod_specs(rendered.one("RayService")).items():
        declared = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert declared <= tabled, f"{name}: {sorted(declared - tabled)} not in PORT_TABLE"


@pytest.mark.parametrize(
    "breakage, problem",
    [
        ("gcs to all", "GCS (6379): admits anywhere"),
        ("all ports to the namespace", "GCS (6379): admits another pod of the namespace"),
        (
            "dashboard to everyone in the cluster",
            "dashboard (8265): admits a pod in another namespace",
        ),
        ("gpu pods unselected", "gpu-t4 pods are not selected: every port open"),
        ("prometheus locked out", "Ray metrics (8080): refuses Prometheus"),
        ("admin to everyone", "admin (HAProxy's admin frontend) (8001): admits anywhere"),
        ("admins locked out", "admin (HAProxy's admin frontend) (8001): refuses an admin pod"),
    ],
)
def test_admission_check_catches(renders, breakage, problem):
    render = renders["production"]
    policy = copy.deepcopy(render.one("NetworkPolicy"))
    ingress = policy["spec"]["ingress"]
    if breakage == "gcs to all":
        ingress.append({"ports": [{"port": 6379, "protocol": "TCP"}]})
    elif breakage == "all ports to the namespace":
        ingress[1]["from"][0]["podSelector"] = {}
    elif breakage == "dashboard to everyone in the cluster":
        ingress.append({"from": [{"namespaceSelector": {}}], "ports": [{"port": 8265}]})
    elif breakage == "admin to everyone":
        ingress[0]["ports"].append({"port": ADMIN_PORT, "protocol": "TCP"})
    elif breakage == "admins locked out":
        del ingress[-1]
    elif breakage == "gpu pods unselected":
        policy["spec"]["podSelector"] = {
            "matchLabels": {"app.kubernetes.io/component": "ray-worker-cpu"}
        }
    else:
        ingress[3]["ports"] = [p for p in ingress[3]["ports"] if p["port"] != 8080]
    assert problem in admission_problems(render, policy)


# --- the admin port --------------------------------------------------------------------------


def test_the_clients_service_cannot_reach_the_admin_routes(rendered, tmp_path):
    """The Serve Service publishes :8000 alone; forge-haproxy, with the env every Ray container
    gets, answers the admin routes there with a 404 and serves them on the admin port, which the
    admin Service (inside the cluster) publishes and each Ray pod declares."""
    from serve_app.tools import haproxy_loopback
    from tests.tools import forge_haproxy

    rayservice = rendered.one("RayService")
    serve_ports = rayservice["spec"]["serveService"]["spec"]["ports"]
    assert [p["port"] for p in serve_ports] == [SERVE_PORT]
    config = serve_config(rendered)
    env = config["controller_options"]["runtime_env"]["env_vars"]
    assert int(env[haproxy_loopback.ADMIN_PORT_SETTING]) == ADMIN_PORT
    for group, spec in pod_specs(rayservice).items():
        container = ray_container(spec)
        assert {"name": haproxy_loopback.ADMIN_PORT_SETTING, "value": str(ADMIN_PORT)} in container[
            "env"
        ], group
        assert ADMIN_PORT in {p["containerPort"] for p in container["ports"]}, group
    admin = rendered.one("Service")
    assert admin["spec"]["type"] == "ClusterIP"
    assert [(p["port"], p["targetPort"]) for p in admin["spec"]["ports"]] == [
        (ADMIN_PORT, ADMIN_PORT)
    ]
    assert admin["spec"]["selector"]["ray.io/serve"] == "true"
    ray_labels = groups(rayservice)["cpu"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in admin["spec"]["selector"].items() if k != "ray.io/serve"}.items() <= (
        ray_labels.items()
    )
    http = config["http_options"]
    served = forge_haproxy.render_serve_config(
        tmp_path,
        front_host=http["host"],
        front_port=http["port"],
        servers=[("10.8.0.5", 30000)],
        stats_port=8404,
        metrics_port=9101,
    ).read_text()
    rewritten = haproxy_loopback.rewrite(served, env)
    clients = rewritten.split("frontend http_frontend\n", 1)[1].split("\nfrontend ", 1)[0]
    assert f"bind *:{SERVE_PORT}" in clients
    assert haproxy_loopback.client_path_rules()[0] in clients
    admin_front = rewritten.split(f"frontend {haproxy_loopback.ADMIN_FRONTEND}\n", 1)[1]
    assert admin_front.lstrip().startswith(f"bind *:{ADMIN_PORT}")


def test_a_serve_config_without_an_admin_port_is_refused(tools: Tools, tmp_path):
    """The chart fails rather than render a cluster whose :8000 serves the admin routes."""
    chart = tmp_path / "forge"
    shutil.copytree(CHART, chart, symlinks=False)
    config = yaml.safe_load((chart / "files" / "serve-config.yaml").read_text())
    del config["controller_options"]["runtime_env"]["env_vars"]["FORGE_ADMIN_PORT"]
    (chart / "files" / "serve-config.yaml").write_text(yaml.safe_dump(config))
    cases = {"no-admin-port": values_of("production")}
    (result,) = tools.python(RENDER, str(chart), RELEASE, NAMESPACE, json.dumps(cases)).values()
    assert "FORGE_ADMIN_PORT" in parse_render(result).error


# --- the KV events' CURVE secret -------------------------------------------------------------


def test_a_kv_aware_pool_takes_its_curve_secret_from_the_secret_in_every_ray_container(
    tools: Tools, tmp_path
):
    """With secrets.kvCurveSecret named, each kv_aware pool's curve_secret_env comes from it,
    in every group (Serve places pool and gateway replicas anywhere); unnamed, or with no
    kv_aware pool (configs/gke.yaml as it is), there is no such variable."""
    chart = tmp_path / "forge"
    shutil.copytree(CHART, chart, symlinks=False)
    config = yaml.safe_load((chart / "files" / "serve-config.yaml").read_text())
    (primary,) = [a for a in config["applications"] if a["name"] == "forge-pool-primary"]
    primary["args"]["pool"]["routing"] = {"policy": "kv_aware"}
    (chart / "files" / "serve-config.yaml").write_text(yaml.safe_dump(config))
    secret = {"name": "forge-kv-curve", "key": "secret"}
    cases = {
        "named": values_of("production", {"secrets": {"kvCurveSecret": secret}}),
        "unnamed": values_of("production"),
    }
    out = tools.python(RENDER, str(chart), RELEASE, NAMESPACE, json.dumps(cases))
    renders = {name: parse_render(result) for name, result in out.items()}
    for name, render in renders.items():
        assert render.error is None, render.error
        for group, spec in pod_specs(render.one("RayService")).items():
            env = {e["name"]: e for e in ray_container(spec)["env"]}
            if name == "named":
                ref = env["FORGE_KV_CURVE_SECRET"]["valueFrom"]["secretKeyRef"]
                assert ref == secret, group
            else:
                assert "FORGE_KV_CURVE_SECRET" not in env, group


# --- Ray's token -----------------------------------------------------------------------------

RAY_TOKEN_SECRET = "forge-ray-token"  # docs/deploy.md creates it under this name
RAY_TOKEN_KEY = "auth_token"  # the key KubeRay's authOptions.secretName reads


def token_problems(rayservice: dict) -> list[str]:
    """Token authentication on: KubeRay's authOptions name the Secret (its dashboard calls send
    the token), and every Ray container of every group, and the autoscaler, take RAY_AUTH_MODE
    and RAY_AUTH_TOKEN from it."""
    problems = []
    cluster = rayservice["spec"]["rayClusterConfig"]
    auth = cluster.get("authOptions", {})
    if auth.get("mode") != "token":
        problems.append("authOptions.mode is not token")
    if auth.get("secretName") != RAY_TOKEN_SECRET:
        problems.append(f"authOptions.secretName is not {RAY_TOKEN_SECRET}")
    containers = {
        f"{group}/{c['name']}": c
        for group, spec in pod_specs(rayservice).items()
        for c in spec["containers"]
    }
    containers["autoscaler"] = cluster.get("autoscalerOptions", {})
    for name, container in containers.items():
        env = {e["name"]: e for e in container.get("env", [])}
        if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
            problems.append(f"{name}: RAY_AUTH_MODE is not token")
        ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
        if ref != {"name": RAY_TOKEN_SECRET, "key": RAY_TOKEN_KEY}:
            problems.append(f"{name}: RAY_AUTH_TOKEN is not {RAY_TOKEN_SECRET}/{RAY_TOKEN_KEY}")
    return problems


def test_every_ray_container_takes_the_token_from_the_secret(rendered):
    assert token_problems(rendered.one("RayService")) == []


def test_token_check_catches_a_container_without_it_and_auth_off(renders):
    rayservice = copy.deepcopy(renders["production"].one("RayService"))
    worker = pod_specs(rayservice)["gpu-t4"]["containers"][0]
    worker["env"] = [e for e in worker["env"] if e["name"] != "RAY_AUTH_TOKEN"]
    autoscaler = rayservice["spec"]["rayClusterConfig"]["autoscalerOptions"]
    autoscaler["env"][0]["value"] = "disabled"
    del rayservice["spec"]["rayClusterConfig"]["authOptions"]
    assert token_problems(rayservice) == [
        "authOptions.mode is not token",
        f"authOptions.secretName is not {RAY_TOKEN_SECRET}",
        f"gpu-t4/ray-worker: RAY_AUTH_TOKEN is not {RAY_TOKEN_SECRET}/{RAY_TOKEN_KEY}",
        "autoscaler: RAY_AUTH_MODE is not token",
    ]


# --- monitoring ------------------------------------------------------------------------------


def monitoring_problems(render: Render) -> list[str]:
    """The PrometheusRule and the dashboard are observability/'s files, and the PodMonitor
    scrapes ports every Ray pod it selects declares."""
    problems = []
    rules = yaml.safe_load((ROOT / "observability/prometheus/forge-rules.yaml").read_text())
    if render.one("PrometheusRule")["spec"] != rules:
        problems.append("PrometheusRule differs from forge-rules.yaml")
    dashboard = json.loads((ROOT / "observability/grafana/forge-overview.json").read_text())
    (config_map,) = [
        d for d in render.kind("ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]
    ]
    if config_map["metadata"]["labels"]["grafana_dashboard"] != "1":
        problems.append("dashboard ConfigMap not labelled for Grafana's sidecar")
    if json.loads(config_map["data"]["forge-overview.json"]) != dashboard:
        problems.append("dashboard differs from forge-overview.json")
    monitor = render.one("PodMonitor")["spec"]
    selector = monitor["selector"]["matchLabels"]
    for name, group in groups(render.one("RayService")).items():
        labels = group["template"]["metadata"]["labels"]
        if any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"{name} not scraped")
        ports = {p["name"] for p in ray_container(group["template"]["spec"])["ports"]}
        if "metrics" not in ports:
            problems.append(f"{name} has no metrics port")
    head_ports = {
        p["name"] for p in ray_container(pod_specs(render.one("RayService"))["headgroup"])["ports"]
    }
    for endpoint in monitor["podMetricsEndpoints"]:
        if endpoint["port"] not in head_ports:
            problems.append(f"PodMonitor port {endpoint['port']} is declared nowhere")
    return problems


def test_monitoring_objects_are_observability_files(rendered):
    assert monitoring_problems(rendered) == []


def test_monitoring_check_catches_a_drifted_rule_and_an_unscraped_group(renders):
    render = renders["production"]
    docs = copy.deepcopy(list(render.docs))
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    rule["spec"]["groups"][0]["rules"].pop()
    rayservice = next(d for d in docs if d["kind"] == "RayService")
    pod_specs(rayservice)["cpu"]["containers"][0]["ports"] = []
    assert monitoring_problems(Render(docs=tuple(docs))) == [
        "PrometheusRule differs from forge-rules.yaml",
        "cpu has no metrics port",
    ]


# --- kubernetes-validate and checkov ---------------------------------------------------------

CORE_KINDS = {"ServiceAccount", "NetworkPolicy", "ConfigMap", "Service", "PodDisruptionBudget"}


def write_docs(directory: Path, prefix: str, docs: list[dict]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc in docs:
        path = directory / f"{prefix}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths.append(path)
    return paths


def broken_pod(render: Render) -> dict:
    """The GPU worker as a careless pod would be: privileged, root, no limits."""
    (pod,) = [p for p in as_pods(render) if p["metadata"]["name"].endswith("gpu-t4")]
    pod = copy.deepcopy(pod)
    pod["metadata"]["name"] = "careless"
    container = pod["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True, "allowPrivilegeEscalation": True}
    del container["resources"]["limits"]
    pod["spec"]["securityContext"] = {}
    return pod


@pytest.fixture(scope="session")
def manifests(renders, tmp_path_factory) -> dict[str, list[Path]]:
    """The rendered core kinds and the RayService's pods of both values files, and a broken pod."""
    directory = tmp_path_factory.mktemp("manifests")
    paths = []
    for name in VALUES_FILES:
        render = renders[name]
        core = [d for d in render.docs if d["kind"] in CORE_KINDS]
        paths += write_docs(directory / "chart", name, core + as_pods(render))
    broken = write_docs(directory / "broken", "broken", [broken_pod(renders["production"])])
    return {"chart": paths, "broken": broken}


def test_core_kinds_and_pods_pass_kubernetes_validate(tools, manifests):
    done = tools.run(
        "kubernetes-validate", "--strict", "-k", KUBE_VERSION, *map(str, manifests["chart"])
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed for resource") == len(manifests["chart"])


def test_kubernetes_validate_catches_a_misspelt_field(tools, renders, tmp_path):
    (pod,) = [p for p in as_pods(renders["production"]) if p["metadata"]["name"].endswith("cpu")]
    pod["spec"]["enableServiceLink"] = pod["spec"].pop("enableServiceLinks")
    (path,) = write_docs(tmp_path, "misspelt", [pod])
    done = tools.run("kubernetes-validate", "--strict", "-k", KUBE_VERSION, str(path))
    assert done.returncode != 0
    assert "enableServiceLink" in done.stdout + done.stderr


@dataclass(frozen=True)
class CheckovReport:
    failures: dict[str, set[str]]  # failed check ids by file name
    resources: int  # resources scanned
    passed: int  # checks passed


@pytest.fixture(scope="session")
def checkov(tools, manifests) -> CheckovReport:
    """One checkov run over everything (the chart's files and the broken pod)."""
    root = manifests["chart"][0].parent.parent
    done = tools.run(
        "checkov",
        "--directory",
        str(root),
        "--framework",
        "kubernetes",
        "--skip-download",
        "--skip-results-upload",
        "--quiet",
        "--compact",
        "--output",
        "json",
        "--skip-check",
        ",".join(CHECKOV_SKIPS),
    )
    assert done.returncode in (0, 1), done.stderr
    output = json.loads(done.stdout)  # a list when several frameworks report
    (report,) = output if isinstance(output, list) else [output]
    failures: dict[str, set[str]] = {}
    for check in report["results"]["failed_checks"]:
        failures.setdefault(Path(check["file_path"]).name, set()).add(check["check_id"])
    summary = report["summary"]
    return CheckovReport(failures, summary["resource_count"], summary["passed"])


def test_checkov_passes_the_chart(checkov, manifests):
    chart_files = {p.name for p in manifests["chart"]}
    assert checkov.resources == len(manifests["chart"]) + len(manifests["broken"])
    assert checkov.passed > 0
    assert {name: ids for name, ids in checkov.failures.items() if name in chart_files} == {}


def test_checkov_catches_a_careless_pod(checkov, manifests):
    (broken,) = manifests["broken"]
    failed = checkov.failures.get(broken.name, set())
    # privileged, privilege escalation, no CPU / memory limits
    assert {"CKV_K8S_16", "CKV_K8S_20", "CKV_K8S_11", "CKV_K8S_13"} <= failed, failed
