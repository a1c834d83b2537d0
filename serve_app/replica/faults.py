"""Failure injection for replicas, set at run time, per replica.

Works the same over any engine, because it acts where the replica hands frames on: chaos tests
of the gateway do not depend on which engine a pool runs.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.engines.base import EngineError


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["none", "crash", "error", "slow", "hang", "die_mid_stream"] = "none"
    # slow: every delay of the engine × factor.
    factor: Annotated[float, Field(ge=1)] = 10.0
    # die_mid_stream: frames delivered before the replica dies.
    after_frames: Annotated[int, Field(ge=1)] = 3
    # die_mid_stream: kill the whole replica process (spot preemption) rather than one stream.
    exit_process: bool = True


class InjectedFault(EngineError):
    """An error a test asked for; a 5xx like any engine failure."""


def crash_now() -> None:
    # os._exit: no cleanup, no graceful shutdown, exactly like a preempted node.
    os._exit(1)


class FaultInjector:
    def __init__(self) -> None:
        self.spec = FaultSpec()

    async def before_first_frame(self) -> None:
        mode = self.spec.mode
        if mode == "crash":
            crash_now()
        elif mode == "error":
            raise InjectedFault("injected failure: replica answers 500")
        elif mode == "hang":
            await asyncio.Event().wait()  # until the caller gives up and cancels

    def after_frame(self, frames_sent: int) -> None:
        spec = self.spec
        if spec.mode == "die_mid_stream" and frames_sent >= spec.after_frames:
            if spec.exit_process:
                crash_now()
            raise InjectedFault("injected failure: stream died mid-way")
