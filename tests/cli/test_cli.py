import asyncio
import csv
import hashlib
import io
import json
import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from serve_app import cli
from serve_app.auth.keys import hash_key
from serve_app.config.models import ForgeConfig, load_config
from serve_app.local import build_local_gateway
from serve_app.metering.ledger import UsageRecord
from serve_app.metering.sqlite import SqliteBook
from tests.polling import eventually


def test_keys_new_prints_a_key_and_the_hash_of_that_key(capsys, tmp_path):
    assert cli.main(["keys", "new", "--tenant", "team-a"]) == 0
    out = capsys.readouterr().out
    key = next(w for w in out.split() if w.startswith("sk-forge-"))
    assert hashlib.sha256(key.encode()).hexdigest() in out
    assert "- name: team-a" in out
    digest = hashlib.sha256(key.encode()).hexdigest()
    # Each line as the file it goes into takes it: the config, the key file, the admin keys.
    from serve_app.auth.keys import load_key_hashes_file

    line = next(x.strip() for x in out.splitlines() if x.strip().startswith("team-a:"))
    keys = tmp_path / "keys.yaml"
    keys.write_text(line + "\n")
    assert load_key_hashes_file(str(keys), ["team-a"]) == {"team-a": [digest]}
    assert f"  - {digest}" in out


@pytest.mark.parametrize("tenant", ["", "a: b #c", "-x"])
def test_keys_new_refuses_a_name_the_config_would_refuse(tenant, capsys):
    """The printed line goes into a config: it must be one ``forge config check`` passes."""
    assert cli.main(["keys", "new", f"--tenant={tenant}"]) == 2
    assert "sk-forge-" not in capsys.readouterr().out


def test_keys_hash_reads_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-demo\n"))
    assert cli.main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(b"sk-demo").hexdigest()


# -- forge usage: against a gateway served by uvicorn on 127.0.0.1 ----------------------------

ADMIN_KEY = "sk-test-cli-admin"
ALPHA_KEY = "sk-test-cli-alpha"
MODEL = "forge-sim"
UNPRICED = "free-model"
DAY = "2025-03-01"
PRICE = {"prompt_per_million": 2.0, "completion_per_million": 8.0, "cached_per_million": 0.5}


def usage_config() -> ForgeConfig:
    return load_config(
        {
            "tenants": [
                {"name": "alpha", "key_hashes": [hash_key(ALPHA_KEY)]},
                {"name": "beta", "key_hashes": [hash_key("sk-test-cli-beta")]},
            ],
            "pools": [{"name": "primary", "model": MODEL}],
            "metering": {"currency": "EUR", "prices": {MODEL: PRICE}},
            "admin": {"key_hashes": [hash_key(ADMIN_KEY)]},
        }
    )


@pytest.fixture(scope="module")
def forge_url(tmp_path_factory) -> Iterator[str]:
    """A gateway with a day of usage, served on a free port of 127.0.0.1 in a thread."""
    book = SqliteBook(tmp_path_factory.mktemp("ledger") / "usage.sqlite3")
    gateway = build_local_gateway(usage_config(), book=book)
    records = [
        UsageRecord("alpha", MODEL, DAY, {"requests": 3, "prompt_tokens": 1_000_000}),
        UsageRecord("alpha", MODEL, DAY, {"completion_tokens": 500_000, "cached_tokens": 2_000}),
        UsageRecord("beta", MODEL, DAY, {"requests": 1, "prompt_tokens": 250_000}),
        UsageRecord("beta", UNPRICED, DAY, {"requests": 2, "prompt_tokens": 10}),
        # Refused before a model was read (a 400 on a malformed body): nothing to price.
        UsageRecord("alpha", "none", DAY, {"requests": 1, "errors_invalid": 1}),
        # Refused by its budget and by admission: counted as requests, and as errors.
        UsageRecord("beta", MODEL, DAY, {"requests": 2, "errors_rate_limited": 2}),
    ]

    async def write() -> None:
        for record in records:
            gateway.ledger.add(record)
        await gateway.ledger.flush()

    asyncio.run(write())
    server = uvicorn.Server(
        uvicorn.Config(gateway.asgi_app(), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, timeout_s=10, what="uvicorn to start")
    (port,) = {s.getsockname()[1] for srv in server.servers for s in srv.sockets}
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def forge_usage(url: str, *args: str) -> int:
    return cli.main(["usage", "--url", url, "--start", DAY, "--end", DAY, *args])


# alpha: 1M prompt at 2.0 + 0.5M completion at 8.0 + 2k cached at 0.5 = 2 + 4 + 0.001
ALPHA_COST = 6.001
BETA_COST = 0.5  # 250k prompt at 2.0


def test_usage_prints_a_table_with_costs_and_a_total(forge_url, monkeypatch, capsys):
    monkeypatch.setenv("FORGE_ADMIN_KEY", ADMIN_KEY)
    assert forge_usage(forge_url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Usage {DAY} to {DAY} (UTC)"
    assert lines[1].split() == [
        *("tenant", "model", "requests", "errors", "prompt", "completion", "cached", "cost"),
        "(EUR)",
    ]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[3:7]}
    assert rows == {
        ("alpha", MODEL): ["3", "0", "1,000,000", "500,000", "2,000", "6.0010"],
        ("alpha", "none"): ["1", "1", "0", "0", "0", "0.0000"],
        ("beta", MODEL): ["3", "2", "250,000", "0", "0", "0.5000"],
        ("beta", UNPRICED): ["2", "0", "10", "0", "0", "unpriced"],
    }
    assert lines[8].split() == ["total", "9", "3", "1,250,010", "500,000", "2,000", "6.5010"]
    assert lines[9] == f"No price configured (metering.prices) for: {UNPRICED}"


def test_usage_json_carries_rows_costs_and_the_total(forge_url, monkeypatch, capsys):
    monkeypatch.setenv("FORGE_ADMIN_KEY", ADMIN_KEY)
    assert forge_usage(forge_url, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["currency"] == "EUR"
    costs = {(r["tenant"], r["model"]): r["cost"] for r in report["rows"]}
    assert costs[("alpha", MODEL)] == pytest.approx(ALPHA_COST)
    assert costs[("beta", MODEL)] == pytest.approx(BETA_COST)
    assert costs[("beta", UNPRICED)] is None
    assert report["total"]["cost"] == pytest.approx(ALPHA_COST + BETA_COST)
    assert report["total"]["requests"] == 9
    assert report["total"]["error_requests"] == 3
    errors = {(r["tenant"], r["model"]): r["errors"] for r in report["rows"]}
    assert errors[("beta", MODEL)]["rate_limited"] == 2  # by class, as /admin/usage gives it
    assert costs[("alpha", "none")] == 0
    assert report["unpriced_models"] == [UNPRICED]


def test_usage_csv_has_a_header_and_a_row_per_tenant_and_model(forge_url, monkeypatch, capsys):
    monkeypatch.setenv("FORGE_ADMIN_KEY", ADMIN_KEY)
    assert forge_usage(forge_url, "--csv", "--tenant", "alpha") == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["model"] for r in rows] == [MODEL, "none"]
    row = rows[0]
    assert (row["tenant"], row["model"], row["start"], row["currency"]) == (
        "alpha",
        MODEL,
        DAY,
        "EUR",
    )
    assert (row["requests"], row["prompt_tokens"], row["cached_tokens"]) == ("3", "1000000", "2000")
    assert float(row["cost"]) == pytest.approx(ALPHA_COST)
    refused = rows[1]
    assert (refused["requests"], refused["error_requests"], refused["errors_invalid"]) == (
        "1",
        "1",
        "1",
    )


def test_usage_with_a_tenants_key_or_a_wrong_key_exits_1(forge_url, monkeypatch, capsys):
    monkeypatch.setenv("FORGE_ADMIN_KEY", "sk-test-cli-wrong")
    assert forge_usage(forge_url) == 1
    err = capsys.readouterr().err
    assert "refused the key in FORGE_ADMIN_KEY (401" in err
    monkeypatch.setenv("FORGE_ADMIN_KEY", ALPHA_KEY)
    assert forge_usage(forge_url) == 1
    assert "FORGE_ADMIN_KEY is not an admin key (403" in capsys.readouterr().err


def test_usage_reports_the_gateways_400(forge_url, monkeypatch, capsys):
    monkeypatch.setenv("FORGE_ADMIN_KEY", ADMIN_KEY)
    assert cli.main(["usage", "--url", forge_url, "--start", "2025-31-01"]) == 1
    assert "400" in capsys.readouterr().err


def test_usage_without_a_key_or_a_gateway_exits_1(monkeypatch, capsys):
    monkeypatch.delenv("FORGE_ADMIN_KEY", raising=False)
    assert cli.main(["usage"]) == 1
    assert "set FORGE_ADMIN_KEY" in capsys.readouterr().err
    monkeypatch.setenv("FORGE_ADMIN_KEY", ADMIN_KEY)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert cli.main(["usage", "--url", f"http://127.0.0.1:{port}"]) == 1
    assert "cannot connect" in capsys.readouterr().err


def test_the_admin_key_is_never_a_command_line_argument():
    with pytest.raises(SystemExit):
        cli.main(["usage", "--key", ADMIN_KEY])


def test_config_check_passes_the_shipped_configs_and_names_a_bad_live_field(tmp_path, capsys):
    import yaml

    for name in ("local.yaml", "gke.yaml"):
        assert cli.main(["config", "check", f"configs/{name}"]) == 0
    assert "live configuration" in capsys.readouterr().out
    document = yaml.safe_load(open("configs/local.yaml"))
    gateway = document["applications"][0]["deployments"][0]
    gateway["user_config"]["tenants"][1]["limits"]["rpm"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["config", "check", str(bad)]) == 1
    assert "tenants.1.limits.rpm" in capsys.readouterr().err
    assert cli.main(["config", "check", str(bad), "--app", "nope"]) == 2


def local_yaml() -> dict:
    """configs/local.yaml as a document to change."""
    import yaml

    with open("configs/local.yaml") as f:
        return yaml.safe_load(f)


def config_check(tmp_path, document: dict) -> int:
    """``forge config check`` on ``document``, written to a file as an operator writes it."""
    import yaml

    path = tmp_path / "checked.yaml"
    path.write_text(yaml.safe_dump(document))
    return cli.main(["config", "check", str(path)])


@pytest.mark.parametrize(
    ("mistake", "said"),
    [
        (lambda d: d["applications"], "the file is a list, not a Serve config"),
        (lambda d: {"applications": ["forge"]}, "applications.0: 'forge' is not an application"),
        (
            lambda d: {**d, "applications": [{**d["applications"][0], "deployments": ["gw"]}]},
            "deployments.0: 'gw' is not a deployment",
        ),
    ],
    ids=["a-list", "an-application-string", "a-deployment-string"],
)
def test_config_check_says_what_shape_is_wrong_without_a_traceback(tmp_path, capsys, mistake, said):
    import yaml

    document = yaml.safe_load(open("configs/local.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(mistake(document)))
    assert cli.main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("typo", "meant"), [("userconfig", "user_config"), ("deployment", "deployments")]
)
def test_config_check_names_a_key_serve_would_drop_with_the_tenants(tmp_path, capsys, typo, meant):
    """Serve ignores keys it does not know: the gateway's live configuration (its tenants)
    went with them, and the check said ok."""
    document = local_yaml()
    forge = document["applications"][0]
    if typo == "deployment":
        forge["deployment"] = forge.pop("deployments")
    else:
        forge["deployments"][0]["userconfig"] = forge["deployments"][0].pop("user_config")
    assert config_check(tmp_path, document) == 1
    assert f"{typo!r} is not a Serve setting, and Serve ignores it: did you mean {meant!r}?" in (
        capsys.readouterr().err
    )


def test_config_check_refuses_what_the_gateway_would_not_start(tmp_path, capsys):
    document = local_yaml()
    forge = document["applications"][0]
    forge["deployments"] = [d for d in forge["deployments"] if d["name"] != "gateway"]
    forge["args"].pop("tenants", None)
    assert config_check(tmp_path, document) == 1
    assert "no tenants: the gateway would not start" in capsys.readouterr().err


def test_config_check_reads_the_key_files_that_are_here(tmp_path, capsys):
    document = local_yaml()
    forge = document["applications"][0]
    tenants = forge["deployments"][0]["user_config"]["tenants"]
    keys = tmp_path / "keys.yaml"
    # The first tenant's key, listed under the second: the gateway would refuse to start.
    keys.write_text(f"{tenants[1]['name']}: [{tenants[0]['key_hashes'][0]}]\n")
    forge["args"]["key_hashes_file"] = str(keys)
    assert config_check(tmp_path, document) == 1
    assert "listed for two tenants" in capsys.readouterr().err
    keys.write_text(f"{tenants[1]['name']}: [{hash_key('sk-test-cli-new')}]\n")
    assert config_check(tmp_path, document) == 0
    assert f"{keys} read" in capsys.readouterr().out
    forge["args"]["key_hashes_file"] = "/var/run/forge-keys/tenants.yaml"
    assert config_check(tmp_path, document) == 0
    assert "not on this machine: not checked" in capsys.readouterr().out


def test_config_check_notes_a_price_for_a_model_nothing_serves(tmp_path, capsys):
    document = local_yaml()
    forge = document["applications"][0]
    forge["args"].setdefault("metering", {})["prices"] = {
        "forge-sim-1b": {"prompt_per_million": 1.0},
        "forge-sim-1bb": {"prompt_per_million": 1.0},  # a typo, or a model retired
    }
    assert config_check(tmp_path, document) == 0
    out = capsys.readouterr().out
    assert "note: metering.prices.forge-sim-1bb: no pool, adapter or fallback serves" in out
    assert "prices.forge-sim-1b:" not in out


def test_config_check_holds_the_gateway_and_its_pools_applications_to_each_other(tmp_path, capsys):
    import yaml

    document = yaml.safe_load(open("configs/local.yaml"))
    apps = {a["name"]: a for a in document["applications"]}
    apps["forge-pool-primary"]["args"]["pool"]["model"] = "another-model"
    apps["forge-pool-primary"]["args"]["pool"]["request_timeout_s"] = 30  # the gateway's: 600
    del apps["forge-pool-embed"]
    document["applications"] = list(apps.values())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "pools.0.app: application 'forge-pool-primary' has model 'another-model'" in err
    assert "has request_timeout_s 30.0, the gateway lists 600.0" in err
    assert "pools.1.app: application 'forge-pool-embed' is not in the Serve config" in err
    # An engine setting in the gateway's entry of a pool that runs elsewhere is refused.
    document = yaml.safe_load(open("configs/local.yaml"))
    document["applications"][0]["args"]["pools"][0]["engine"] = {"kind": "simulated"}  # a default
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["config", "check", str(bad)]) == 1
    assert "engine: set in the args of application 'forge-pool-primary'" in capsys.readouterr().err


def test_config_check_holds_the_gateway_and_its_control_application_to_each_other(tmp_path, capsys):
    """Every admitted pool needs a scheduler in the control application: one missing would be
    admitted with no slot budget at all (each request failing open)."""
    import yaml

    def check(edit) -> str:
        document = yaml.safe_load(open("configs/local.yaml"))
        edit({a["name"]: a for a in document["applications"]}, document)
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(document))
        assert cli.main(["config", "check", str(bad)]) == 1
        return capsys.readouterr().err

    def no_scheduler(apps, _document):
        apps["forge-control"]["args"]["schedulers"] = []

    def gone(apps, document):
        document["applications"] = [a for a in apps.values() if a["name"] != "forge-control"]

    def not_a_control(apps, _document):
        apps["forge-control"]["import_path"] = "serve_app.app:build_pool"

    where = "control_app: application 'forge-control'"
    assert f"{where} has no scheduler for pools ['primary']" in check(no_scheduler)
    assert f"{where} is not in the Serve config" in check(gone)
    assert f"{where} is not built by serve_app.app:build_control" in check(not_a_control)
    assert cli.main(["config", "check", "configs/local.yaml"]) == 0
    assert "schedulers and breaker board in forge-control" in capsys.readouterr().out


def test_config_check_names_a_pools_adapters_the_gateway_and_its_application_disagree_on(
    tmp_path, capsys
):
    import yaml

    document = yaml.safe_load(open("configs/local.yaml"))
    apps = {a["name"]: a for a in document["applications"]}
    adapters = [{"name": "acme", "path": "/models/adapters/acme"}]
    apps["forge-pool-primary"]["args"]["pool"]["adapters"] = adapters  # the replicas load it...
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["config", "check", str(bad)]) == 1  # ...but the gateway would not route it
    assert "application 'forge-pool-primary' has adapters" in capsys.readouterr().err
    document["applications"][0]["args"]["pools"][0]["adapters"] = adapters
    bad.write_text(yaml.safe_dump(document))
    assert cli.main(["config", "check", str(bad)]) == 0
