"""terraform/, offline: formatted, checkov-clean, and shaped as the design says.

``init``/``validate``/``plan`` need the provider registry and a project, so none of them runs
here. What does: ``terraform fmt -check`` (where the binary exists), checkov's Terraform checks,
and assertions over the HCL parsed by python-hcl2 8.x. Each check is also fed a broken copy of
the tree (a small rewrite of one file) and must catch it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT, Tools

TERRAFORM = ROOT / "terraform"
GKE = "modules/gke/main.tf"
CI_IDENTITY = "modules/ci_identity/main.tf"
GPU_POOL = 'resource "google_container_node_pool" "gpu"'
CPU_POOL = 'resource "google_container_node_pool" "cpu"'

# checkov reads the example inputs: without a repository name it cannot tell that the GitHub
# OIDC provider's condition pins one (CKV_GCP_125).
EXAMPLE_VARS = TERRAFORM / "terraform.tfvars.example"
# Forge's own checkov policies (YAML), run beside checkov's.
POLICIES = TERRAFORM / "policies"

# Every inline skip, each with its reason in the .tf; a new one must be added here on purpose.
JUSTIFIED_SKIPS = {
    "CKV_GCP_6",
    "CKV_GCP_62",
    "CKV_GCP_65",
    "CKV_GCP_66",
    "CKV_GCP_69",
    "CKV_GCP_84",
}

OFFLINE_CHECKOV = {
    "BC_SKIP_MAPPING": "TRUE",  # no guideline/ID mapping download
    "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true",  # no PyPI version check
    "CKV_PARSE_ERROR_FAIL": "true",  # a file checkov cannot parse fails the run, not skips it
}


def copy_tree(dst: Path) -> Path:
    shutil.copytree(TERRAFORM, dst, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*"))
    return dst


def rewrite(tree: Path, file: str, old: str, new: str, *, after: str | None = None) -> None:
    """Replace the first ``old`` in ``tree/file`` (after the first ``after``, if given)."""
    path = tree / file
    text = path.read_text()
    start = text.index(after) if after else 0
    at = text.index(old, start)  # ValueError: the rewrite no longer matches the tree
    path.write_text(text[:at] + new + text[at + len(old) :])


def append(tree: Path, file: str, text: str) -> None:
    path = tree / file
    path.write_text(path.read_text() + text)


# --- terraform fmt ---------------------------------------------------------------------------


def terraform_binary() -> str:
    found = shutil.which("terraform") or next(
        (p for p in ("/usr/local/bin/terraform", "/usr/bin/terraform") if os.access(p, os.X_OK)),
        None,
    )
    if found is None:
        pytest.skip(
            "NO terraform BINARY: `terraform fmt -check -recursive terraform/` was NOT run; "
            "install terraform >= 1.9 for the formatting check"
        )
    return found


def fmt_check(directory: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1"}
    return subprocess.run(
        [terraform_binary(), "fmt", "-check", "-recursive", "-list=true", str(directory)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_terraform_is_formatted():
    done = fmt_check(TERRAFORM)
    assert done.returncode == 0, f"terraform fmt -recursive terraform/ would change:\n{done.stdout}"


def test_fmt_check_catches_an_unformatted_file(tmp_path):
    tree = copy_tree(tmp_path / "terraform")
    # Deep in a module, so the check must recurse to see it.
    rewrite(
        tree, GKE, "    total_min_node_count = 0\n", "  total_min_node_count=0\n", after=GPU_POOL
    )
    (tree / "bad.tf").write_text('variable "x" {\ntype=string\n  default = "a"\n}\n')
    done = fmt_check(tree)
    assert done.returncode != 0
    assert {Path(line).name for line in done.stdout.split()} >= {"main.tf", "bad.tf"}


def test_gitignore_keeps_state_and_plans_out():
    if shutil.which("git") is None:
        pytest.skip("no git binary")
    paths = [
        "terraform/.terraform/x",
        "terraform/a.tfstate",
        "terraform/a.tfstate.1",
        "terraform/a.tfplan",
    ]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert done.stdout.split() == paths


# --- checkov ---------------------------------------------------------------------------------


def checkov(tools: Tools, directory: Path) -> subprocess.CompletedProcess:
    argv = [
        tools.bin("checkov"),
        *("-d", str(directory), "--framework", "terraform", "--quiet", "--compact"),
        *("--var-file", str(directory / EXAMPLE_VARS.name)),
        *("--external-checks-dir", str(directory / POLICIES.name)),
        *("--skip-download", "--download-external-modules", "false"),
    ]
    return subprocess.run(
        argv,
        cwd=directory,
        capture_output=True,
        text=True,
        env={**os.environ, **OFFLINE_CHECKOV},
        timeout=600,
    )


def summary(done: subprocess.CompletedProcess) -> dict[str, int]:
    found = re.search(
        r"Passed checks: (\d+), Failed checks: (\d+), Skipped checks: (\d+)", done.stdout
    )
    assert found, f"no checkov summary (rc {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return dict(zip(("passed", "failed", "skipped"), map(int, found.groups()), strict=True))


def inline_skips() -> dict[str, str]:
    """{check id: reason} of every ``#checkov:skip=`` comment in terraform/."""
    skips = {}
    for path in sorted(TERRAFORM.rglob("*.tf")):
        for match in re.finditer(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?", path.read_text()):
            skips[match[1]] = (match[2] or "").strip()
    return skips


def test_checkov_passes_with_only_justified_skips(tools):
    done = checkov(tools, TERRAFORM)
    counts = summary(done)
    assert done.returncode == 0 and counts["failed"] == 0, done.stdout
    assert "Parsing errors" not in done.stdout, done.stdout  # an unread file is an unchecked one
    assert counts["passed"] >= 40, counts  # the GCP checks did run over the resources
    skips = inline_skips()
    assert set(skips) == JUSTIFIED_SKIPS
    assert all(len(reason) >= 40 for reason in skips.values()), skips
    assert counts["skipped"] == len(JUSTIFIED_SKIPS)


INSECURE = {
    # A node pool whose pods could read the node's own credentials from the GCE metadata server.
    "gpu pool without the GKE metadata server": (
        "CKV_GCP_69",
        lambda tree: rewrite(
            tree,
            GKE,
            '    workload_metadata_config {\n      mode = "GKE_METADATA"\n    }\n',
            "",
            after=GPU_POOL,
        ),
    ),
    # checkov looks only for the block (CKV_GCP_25, CKV_GCP_64), not at enable_private_nodes:
    # private_nodes_problems below catches that one.
    "a public cluster": (
        "CKV_GCP_64",
        lambda tree: rewrite(
            tree,
            GKE,
            "  private_cluster_config {\n"
            "    enable_private_nodes    = true\n"
            "    enable_private_endpoint = var.enable_private_endpoint\n"
            "    master_ipv4_cidr_block  = var.master_ipv4_cidr_block\n"
            "  }\n",
            "",
        ),
    ),
    # Google-managed (no uploaded public key), so checkov's CKV2_GCP_3 passes it; Forge's own
    # policy (terraform/policies) refuses every key.
    "a service account key": (
        "CKV2_FORGE_1",
        lambda tree: append(
            tree,
            CI_IDENTITY,
            '\nresource "google_service_account_key" "ci" {\n'
            "  service_account_id = google_service_account.ci.name\n}\n",
        ),
    ),
}


@pytest.mark.parametrize("change", list(INSECURE))
def test_checkov_fails_an_insecure_change(tools, tmp_path, change):
    check_id, make_insecure = INSECURE[change]
    tree = copy_tree(tmp_path / "terraform")
    make_insecure(tree)
    done = checkov(tools, tree)
    assert done.returncode != 0, done.stdout
    assert summary(done)["failed"] >= 1
    assert f"Check: {check_id}:" in done.stdout, done.stdout


# --- the parsed HCL --------------------------------------------------------------------------

# Run in the tools' interpreter: every .tf under each directory given, parsed by python-hcl2 8.x
# into {directory: {relative path: document}}. checkov depends on bc-python-hcl2, an old fork
# that installs the same `hcl2` package: where .ci/deploy keeps python-hcl2 8.x apart from it
# (pip install --target <venv>/python-hcl2), that copy is the one imported.
PARSE = r"""
import json, sys
from pathlib import Path

apart = Path(sys.prefix) / "python-hcl2"
if apart.is_dir():
    sys.path.insert(0, str(apart))
import hcl2

try:
    from hcl2 import SerializationOptions
except ImportError:
    sys.exit(
        f"{hcl2.__file__} is not python-hcl2 8.x (version {getattr(hcl2, '__version__', '?')}): "
        "checkov's bc-python-hcl2 installs the same `hcl2` package over it; install "
        "python-hcl2 apart: pip install --no-deps --target <venv>/python-hcl2 python-hcl2"
    )

options = SerializationOptions(strip_string_quotes=True, explicit_blocks=False)
out = {}
for root in sys.argv[1:]:
    docs = {}
    for path in sorted(Path(root).rglob("*.tf")):
        if ".terraform" in path.parts:
            continue
        with path.open() as f:
            docs[str(path.relative_to(root))] = hcl2.load(f, serialization_options=options)
    out[root] = docs
print(json.dumps(out))
"""

Tree = dict[str, dict]  # relative path -> parsed document


def blocks(body: dict, key: str) -> list[dict]:
    """A nested block's instances (python-hcl2 gives a block as a list of bodies)."""
    value = body.get(key, [])
    return value if isinstance(value, list) else [value]


def first(body: dict, *path: str) -> dict:
    for key in path:
        found = blocks(body, key)
        body = found[0] if found else {}
    return body


def resources(tree: Tree, kind: str) -> list[tuple[str, dict]]:
    """(``file:type.name``, body) of every resource of that type in the tree."""
    found = []
    for file, doc in tree.items():
        for entry in doc.get("resource", []):
            for name, body in entry.get(kind, {}).items():
                found.append((f"{file}:{kind}.{name}", body))
    return found


def node_pools(tree: Tree) -> list[tuple[str, dict, bool]]:
    """(where, body, has a GPU) of every node pool."""
    return [
        (where, body, bool(blocks(first(body, "node_config"), "guest_accelerator")))
        for where, body in resources(tree, "google_container_node_pool")
    ]


def variable_defaults(tree: Tree) -> dict[str, object]:
    """The root module's variables' defaults, by name."""
    return {
        name: body.get("default")
        for file, doc in tree.items()
        if "/" not in file
        for block in doc.get("variable", [])
        for name, body in block.items()
    }


def gpu_pool_problems(tree: Tree) -> list[str]:
    """The T4 pool: spot, autoscaled from 0, GPU-tainted, labelled, driver installed by GKE;
    spread over several zones by default with its cap counted across them (issue 32, item 15:
    one zone's stock-out or preemption wave would take every T4)."""
    gpu = [(where, body) for where, body, has_gpu in node_pools(tree) if has_gpu]
    if not gpu:
        return ["no node pool with a guest_accelerator"]
    problems = []
    for where, body in gpu:
        node = first(body, "node_config")
        accelerator = first(node, "guest_accelerator")
        if node.get("spot") is not True:
            problems.append(f"{where}: node_config.spot is not true")
        autoscaling = first(body, "autoscaling")
        if autoscaling.get("total_min_node_count") != 0:
            problems.append(f"{where}: autoscaling.total_min_node_count is not 0")
        if "var.gpu_max_nodes" not in str(autoscaling.get("total_max_node_count")):
            problems.append(f"{where}: gpu_max_nodes is not the cap across zones")
        if "var.gpu_node_zones" not in str(body.get("node_locations")):
            problems.append(f"{where}: node_locations is not var.gpu_node_zones")
        zones = variable_defaults(tree).get("gpu_node_zones") or []
        if len(zones) < 2:
            problems.append(f"gpu_node_zones defaults to {zones}: the T4s in one zone")
        if body.get("initial_node_count", 0) != 0:
            problems.append(f"{where}: initial_node_count is not 0")
        taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}
        if taint not in [{k: t.get(k) for k in taint} for t in blocks(node, "taint")]:
            problems.append(f"{where}: no nvidia.com/gpu=present:NoSchedule taint")
        if accelerator.get("type") != "nvidia-tesla-t4":
            problems.append(f"{where}: accelerator is not nvidia-tesla-t4")
        if not blocks(accelerator, "gpu_driver_installation_config"):
            problems.append(f"{where}: no gpu_driver_installation_config (driver not installed)")
        if not node.get("labels"):
            problems.append(f"{where}: no node labels for the chart's nodeSelector")
    return problems


def cpu_pool_problems(tree: Tree) -> list[str]:
    cpu = [(where, body) for where, body, has_gpu in node_pools(tree) if not has_gpu]
    if not cpu:
        return ["no CPU node pool"]
    # On-demand unless the operator opts in (cpu_spot, default false): the chart keeps the head
    # and the gateways off spot nodes, whose 30 s notice their drain outlasts.
    return [
        f"{where}: the CPU pool's spot is not var.cpu_spot"
        for where, body in cpu
        if "var.cpu_spot" not in str(first(body, "node_config").get("spot"))
    ]


def private_nodes_problems(tree: Tree) -> list[str]:
    clusters = resources(tree, "google_container_cluster")
    if not clusters:
        return ["no google_container_cluster"]
    return [
        f"{where}: private_cluster_config.enable_private_nodes is not true"
        for where, body in clusters
        if first(body, "private_cluster_config").get("enable_private_nodes") is not True
    ]


def workload_identity_problems(tree: Tree) -> list[str]:
    problems = []
    for where, body in resources(tree, "google_container_cluster"):
        pool = first(body, "workload_identity_config").get("workload_pool", "")
        if not str(pool).endswith(".svc.id.goog"):
            problems.append(f"{where}: no workload_identity_config.workload_pool")
    for where, body, _ in node_pools(tree):
        mode = first(body, "node_config", "workload_metadata_config").get("mode")
        if mode != "GKE_METADATA":
            problems.append(f"{where}: workload_metadata_config.mode is {mode!r}, not GKE_METADATA")
    return problems or ([] if resources(tree, "google_container_cluster") else ["no cluster"])


def key_problems(tree: Tree) -> list[str]:
    """No service-account key anywhere, nor a provider reading one."""
    problems = [
        f"{where}: a service account key"
        for where, _ in resources(tree, "google_service_account_key")
    ]
    for file, doc in tree.items():
        for provider in doc.get("provider", []):
            for name, body in provider.items():
                if "credentials" in body:
                    problems.append(f"{file}: provider {name} reads credentials from a key")
    return problems


def backend_problems(tree: Tree) -> list[str]:
    backends = [
        (file, name)
        for file, doc in tree.items()
        for settings in doc.get("terraform", [])
        for backend in blocks(settings, "backend")
        for name in backend
    ]
    if [name for _, name in backends] != ["gcs"]:
        return [f"want exactly one backend, gcs, in the root module: found {backends}"]
    if "/" in backends[0][0]:
        return [f"the gcs backend is in {backends[0][0]}, not the root module"]
    return []


# Each Memorystore instance by its role: tier, eviction, persistence (redis.tf says why).
REDIS_ROLES = {
    "budgets": {"tier": "STANDARD_HA", "policy": "noeviction", "persistence": "RDB"},
    "cache": {"tier": "BASIC", "policy": "allkeys-lru", "persistence": None},
    # Ray's GCS fault tolerance (ray_gcs.tf): its own instance, since the GCS stops without it.
    "ray_gcs": {"tier": "STANDARD_HA", "policy": "noeviction", "persistence": "RDB"},
}
# The URL each instance makes, and so the variable the pods read it from.
REDIS_URLS = {
    "budgets": "redis_url",
    "cache": "redis_cache_url",
    "ray_gcs": "ray_gcs_redis_address",
}


def redis_problems(tree: Tree) -> list[str]:
    """Budgets on a Memorystore that never evicts and outlives a maintenance restart or a
    failover (STANDARD_HA, noeviction, RDB); the cache on its own, which may evict and vanish
    (BASIC, allkeys-lru); Ray's GCS on a third, as durable as the budgets' (issue 32, item 15);
    AUTH and TLS on all; each URL made from its own instance."""
    found = {
        where.rsplit(".", 1)[1]: (where, body)
        for where, body in resources(tree, "google_redis_instance")
    }
    if set(found) != set(REDIS_ROLES):
        return [f"want google_redis_instance {sorted(REDIS_ROLES)}, found {sorted(found)}"]
    problems = []
    for name, role in REDIS_ROLES.items():
        where, body = found[name]
        if body.get("tier") != role["tier"]:
            problems.append(f"{where}: tier {body.get('tier')!r}, not {role['tier']}")
        policy = (body.get("redis_configs") or {}).get("maxmemory-policy")
        if policy != role["policy"]:
            problems.append(f"{where}: maxmemory-policy {policy!r}, not {role['policy']}")
        persistence = first(body, "persistence_config")
        if persistence.get("persistence_mode") != role["persistence"]:
            mode = persistence.get("persistence_mode")
            problems.append(f"{where}: persistence {mode!r}, not {role['persistence']}")
        if role["persistence"] and not persistence.get("rdb_snapshot_period"):
            problems.append(f"{where}: no rdb_snapshot_period")
        if body.get("auth_enabled") is not True:
            problems.append(f"{where}: AUTH is off")
        if body.get("transit_encryption_mode") != "SERVER_AUTHENTICATION":
            problems.append(f"{where}: no TLS (transit_encryption_mode)")
    made = {
        name: str(value)
        for doc in tree.values()
        for block in doc.get("locals", [])
        for name, value in block.items()
    }
    for instance, url in REDIS_URLS.items():
        others = set(REDIS_ROLES) - {instance}
        text = made.get(url, "")
        if f"google_redis_instance.{instance}." not in text or any(
            f"google_redis_instance.{other}." in text for other in others
        ):
            problems.append(f"local.{url} is not made from google_redis_instance.{instance}")
        if "rediss://" not in text:
            problems.append(f"local.{url} does not ask for TLS (rediss://)")
    return problems


PODS_ACCOUNT = "google_service_account.forge.email"


def weights_problems(tree: Tree) -> list[str]:
    """The weights bucket the GPU workers mount (issue 32, item 12): private, readable by the
    Forge pods' own service account (the one their workload identity binding names), the
    GCS FUSE CSI add-on on in the cluster."""
    buckets = [(w, b) for w, b in resources(tree, "google_storage_bucket") if "weights" in w]
    if len(buckets) != 1:
        return [f"want one weights bucket, found {[w for w, _ in buckets]}"]
    where, bucket = buckets[0]
    problems = []
    if bucket.get("uniform_bucket_level_access") is not True:
        problems.append(f"{where}: no uniform bucket-level access")
    if bucket.get("public_access_prevention") != "enforced":
        problems.append(f"{where}: public access not prevented")
    name = where.rsplit(".", 1)[1]
    readers = [
        body
        for _, body in resources(tree, "google_storage_bucket_iam_member")
        if f"google_storage_bucket.{name}." in str(body.get("bucket"))
        and body.get("role") == "roles/storage.objectViewer"
    ]
    if not any(PODS_ACCOUNT in str(r.get("member")) for r in readers):
        problems.append(f"{where}: the Forge pods' service account cannot read it")
    bound = [
        body
        for _, body in resources(tree, "google_service_account_iam_member")
        if body.get("role") == "roles/iam.workloadIdentityUser"
    ]
    if not any("google_service_account.forge." in str(b.get("service_account_id")) for b in bound):
        problems.append("the reader is not the account the pods' workload identity binds")
    for where, cluster in resources(tree, "google_container_cluster"):
        fuse = first(cluster, "addons_config", "gcs_fuse_csi_driver_config")
        if fuse.get("enabled") is not True:
            problems.append(f"{where}: the GCS FUSE CSI driver is off")
    return problems


def ledger_problems(tree: Tree) -> list[str]:
    """The usage ledger's Cloud SQL instance names its edition, and its tier is one that edition
    takes: left unnamed, the API picks ENTERPRISE_PLUS for POSTGRES_16 and later, which takes only
    db-perf-optimized-N-* tiers, so the shared-core default (db-g1-small) fails the first apply."""
    instances = resources(tree, "google_sql_database_instance")
    if not instances:
        return ["no Cloud SQL instance for the ledger"]
    defaults = variable_defaults(tree)
    problems = []
    for where, instance in instances:
        settings = first(instance, "settings")
        edition = settings.get("edition")
        tier = str(settings.get("tier", ""))
        if found := re.fullmatch(r"\$\{var\.(\w+)\}", tier):
            tier = str(defaults.get(found.group(1)))
        if edition not in ("ENTERPRISE", "ENTERPRISE_PLUS"):
            problems.append(f"{where}: edition {edition!r}, left to the API's default")
        elif (edition == "ENTERPRISE_PLUS") != tier.startswith("db-perf-optimized-"):
            problems.append(f"{where}: tier {tier!r} is not an {edition} tier")
    return problems


CHECKS: dict[str, Callable[[Tree], list[str]]] = {
    "gpu pool": gpu_pool_problems,
    "cpu pool": cpu_pool_problems,
    "private nodes": private_nodes_problems,
    "workload identity": workload_identity_problems,
    "no keys": key_problems,
    "gcs backend": backend_problems,
    "redis": redis_problems,
    "weights": weights_problems,
    "ledger": ledger_problems,
}

# check -> broken variants: each a rewrite of a copy of the tree the check must catch.
BROKEN: dict[str, Callable[[Path], None]] = {
    "ledger|edition left to the API": lambda t: rewrite(
        t, "cloudsql.tf", 'edition           = "ENTERPRISE"', ""
    ),
    "ledger|shared-core tier on ENTERPRISE_PLUS": lambda t: rewrite(
        t, "cloudsql.tf", '"ENTERPRISE"', '"ENTERPRISE_PLUS"'
    ),
    "weights|no bucket": lambda t: (t / "weights.tf").unlink(),
    "weights|read by the nodes' account": lambda t: rewrite(
        t, "weights.tf", PODS_ACCOUNT, "module.gke.node_service_account_email"
    ),
    "weights|public": lambda t: rewrite(
        t, "weights.tf", 'public_access_prevention    = "enforced"', ""
    ),
    "weights|fuse add-on off": lambda t: rewrite(
        t, GKE, "enabled = true", "enabled = false", after="gcs_fuse_csi_driver_config"
    ),
    "gpu pool|min 1": lambda t: rewrite(
        t, GKE, "min_node_count = 0", "min_node_count = 1", after=GPU_POOL
    ),
    "gpu pool|on demand": lambda t: rewrite(
        t, GKE, "spot            = true", "spot            = false", after=GPU_POOL
    ),
    "gpu pool|no taint": lambda t: rewrite(
        t, GKE, 'key    = "nvidia.com/gpu"', 'key    = "forge.dev/gpu"', after=GPU_POOL
    ),
    "gpu pool|one zone": lambda t: rewrite(
        t,
        "variables.tf",
        '["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"]',
        "[]",
        after='variable "gpu_node_zones"',
    ),
    "gpu pool|cap per zone": lambda t: rewrite(
        t, GKE, "total_max_node_count = var.gpu_max_nodes", "max_node_count = var.gpu_max_nodes"
    ),
    "gpu pool|driver not installed": lambda t: rewrite(
        t, GKE, "gpu_driver_installation_config {", "gpu_sharing_config {", after=GPU_POOL
    ),
    "cpu pool|spot hard-coded": lambda t: rewrite(
        t, GKE, "spot            = var.cpu_spot", "spot            = true", after=CPU_POOL
    ),
    "private nodes|off": lambda t: rewrite(
        t, GKE, "enable_private_nodes    = true", "enable_private_nodes    = false"
    ),
    "workload identity|cluster without a pool": lambda t: rewrite(
        t, GKE, "workload_identity_config {", "identity_service_config {"
    ),
    "workload identity|node pool on GCE metadata": lambda t: rewrite(
        t, GKE, 'mode = "GKE_METADATA"', 'mode = "GCE_METADATA"', after=CPU_POOL
    ),
    "no keys|service account key": lambda t: append(
        t,
        CI_IDENTITY,
        '\nresource "google_service_account_key" "ci" {\n'
        "  service_account_id = google_service_account.ci.name\n}\n",
    ),
    "no keys|provider credentials": lambda t: rewrite(
        t,
        "providers.tf",
        "  region  = var.region\n",
        '  region  = var.region\n  credentials = "key.json"\n',
    ),
    "gcs backend|local state": lambda t: rewrite(
        t, "versions.tf", 'backend "gcs"', 'backend "local"'
    ),
    "redis|budgets evictable": lambda t: rewrite(
        t, "redis.tf", 'maxmemory-policy = "noeviction"', 'maxmemory-policy = "volatile-lru"'
    ),
    "redis|budgets on BASIC": lambda t: rewrite(t, "redis.tf", '"STANDARD_HA"', '"BASIC"'),
    "redis|budgets not persisted": lambda t: rewrite(
        t, "redis.tf", 'persistence_mode    = "RDB"', 'persistence_mode    = "DISABLED"'
    ),
    "redis|cache never evicts": lambda t: rewrite(
        t, "redis.tf", 'maxmemory-policy = "allkeys-lru"', 'maxmemory-policy = "noeviction"'
    ),
    "redis|one instance for both": lambda t: rewrite(
        t,
        "redis.tf",
        "google_redis_instance.cache.host",
        "google_redis_instance.budgets.host",
    ),
    "redis|ray gcs on the budgets' instance": lambda t: rewrite(
        t, "ray_gcs.tf", "google_redis_instance.ray_gcs.host", "google_redis_instance.budgets.host"
    ),
    "redis|no ray gcs instance": lambda t: (t / "ray_gcs.tf").unlink(),
    "redis|ray gcs address without TLS": lambda t: rewrite(
        t, "ray_gcs.tf", '"rediss://%s:%d"', '"redis://%s:%d"'
    ),
    "redis|ray gcs evictable": lambda t: rewrite(
        t, "ray_gcs.tf", 'maxmemory-policy = "noeviction"', 'maxmemory-policy = "allkeys-lru"'
    ),
    "redis|cache without TLS": lambda t: rewrite(
        t,
        "redis.tf",
        'transit_encryption_mode = "SERVER_AUTHENTICATION"',
        'transit_encryption_mode = "DISABLED"',
        after='resource "google_redis_instance" "cache"',
    ),
}


@pytest.fixture(scope="module")
def parsed(tools: Tools, tmp_path_factory) -> dict[str, Tree]:
    """The tree and every broken variant, parsed in one run of the tools' interpreter."""
    base = tmp_path_factory.mktemp("broken")
    roots = {"": TERRAFORM}
    for index, (variant, make_broken) in enumerate(BROKEN.items()):
        tree = copy_tree(base / str(index))
        make_broken(tree)
        roots[variant] = tree
    documents = tools.python(PARSE, *map(str, roots.values()))
    return {variant: documents[str(root)] for variant, root in roots.items()}


def test_parser_reads_every_file(parsed):
    on_disk = {str(p.relative_to(TERRAFORM)) for p in TERRAFORM.rglob("*.tf")}
    assert set(parsed[""]) == on_disk
    assert {"versions.tf", GKE, CI_IDENTITY} <= on_disk


@pytest.mark.parametrize("check", list(CHECKS))
def test_terraform_shape(parsed, check):
    assert CHECKS[check](parsed[""]) == []


@pytest.mark.parametrize("variant", list(BROKEN))
def test_shape_check_catches(parsed, variant):
    check = variant.split("|")[0]
    assert CHECKS[check](parsed[variant]), f"{check} missed: {variant}"


def test_every_check_has_a_broken_variant():
    assert {variant.split("|")[0] for variant in BROKEN} == set(CHECKS)


# --- the Redis URLs Terraform writes, as redis-py reads them --------------------------------


def redis_url_formats(tree: Path = TERRAFORM) -> list[str]:
    text = (tree / "redis.tf").read_text()
    return re.findall(r'"(rediss://[^"]+)"', text)


def redis_tls_problems(formats: list[str]) -> list[str]:
    """What the gateways' redis-py makes of each URL: TLS verified against the mounted CA, and
    no hostname check against the instance's IP (its certificate may not name it: a failed
    handshake fails the store open, and the budgets with it; issue 32, item 14)."""
    import ssl

    import redis

    problems = []
    for form in formats:
        url = form.replace(":%s@%s:%d/", ":auth@10.0.0.3:6378/").replace("=%s", "=/etc/ca.pem")
        kwargs = redis.ConnectionPool.from_url(url).connection_kwargs
        connection = redis.ConnectionPool.from_url(url).connection_class(**kwargs)
        if connection.cert_reqs != ssl.CERT_REQUIRED or connection.ca_certs != "/etc/ca.pem":
            problems.append(f"{form}: the server certificate is not verified against the CA")
        if connection.check_hostname:
            problems.append(f"{form}: redis-py checks the IP against the certificate's names")
    return problems


def test_the_redis_urls_verify_the_ca_and_not_the_ip():
    formats = redis_url_formats()
    assert len(formats) == 2  # the budgets' and the cache's
    assert redis_tls_problems(formats) == []


def test_redis_tls_check_catches_the_default_hostname_check(tmp_path):
    tree = copy_tree(tmp_path / "terraform")
    path = tree / "redis.tf"
    path.write_text(path.read_text().replace("&ssl_check_hostname=false", ""))
    assert len(redis_tls_problems(redis_url_formats(tree))) == 2


# --- secrets: one way into the pods ---------------------------------------------------------


def secret_path_problems(
    tree: Path = TERRAFORM, chart: Path = ROOT / "helm" / "forge"
) -> list[str]:
    """Secrets reach the pods one way: the chart's Kubernetes Secrets. Terraform enables the
    Secret Manager CSI add-on only if the chart renders a SecretProviderClass, and no output or
    README promises one the chart does not have (issue 32, item 11)."""
    templates = " ".join(p.read_text() for p in (chart / "templates").glob("*.yaml"))
    provider = "kind: SecretProviderClass" in templates
    gke = (tree / GKE).read_text()
    enabled = re.search(r"secret_manager_config\s*{\s*enabled\s*=\s*true", gke) is not None
    problems = []
    if enabled != provider:
        problems.append(
            f"Secret Manager CSI add-on {'on' if enabled else 'off'}, the chart "
            f"{'renders' if provider else 'has no'} SecretProviderClass"
        )
    if not provider:
        for path in (tree / "outputs.tf", tree / "README.md"):
            if "SecretProviderClass" in path.read_text():
                problems.append(f"{path.name} promises a SecretProviderClass the chart lacks")
    return problems


def test_secrets_reach_the_pods_one_way():
    assert secret_path_problems() == []


def test_secret_path_check_catches_the_unused_csi_add_on(tmp_path):
    tree = copy_tree(tmp_path / "terraform")
    rewrite(tree, GKE, "enabled = false", "enabled = true", after="secret_manager_config")
    append(tree, "outputs.tf", "# for the chart's SecretProviderClass\n")
    assert len(secret_path_problems(tree)) == 2


# --- the T4 driver and the GPU image's CUDA ---------------------------------------------------

CUDA_DRIVERS = ROOT / "images" / "cuda-drivers.yaml"
GPU_DOCKERFILE = ROOT / "images" / "gpu.Dockerfile"


def variable_default(name: str, tree: Path = TERRAFORM) -> str:
    text = (tree / "variables.tf").read_text()
    block = text[text.index(f'variable "{name}"') :]
    return re.search(r'default\s*=\s*"([^"]*)"', block).group(1)


def pinned_vllm() -> str:
    return re.search(r'"vllm==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def driver_problems(dockerfile: str, setting: str, pairing: dict, vllm: str) -> list[str]:
    """The driver GKE installs on the T4 nodes (terraform: gpu_driver_version) runs the CUDA the
    GPU image's vLLM and torch were built for (issue 32, item 4): images/cuda-drivers.yaml
    gives each CUDA major's lowest driver branch and each setting's lowest driver, or none
    (DEFAULT changes with the GKE version, so no pairing can be stated for it)."""
    arg = re.search(r"^ARG VLLM_CUDA=cu(\d\d)\d$", dockerfile, re.MULTILINE)
    problems = []
    if arg is None:
        cuda = pairing["vllm_default_cuda"][vllm]
        source = f"vLLM {vllm}'s default wheel"
    else:
        cuda = int(arg[1])
        source = f"the image's VLLM_CUDA=cu{arg[1]}"
        for index in (f"https://wheels.vllm.ai/{vllm}/${{VLLM_CUDA}}", "whl/${VLLM_CUDA}"):
            if index not in dockerfile:
                problems.append(f"gpu.Dockerfile installs without the index {index}")
    needs = pairing["cuda_driver_floor"][cuda]
    floor = pairing["gke_driver_floor"].get(setting)
    if floor is None:
        problems.append(
            f"gpu_driver_version {setting}: no lowest driver can be stated, and {source} "
            f"(CUDA {cuda}) needs R{needs}+"
        )
    elif floor < needs:
        problems.append(
            f"gpu_driver_version {setting} may install R{floor}; {source} (CUDA {cuda}) needs "
            f"R{needs}+"
        )
    return problems


def test_the_t4_driver_runs_the_images_cuda():
    pairing = yaml.safe_load(CUDA_DRIVERS.read_text())
    dockerfile = GPU_DOCKERFILE.read_text()
    setting = variable_default("gpu_driver_version")
    assert driver_problems(dockerfile, setting, pairing, pinned_vllm()) == []


def test_driver_check_catches_cuda_13_and_an_unstated_driver():
    pairing = yaml.safe_load(CUDA_DRIVERS.read_text())
    dockerfile = GPU_DOCKERFILE.read_text()
    vllm = pinned_vllm()
    # As the files were: vLLM's default (CUDA 13) wheel on the GKE version's DEFAULT driver.
    default_wheel = re.sub(r"^ARG VLLM_CUDA=.*\n", "", dockerfile, flags=re.MULTILINE)
    (problem,) = driver_problems(default_wheel, "DEFAULT", pairing, vllm)
    assert "no lowest driver can be stated" in problem and "CUDA 13" in problem
    # CUDA 13 wants R580: LATEST's stated floor (570) is not enough.
    cu130 = dockerfile.replace("ARG VLLM_CUDA=cu129", "ARG VLLM_CUDA=cu130")
    (problem,) = driver_problems(cu130, "LATEST", pairing, vllm)
    assert "needs R580+" in problem
    # The CUDA 12 build on an unpinned driver, and an index of another vLLM release.
    assert driver_problems(dockerfile, "DEFAULT", pairing, vllm)
    other = dockerfile.replace(f"wheels.vllm.ai/{vllm}/", "wheels.vllm.ai/0.31.0/")
    assert "without the index" in driver_problems(other, "LATEST", pairing, vllm)[0]
