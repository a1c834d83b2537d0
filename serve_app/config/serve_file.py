"""A Serve config file's own shape, checked before Forge reads its application.

Serve's schema ignores keys it does not know: a ``deployment:`` for ``deployments:`` or a
``userconfig:`` for ``user_config:`` is dropped without a word, and with it the gateway's live
configuration (its tenants and keys), which ``serve deploy`` then rolls out. ``forge config
check`` names such keys, with the one meant, and a file of the wrong shape (a list, an
application that is a string) gets a sentence, not a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def _fields(schema: Any) -> set[str]:
    return set(getattr(schema, "model_fields", None) or schema.__fields__)


def _unknown(keys: Iterable[str], known: set[str], where: str) -> list[str]:
    problems = []
    for key in keys:
        if key in known:
            continue
        near = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f": did you mean {near[0]!r}?" if near else ""
        problems.append(f"  {where}: {key!r} is not a Serve setting, and Serve ignores it{hint}")
    return problems


def serve_file_problems(document: object) -> list[str]:
    """What is wrong with the file's shape and keys as Serve reads them (empty: nothing)."""
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    if not isinstance(document, dict):
        return [
            f"  the file is a {type(document).__name__}, not a Serve config (a mapping with "
            "'applications:', as `serve build` writes)"
        ]
    problems = _unknown(document, _fields(ServeDeploySchema), "top level")
    applications = document.get("applications")
    if not isinstance(applications, list):
        return [*problems, "  applications: expected a list of applications"]
    app_fields, deployment_fields = _fields(ServeApplicationSchema), _fields(DeploymentSchema)
    for i, app in enumerate(applications):
        if not isinstance(app, dict):
            problems.append(
                f"  applications.{i}: {app!r} is not an application (a mapping with name, "
                "import_path, args, deployments)"
            )
            continue
        where = f"applications.{i} ({app.get('name', 'unnamed')})"
        problems += _unknown(app, app_fields, where)
        deployments = app.get("deployments", [])
        if not isinstance(deployments, list):
            problems.append(f"  {where}.deployments: expected a list of deployments")
            continue
        for j, deployment in enumerate(deployments):
            if not isinstance(deployment, dict):
                problems.append(f"  {where}.deployments.{j}: {deployment!r} is not a deployment")
                continue
            name = deployment.get("name", "unnamed")
            problems += _unknown(deployment, deployment_fields, f"{where}.deployments.{j} ({name})")
    return problems
