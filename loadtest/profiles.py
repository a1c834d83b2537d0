"""Named multi-tenant traffic profiles (``loadtest/profiles.yaml``) and a CLI that runs one.

    python -m loadtest.profiles --base-url http://127.0.0.1:8000 --profile steady \\
        --duration 60 --out loadtest/results/steady.jsonl [--plot docs/img/steady.png]

Profiles are data so the demo, the eval gate and a person at a terminal send the same traffic;
pydantic validates them so a typo names its field instead of silently sending nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadtest.traffic import Result, Stream, run, summarize, write_jsonl

PROFILES_PATH = Path(__file__).with_name("profiles.yaml")


class StreamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1)]
    key: str | None = None  # literal key (the local demo keys)
    key_env: str | None = None  # a variable that, when set, wins over `key`
    rate: Annotated[float, Field(ge=0)]
    prompt_tokens: Annotated[int, Field(ge=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    model: str | None = None
    stream: bool = True
    start_s: Annotated[float, Field(ge=0)] = 0.0
    end_s: Annotated[float, Field(gt=0)] | None = None
    max_in_flight: Annotated[int, Field(ge=1)] = 256
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _key_and_window(self) -> StreamSpec:
        if self.key is None and self.key_env is None:
            raise ValueError(f"stream {self.name!r}: give `key` or `key_env`")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"stream {self.name!r}: end_s must be after start_s")
        return self

    def resolve_key(self, environ: dict[str, str] | os._Environ = os.environ) -> str:
        if self.key_env and environ.get(self.key_env):
            return environ[self.key_env]
        if self.key is None:
            raise ValueError(f"stream {self.name!r}: ${self.key_env} is not set and no `key`")
        return self.key

    def to_stream(self, environ: dict[str, str] | os._Environ = os.environ) -> Stream:
        fields = self.model_dump(exclude={"key", "key_env"})
        return Stream(key=self.resolve_key(environ), **fields)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    duration_s: Annotated[float, Field(gt=0)] = 60.0
    streams: Annotated[list[StreamSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique_names(self) -> Profile:
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must be unique: {names}")
        return self

    def to_streams(self, environ: dict[str, str] | os._Environ = os.environ) -> list[Stream]:
        return [s.to_stream(environ) for s in self.streams]


class ProfileFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profiles: dict[str, Profile]


def load_profiles(path: Path = PROFILES_PATH) -> dict[str, Profile]:
    return ProfileFile.model_validate(yaml.safe_load(Path(path).read_text())).profiles


def load_profile(name: str, path: Path = PROFILES_PATH) -> Profile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise KeyError(f"no profile {name!r} in {path}; profiles: {sorted(profiles)}")
    return profiles[name]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def table(results: list[Result], streams: list[str]) -> str:
    """A Markdown table, one row per stream and one for all of them."""
    lines = [
        "| stream | requests | ok | 429 | 5xx | other errors | truncated | dropped | by backend "
        "| TTFT p50/p95 ms | total p50/p95 ms | req/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name in [*streams, None]:
        s = summarize(results, name)
        status = s["by_status"]
        n429 = status.get(429, 0)
        n5xx = sum(n for code, n in status.items() if code >= 500)
        backends = ", ".join(f"{k} {v}" for k, v in sorted(s["by_backend"].items()))
        lines.append(
            f"| {name or 'all'} | {s['requests']:,} | {s['ok']:,} | {n429:,} | {n5xx:,} | "
            f"{s['errors'] - n429 - n5xx:,} | {s['truncated']:,} | {s['dropped']:,} | "
            f"{backends} | {_ms(s['ttft_p50_s'])}/{_ms(s['ttft_p95_s'])} | "
            f"{_ms(s['total_p50_s'])}/{_ms(s['total_p95_s'])} | {s['req_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--profile", default="steady")
    parser.add_argument("--profiles-file", type=Path, default=PROFILES_PATH)
    parser.add_argument("--duration", type=float, help="seconds (default: the profile's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--out", type=Path, help="JSON lines, one per request")
    parser.add_argument("--plot", type=Path, help="a timelapse PNG")
    parser.add_argument("--list", action="store_true", help="list the profiles and exit")
    args = parser.parse_args(argv)

    profiles = load_profiles(args.profiles_file)
    if args.list:
        for name, p in profiles.items():
            print(f"{name:10} {p.duration_s:5.0f}s  {p.description}")
        return 0
    if args.profile not in profiles:
        parser.error(f"no profile {args.profile!r}; profiles: {', '.join(sorted(profiles))}")
    profile = profiles[args.profile]
    streams = profile.to_streams()
    duration = args.duration or profile.duration_s
    results = asyncio.run(
        run(
            args.base_url,
            streams,
            duration,
            seed=args.seed,
            timeout_s=args.timeout,
            progress=sys.stderr.isatty(),
        )
    )
    print(table(results, [s.name for s in streams]))
    if args.out:
        write_jsonl(results, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        from loadtest import timelapse

        timelapse.render(results, args.plot, title=f"profile {args.profile}, {duration:g} s")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
