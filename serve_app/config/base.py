"""What every configuration model shares: strict (unknown fields refused, values frozen), and
the one pattern for names that become metric labels, Serve names and route keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
