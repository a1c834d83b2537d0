"""Ray's own Grafana dashboards for Serve, written from the Ray release Forge runs.

Ray generates its dashboards at runtime (the head writes them under
/tmp/ray/session_latest/metrics/grafana/dashboards/); on the cluster nothing provisions them into
Grafana. This writes the two Serve ones (applications, HTTP; deployments, replicas) from Ray's own
factory (``ray.dashboard.modules.metrics.grafana_dashboard_factory``) into observability/grafana/
ray/, so they are versioned with the Ray that pyproject.toml pins; the chart ships them in its
dashboard ConfigMap (helm/forge/templates/dashboard-configmap.yaml, through helm/forge/files/),
where Grafana's sidecar loads them beside forge-overview.json.

    .venv/bin/python observability/grafana/ray_dashboards.py          # write them
    .venv/bin/python observability/grafana/ray_dashboards.py --check  # exit 1 if they differ

Run it after a Ray upgrade; tests/deploy/test_cluster.py fails while the files differ from what
the installed Ray generates. Compact JSON: the ConfigMap must stay under the 256 KiB that
client-side apply (ArgoCD's, for this Application) can annotate.

Their filters: ``ray_io_cluster`` (the chart's PodMonitor copies KubeRay's pod label onto every
series) and the ``datasource`` variable (Grafana's default Prometheus).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "ray"


def dashboards() -> dict[str, str]:
    """File name → the dashboard's JSON, as this Ray generates it (compact)."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    generated = {
        "ray-serve.json": factory.generate_serve_grafana_dashboard,
        "ray-serve-deployment.json": factory.generate_serve_deployment_grafana_dashboard,
    }
    out = {}
    for name, generate in generated.items():
        content, _uid = generate()
        out[name] = json.dumps(json.loads(content), separators=(",", ":")) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in dashboards().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            continue
        OUT.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    if stale:
        print(f"differ from this Ray's: {', '.join(stale)} (run without --check)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
