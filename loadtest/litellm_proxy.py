"""LiteLLM's proxy as the benchmarks' point of comparison, in a virtualenv of its own.

LiteLLM is never a dependency of Forge: :func:`ensure_venv` makes a separate virtualenv
(``~/.cache/forge/litellm-venv`` unless ``FORGE_LITELLM_VENV`` or an argument says otherwise),
installs the pinned ``litellm[proxy]`` into it once, and reuses it after that.
:func:`write_config` writes a proxy config that routes one model, as an OpenAI-compatible
provider, to a local backend; :func:`proxy_argv` and :func:`proxy_env` start it with one worker,
no database, telemetry off and every start-up fetch from the internet turned off (LiteLLM
otherwise downloads its model cost map, and more, from GitHub when it starts).

    python -m loadtest.litellm_proxy [--venv DIR]   # install (or check) it, print its version
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from loadtest import tool_venv

# The newest release whose ``[proxy]`` extra resolves from PyPI here (1.108 and later pin
# ``litellm-proxy-extras`` releases that are not published).
LITELLM_VERSION = "1.106.12"
DEFAULT_VENV = Path(
    os.environ.get("FORGE_LITELLM_VENV", Path.home() / ".cache" / "forge" / "litellm-venv")
)

# Each LITELLM_LOCAL_* flag makes LiteLLM read its bundled copy instead of fetching it.
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
    "DISABLE_ADMIN_UI": "True",
    "DISABLE_SCHEMA_UPDATE": "True",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
# Never inherited: a database or cache URL would change what the proxy does per request.
_SCRUB = (
    "DATABASE_URL",
    "DIRECT_URL",
    "REDIS_URL",
    "REDIS_HOST",
    "REDIS_PORT",
    "STORE_MODEL_IN_DB",
)


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_version(venv: Path = DEFAULT_VENV) -> str | None:
    return tool_venv.installed_version(venv, "litellm")


def ensure_venv(venv: Path = DEFAULT_VENV, version: str = LITELLM_VERSION) -> Path:
    """The virtualenv with ``litellm[proxy]==version`` in it, made or fixed up if need be."""
    return tool_venv.ensure(venv, "litellm", version, [f"litellm[proxy]=={version}"])


def write_config(
    directory: Path, backend_port: int, model: str, master_key: str, backend_key: str = "sk-mock"
) -> Path:
    """One model, routed to ``http://127.0.0.1:<backend_port>/v1`` as ``openai/<model>``; a
    master key and no database (so auth is a key comparison and nothing is written per
    request); logging, telemetry and callbacks off."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "litellm-config.yaml"
    path.write_text(
        f"""model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: {backend_key}
litellm_settings:
  telemetry: false
  set_verbose: false
  json_logs: false
  turn_off_message_logging: true
  request_timeout: 600
general_settings:
  master_key: {master_key}
  disable_spend_logs: true
  disable_error_logs: true
  disable_reset_budget: true
  background_health_checks: false
"""
    )
    return path


def proxy_argv(venv: Path, config: Path, port: int) -> list[str]:
    """The command line (``python .../bin/litellm ...``: the process title says ``litellm``)."""
    venv = Path(venv).expanduser()
    return [
        str(_python(venv)),
        str(venv / "bin" / "litellm"),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
        "--telemetry",
        "False",
    ]


def proxy_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name in _SCRUB:
        env.pop(name, None)
    # The Forge venv's variables must not leak into LiteLLM's interpreter.
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.update(OFFLINE_ENV)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--version", default=LITELLM_VERSION)
    args = parser.parse_args()
    venv = ensure_venv(args.venv, args.version)
    print(f"{venv}: litellm {installed_version(venv)}")


if __name__ == "__main__":
    main()
