"""images/ (the Dockerfiles), .dockerignore and .github/workflows/deploy.yml, offline.

Dockerfiles: hadolint clean (ignores only inline, each with its reason), Ray's own base image at
the Ray release pyproject.toml pins, a non-root USER in the final stage, no ADD of a URL, nothing
secret-looking in ARG/ENV, and every COPY source inside the build context .dockerignore lets
through. The workflow: GitHub's workflow schema (check-jsonschema's vendored copy), zizmor
--offline clean, every action pinned by commit SHA with its release in a comment, keyless
(workload identity federation, ``id-token: write`` in the one job that pushes), the job order the
design says, and the gate before traffic: ``production`` (what ArgoCD follows) moves only in a job
that runs when every gate passed, the eval gate runs against the pushed image, and the promotion
step itself, run on a scratch repository, fast-forwards ``production`` or pushes nothing. Each
check is fed a broken copy and must catch it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.conftest import ROOT, Tools

IMAGES = ROOT / "images"
GATEWAY = IMAGES / "gateway.Dockerfile"
GPU = IMAGES / "gpu.Dockerfile"
DOCKERFILES = (GATEWAY, GPU)
DOCKERIGNORE = ROOT / ".dockerignore"
WORKFLOW = ROOT / ".github" / "workflows" / "deploy.yml"


# --- Dockerfiles -----------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def non_root_problems(dockerfile: Path) -> list[str]:
    users = [args for word, args in final_stage(dockerfile) if word == "USER"]
    if not users:
        return [f"{dockerfile.name}: no USER in the final stage (it would run as the base's user)"]
    user = users[-1].split(":")[0]
    if user in ("root", "0"):
        return [f"{dockerfile.name}: the final USER is root"]
    return []


def hadolint(tools: Tools, *files: Path):
    # No config file: the rules are hadolint's defaults, every ignore is inline.
    return tools.run("hadolint", "--no-color", *map(str, files))


def test_dockerfiles_pass_hadolint(tools: Tools):
    done = hadolint(tools, *DOCKERFILES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(ROOT.glob(".hadolint.y*ml")), "ignores are inline, with their reasons"


def test_every_hadolint_ignore_is_inline_and_says_why():
    for dockerfile in DOCKERFILES:
        lines = dockerfile.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                reason = lines[i - 1].strip()
                assert reason.startswith("#") and "hadolint ignore" not in reason, (
                    f"{dockerfile.name}:{i + 1}: say why on the line above the ignore"
                )


def test_the_images_run_as_a_non_root_user():
    for dockerfile in DOCKERFILES:
        assert non_root_problems(dockerfile) == []
        # Numeric, so the kubelet can enforce runAsNonRoot without a runAsUser.
        users = [a for w, a in final_stage(dockerfile) if w == "USER"]
        assert users[-1].split(":")[0].isdigit(), dockerfile.name


def test_a_latest_base_without_user_is_caught(tools: Tools, tmp_path: Path):
    broken = tmp_path / "Dockerfile"
    broken.write_text('FROM ubuntu:latest\nRUN pip install requests\nCMD ["python3"]\n')
    done = hadolint(tools, broken)
    assert done.returncode != 0 and "DL3007" in done.stdout, done.stdout
    assert non_root_problems(broken) != []
    root_again = tmp_path / "root.Dockerfile"
    root_again.write_text(GATEWAY.read_text() + "USER root\n")
    assert non_root_problems(root_again) != []


def ray_release() -> str:
    """The Ray release pyproject.toml pins (``ray[serve]>=2.60,<2.61`` → ``2.60``)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"ray\[serve\]>=(\d+\.\d+),<(\d+\.\d+)"', text)
    assert match, "pyproject.toml no longer pins Ray as ray[serve]>=X.Y,<X.Z"
    return match.group(1)


def test_the_bases_are_rays_own_images_at_the_pinned_release():
    release = re.escape(ray_release())
    expected = {
        GATEWAY: rf"^rayproject/ray:{release}\.\d+-py311-cpu(@sha256:[0-9a-f]{{64}})?$",
        GPU: rf"^rayproject/ray:{release}\.\d+-py311-(gpu|cu\d+)(@sha256:[0-9a-f]{{64}})?$",
    }
    for dockerfile, pattern in expected.items():
        (base,) = [args for word, args in instructions(dockerfile) if word == "FROM"]
        assert re.match(pattern, base), (dockerfile.name, base)
        # The digest pin is documented beside the tag.
        assert "@sha256:" in dockerfile.read_text(), dockerfile.name


def test_the_images_install_forge_with_the_right_extras_and_bake_in_no_secret():
    runs = {d: " ".join(a for w, a in instructions(d) if w == "RUN") for d in DOCKERFILES}
    # The gateway image runs the eval gate Job too: its openai client is in the base install.
    assert 'pip install --no-cache-dir "."' in runs[GATEWAY]
    assert "[dev]" not in runs[GATEWAY] and "[vllm]" not in runs[GATEWAY]
    assert 'pip install --no-cache-dir ".[vllm]"' in runs[GPU]
    secretish = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)", re.IGNORECASE)
    for dockerfile in DOCKERFILES:
        for word, args in instructions(dockerfile):
            assert not (word == "ADD" and re.search(r"https?://", args)), dockerfile.name
            if word in ("ARG", "ENV"):
                names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
                assert not any(secretish.search(n) for n in names), (dockerfile.name, args)


# --- .dockerignore ---------------------------------------------------------------------------


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go's filepath.Match plus ``**``) as a regex on a relative path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1].replace("[!", "[^"), end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def excluded(path: str, lines: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    rules = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern(line.lstrip("!").strip("/"))))
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for negate, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            verdict = not negate
    return verdict


def test_dockerignore_keeps_state_caches_and_secrets_out():
    lines = DOCKERIGNORE.read_text().splitlines()
    for path in (
        ".venv/bin/python",
        ".git/config",
        "terraform/terraform.tfstate",
        "terraform/envs/prod.tfstate.backup",
        "terraform/.terraform/providers/x",
        "tests/test_app.py",
        ".pytest_cache/v/cache",
        "serve_app/__pycache__/app.cpython-311.pyc",
        "serve_app/.env",
        "configs/key.pem",
        "helm/forge/values.yaml",
        "loadtest/results/failover.json",
        "forge_gateway.egg-info/PKG-INFO",
    ):
        assert excluded(path, lines), path
    for path in ("pyproject.toml", "README.md", "serve_app/app.py", "configs/gke.yaml"):
        assert not excluded(path, lines), path


def test_the_matcher_sees_a_dockerignore_that_lets_the_venv_in():
    assert excluded(".venv/bin/python", [".venv"])
    assert not excluded(".venv/bin/python", ["*", "!.venv"])
    assert not excluded("terraform/terraform.tfstate", [".git"])


def test_every_copy_source_is_in_the_build_context():
    lines = DOCKERIGNORE.read_text().splitlines()
    for dockerfile in DOCKERFILES:
        for word, args in instructions(dockerfile):
            if word != "COPY":
                continue
            parts = [a for a in args.split() if not a.startswith("--")]
            for source in parts[:-1]:
                assert (ROOT / source).exists(), (dockerfile.name, source)
                if source != ".":
                    assert not excluded(source.strip("/"), lines), (dockerfile.name, source)
    # What `COPY . .` brings must be enough to `pip install .` and run the tools from WORKDIR.
    for needed in ("pyproject.toml", "README.md", "serve_app/app.py", "loadtest/http_load.py"):
        assert not excluded(needed, lines), needed


# --- the workflow ----------------------------------------------------------------------------


def workflow(path: Path = WORKFLOW) -> dict:
    return yaml.safe_load(path.read_text())


def triggers(wf: dict) -> dict:
    return wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true


def broken_copy(tmp: Path, old: str, new: str, *, count: int = 1) -> Path:
    """The workflow with ``old`` replaced, in a repository-shaped tree of its own."""
    target = tmp / ".github" / "workflows" / "deploy.yml"
    target.parent.mkdir(parents=True)
    text = WORKFLOW.read_text()
    assert old in text, "the rewrite no longer matches the workflow"
    target.write_text(text.replace(old, new, count))
    return target


def schema(tools: Tools, path: Path):
    return tools.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(path))


def zizmor(tools: Tools, path: Path):
    # --offline: no GitHub API (no ref lookups); the default persona and severity.
    return tools.run("zizmor", "--offline", "--no-progress", str(path))


def test_the_workflow_matches_githubs_schema(tools: Tools):
    done = schema(tools, WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_rejects_a_broken_workflow(tools: Tools, tmp_path: Path):
    broken = broken_copy(tmp_path, "runs-on: ubuntu-24.04", "runs_on: ubuntu-24.04")
    done = schema(tools, broken)
    assert done.returncode != 0, done.stdout


def test_zizmor_finds_nothing(tools: Tools):
    done = zizmor(tools, WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


def test_zizmor_flags_an_unpinned_action(tools: Tools, tmp_path: Path):
    sha = "actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2"
    broken = broken_copy(tmp_path, sha, "actions/checkout@v4")
    done = zizmor(tools, broken)
    assert done.returncode != 0 and "unpinned-uses" in done.stdout, done.stdout + done.stderr


def test_zizmor_flags_template_injection(tools: Tools, tmp_path: Path):
    broken = broken_copy(
        tmp_path,
        'cluster/bump-image-tag.sh "$TAG"',
        "cluster/bump-image-tag.sh ${{ github.event.head_commit.message }}",
    )
    done = zizmor(tools, broken)
    assert done.returncode != 0 and "template-injection" in done.stdout, done.stdout


PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+$")


def unpinned(text: str) -> list[str]:
    """`uses:` lines not pinned to a full commit SHA with the release in a comment."""
    found = []
    for line in text.splitlines():
        match = re.match(r"^\s*(?:-\s+)?uses:\s*(.+?)\s*$", line)
        if match and not match.group(1).startswith("./") and not PINNED.match(match.group(1)):
            found.append(match.group(1))
    return found


def test_every_action_is_pinned_by_sha_with_its_release():
    assert unpinned(WORKFLOW.read_text()) == []
    uses = [s["uses"] for job in workflow()["jobs"].values() for s in job["steps"] if "uses" in s]
    assert len(uses) >= 8


def test_the_pin_check_catches_a_tag_a_short_sha_and_a_missing_comment():
    text = WORKFLOW.read_text()
    sha = "11bd71901bbe5b1630ceea73d27597364c9af683"
    for bad in ("v4", sha[:12] + " # v4.2.2", sha):
        broken = text.replace(f"{sha} # v4.2.2", bad, 1)
        assert unpinned(broken) != [], bad


def test_permissions_are_per_job_and_only_the_pushing_job_mints_a_token():
    wf = workflow()
    assert wf["permissions"] == {}
    assert "pull_request_target" not in triggers(wf)
    for name, job in wf["jobs"].items():
        perms = job["permissions"]
        assert perms.get("contents") in ("read", "write"), name
        assert perms.get("id-token", "none") == ("write" if name == "images" else "none"), name
        assert set(perms) <= {"contents", "id-token"}, name
    assert wf["jobs"]["deploy"]["permissions"]["contents"] == "write"
    assert wf["jobs"]["images"]["if"].count("refs/heads/main") == 1


def test_keyless_auth_through_workload_identity_federation():
    steps = workflow()["jobs"]["images"]["steps"]
    (auth,) = [s for s in steps if s.get("uses", "").startswith("google-github-actions/auth@")]
    assert set(auth["with"]) >= {"workload_identity_provider", "service_account"}
    assert "credentials_json" not in auth["with"]
    assert "credentials_json" not in WORKFLOW.read_text()
    # Terraform's provider admits the subject ref:refs/heads/main; an environment changes it.
    assert "environment" not in workflow()["jobs"]["images"]


def test_checkouts_drop_their_credentials_except_where_they_push():
    for name, job in workflow()["jobs"].items():
        for step in job["steps"]:
            if step.get("uses", "").startswith("actions/checkout@"):
                persist = step.get("with", {}).get("persist-credentials")
                assert persist is (name == "deploy"), name


def test_no_expression_is_expanded_inside_a_script():
    for name, job in workflow()["jobs"].items():
        for step in job["steps"]:
            assert "${{" not in step.get("run", ""), (name, step.get("name"))


def test_the_jobs_run_in_the_designed_order():
    jobs = workflow()["jobs"]
    assert "needs" not in jobs["tests"]
    assert jobs["local-gate"]["needs"] == "tests"
    assert set(jobs["images"]["needs"]) == {"tests", "local-gate"}
    assert jobs["deploy"]["needs"] == "images"
    runs = {n: "\n".join(s.get("run", "") for s in j["steps"]) for n, j in jobs.items()}
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^python3 -m venv \.venv && .*pytest$", readme, re.MULTILINE)
    assert command and command.group(0) in runs["tests"], "the README's test command"
    assert "bash .ci/deploy" in runs["tests"]
    assert "serve run configs/local.yaml" in runs["local-gate"]
    assert re.search(
        r"python -m evals --base-url \S+ --key \S+ --admin-key \S+", runs["local-gate"]
    )
    built = [
        s["with"]["file"]
        for s in jobs["images"]["steps"]
        if "build-push-action" in s.get("uses", "")
    ]
    assert sorted(built) == sorted(str(d.relative_to(ROOT)) for d in DOCKERFILES)
    for path in built:
        assert (ROOT / path).is_file()
    assert "cluster/bump-image-tag.sh" in runs["deploy"]
    assert (ROOT / "cluster" / "bump-image-tag.sh").is_file()


# --- the gate before traffic -----------------------------------------------------------------
#
# ArgoCD follows `production` (tests/deploy/test_cluster.py checks every Application). Here: the
# one job that moves it runs only when the tests, the local gate and the eval gate against the
# pushed image all passed; and its step, run for real on a scratch repository, moves production by
# fast-forward to the commit that pins the new images, or pushes nothing at all.

PRODUCTION_REF = "production"
_STATUS_FUNCTIONS = ("always()", "failure()", "cancelled()")


def as_list(needs) -> list[str]:
    return [] if needs is None else [needs] if isinstance(needs, str) else list(needs)


def jobs_that_run(wf: dict, failing: set[str]) -> set[str]:
    """GitHub's rule for a push: a job runs when every job it needs ran and succeeded, unless its
    `if` calls a status function (always(), failure(), cancelled()), which runs it regardless.
    ``failing``: the jobs that run and fail."""
    jobs = wf["jobs"]
    ran: set[str] = set()
    succeeded: set[str] = set()
    pending = list(jobs)
    while pending:
        for name in list(pending):
            needs = as_list(jobs[name].get("needs"))
            if any(n in pending for n in needs):
                continue
            pending.remove(name)
            condition = str(jobs[name].get("if", ""))
            regardless = any(f in condition for f in _STATUS_FUNCTIONS)
            if regardless or all(n in succeeded for n in needs):
                ran.add(name)
                if name not in failing:
                    succeeded.add(name)
    return ran


def production_pushers(wf: dict) -> set[str]:
    """The jobs whose steps push the production ref."""
    return {
        name
        for name, job in wf["jobs"].items()
        for step in job["steps"]
        if re.search(rf"git push\b.*:(refs/heads/)?{PRODUCTION_REF}\b", step.get("run", ""))
    }


def gate_steps(wf: dict) -> dict[str, list[str]]:
    """Job → the names of its steps that run the eval gate (`python -m evals`)."""
    out: dict[str, list[str]] = {}
    for name, job in wf["jobs"].items():
        for step in job["steps"]:
            if re.search(r"python -m evals\b", step.get("run", "")):
                out.setdefault(name, []).append(step.get("name", ""))
    return out


def promotion_problems(wf: dict) -> list[str]:
    """How production could move without every gate: each job that runs a gate (or the tests)
    failing in turn, a job that pushes production must not run; and no gate step may be allowed
    to fail (continue-on-error)."""
    problems = []
    pushers = production_pushers(wf)
    if not pushers:
        problems.append(f"no job pushes {PRODUCTION_REF}: ArgoCD would never see a release")
    gated = set(gate_steps(wf)) | {"tests"}
    for failing in sorted(gated):
        moved = jobs_that_run(wf, {failing}) & pushers
        if moved:
            problems.append(f"{failing} failing, {sorted(moved)} still push {PRODUCTION_REF}")
    for name, job in wf["jobs"].items():
        for step in job["steps"]:
            if step.get("continue-on-error") and step.get("name") in gate_steps(wf).get(name, []):
                problems.append(f"{name}: {step['name']} may fail without failing the job")
    return problems


def test_production_moves_only_after_every_gate_passed():
    wf = workflow()
    assert production_pushers(wf) == {"deploy"}
    assert set(gate_steps(wf)) == {"local-gate", "images"}
    assert promotion_problems(wf) == []


def test_a_promotion_that_outlives_a_failed_gate_is_caught():
    wf = workflow()
    wf["jobs"]["deploy"]["if"] = "${{ always() }}"
    assert any("images failing" in p for p in promotion_problems(wf))
    wf = workflow()
    wf["jobs"]["deploy"]["needs"] = "tests"
    assert any("images failing" in p for p in promotion_problems(wf))
    wf = workflow()
    gate = next(s for s in wf["jobs"]["images"]["steps"] if "python -m evals" in s.get("run", ""))
    gate["continue-on-error"] = True
    assert any("may fail" in p for p in promotion_problems(wf))


def test_the_eval_gate_runs_whole_against_the_pushed_gateway_image():
    """The gate before traffic is the whole gate (the flood and the failover drill included: they
    hit CI's container) against the image ArgoCD will run, pulled back by its digest."""
    steps = workflow()["jobs"]["images"]["steps"]
    names = [s.get("name") for s in steps]
    gateway = next(s for s in steps if s.get("with", {}).get("file") == "images/gateway.Dockerfile")
    (gate_name,) = gate_steps(workflow())["images"]
    gate = steps[names.index(gate_name)]
    assert names.index(gate_name) > steps.index(gateway), "the gate needs the pushed image"
    assert gate["env"]["CANDIDATE"] == (
        "${{ env.REGISTRY }}/forge-ray@${{ steps." + gateway["id"] + ".outputs.digest }}"
    )
    run = gate["run"]
    assert re.search(r'"\$CANDIDATE" .*exec serve run configs/local\.yaml', run)
    # configs/local.yaml's HAProxy wrapper path, relative to the working directory, exists there.
    haproxy = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["controller_options"][
        "runtime_env"
    ]["env_vars"]["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert f'ln -sf "$(command -v forge-haproxy)" {haproxy}' in run
    command = re.search(r"python -m evals (.*)$", run, re.MULTILINE).group(1)
    assert "--only" not in command, "every check, the drills included"
    assert "--flood-key" in command, "the isolation drill runs (skipped without a flood tenant)"
    assert "--profile" not in command, "configs/local.yaml's calibrated profile (the default)"


PROMOTE_STEP = "Bump the image tag in cluster/, push main and fast-forward production"


def promotion_script() -> str:
    (step,) = [s for s in workflow()["jobs"]["deploy"]["steps"] if s.get("name") == PROMOTE_STEP]
    return step["run"]


def git(*args: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


def scratch_origin(tmp: Path) -> tuple[Path, Path]:
    """A bare `origin` whose main holds cluster/ two commits past production, and a checkout of
    main as actions/checkout leaves it."""
    work = tmp / "work"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    shutil.copytree(ROOT / "cluster", work / "cluster")
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "released", cwd=work)
    git("branch", PRODUCTION_REF, cwd=work)
    (work / "README.md").write_text("merged, not yet released\n")
    git("add", "-A", cwd=work)
    git("commit", "-q", "-m", "merged", cwd=work)
    origin = tmp / "origin.git"
    git("clone", "-q", "--bare", str(work), str(origin), cwd=tmp)
    checkout = tmp / "checkout"
    git("clone", "-q", "-b", "main", str(origin), str(checkout), cwd=tmp)
    return origin, checkout


def promote(checkout: Path, tag: str, script: str | None = None) -> subprocess.CompletedProcess:
    """The workflow's step, as GitHub runs a `run:` (bash -e -o pipefail) in the checkout."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(checkout.parent),
        "TAG": tag,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script or promotion_script()],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def move_production_by_hand(origin: Path, tmp: Path) -> str:
    """A commit pushed to production off main's history; its id."""
    elsewhere = tmp / "elsewhere"
    git("clone", "-q", "-b", PRODUCTION_REF, str(origin), str(elsewhere), cwd=tmp)
    (elsewhere / "hotfix").write_text("by hand\n")
    git("add", "-A", cwd=elsewhere)
    git("commit", "-q", "-m", "by hand", cwd=elsewhere)
    git("push", "-q", "origin", PRODUCTION_REF, cwd=elsewhere)
    return git("rev-parse", PRODUCTION_REF, cwd=origin)


def test_the_promotion_fast_forwards_production_to_the_pinned_images(tmp_path: Path):
    origin, checkout = scratch_origin(tmp_path)
    merged = git("rev-parse", "HEAD", cwd=checkout)
    done = promote(checkout, merged)
    assert done.returncode == 0, done.stdout + done.stderr
    main = git("rev-parse", "main", cwd=origin)
    assert git("rev-parse", PRODUCTION_REF, cwd=origin) == main
    assert git("rev-parse", f"{main}^", cwd=origin) == merged, "one bump commit on the merge"
    forge = git("show", f"{PRODUCTION_REF}:cluster/apps/forge.yaml", cwd=origin)
    assert forge.count(f'tag: "{merged}"  # forge-image-tag') == 2


def test_a_production_that_cannot_fast_forward_is_left_alone_and_main_too(tmp_path: Path):
    """Someone moved production by hand off main's history: the atomic push refuses both refs
    (no --force), the job fails, and nothing moved."""
    origin, checkout = scratch_origin(tmp_path)
    move_production_by_hand(origin, tmp_path)
    before = {ref: git("rev-parse", ref, cwd=origin) for ref in ("main", PRODUCTION_REF)}
    done = promote(checkout, git("rev-parse", "HEAD", cwd=checkout))
    assert done.returncode != 0, done.stdout
    assert {ref: git("rev-parse", ref, cwd=origin) for ref in before} == before


def test_the_scratch_run_catches_a_forced_promotion(tmp_path: Path):
    """With --force the same run overwrites the hand-moved production: the test above would fail."""
    forced = promotion_script().replace("git push --atomic", "git push --force --atomic")
    assert forced != promotion_script()
    origin, checkout = scratch_origin(tmp_path)
    by_hand = move_production_by_hand(origin, tmp_path)
    done = promote(checkout, git("rev-parse", "HEAD", cwd=checkout), forced)
    assert done.returncode == 0, done.stdout + done.stderr
    assert git("rev-parse", PRODUCTION_REF, cwd=origin) != by_hand


def test_the_image_names_match_what_argocd_deploys():
    jobs = workflow()["jobs"]
    tags = [
        s["with"]["tags"]
        for s in jobs["images"]["steps"]
        if "build-push-action" in s.get("uses", "")
    ]
    forge = yaml.safe_load((ROOT / "cluster" / "apps" / "forge.yaml").read_text())
    values = forge["spec"]["sources"][0]["helm"]["valuesObject"]
    for key in ("image", "gpuImage"):
        name = values[key]["repository"].rsplit("/", 1)[1]
        assert any(f"/{name}:${{{{ github.sha }}}}" in t for t in tags), (key, tags)
