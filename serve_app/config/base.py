"""What every configuration model shares: strict (unknown fields refused, values frozen), and
the one pattern for names that become metric labels, Serve names and route keys."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def _variable_name(value: str) -> str:
    """A ``*_env`` field holds the name of an environment variable, never what it holds (a URL
    or a key, which would then sit in the config, and in any message that echoed it)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        what = "a URL" if "://" in value else "not a variable name"
        raise ValueError(
            f"expected the name of an environment variable (e.g. FORGE_REDIS_URL), and this is "
            f"{what}: export the value in a variable and name the variable here"
        )
    return value


EnvName = Annotated[str, AfterValidator(_variable_name)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
