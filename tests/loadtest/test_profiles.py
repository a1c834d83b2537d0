"""Traffic profiles are data: every shipped one parses, and mistakes name their field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loadtest import profiles
from loadtest.traffic import Result

ALPHA = "sk-demo-alpha-local-only"
BETA = "sk-demo-beta-local-only"


def test_the_shipped_profiles_parse_with_the_local_demo_keys():
    loaded = profiles.load_profiles()
    assert {"steady", "burst", "flood", "mixed"} <= set(loaded)
    for name, profile in loaded.items():
        streams = profile.to_streams({})
        assert streams, name
        assert {s.key for s in streams} <= {ALPHA, BETA}, name


def test_steady_fits_the_local_budgets():
    streams = {s.name: s for s in profiles.load_profile("steady").to_streams({})}
    total = sum(s.rate for s in streams.values())
    assert 8 <= total <= 12
    beta = streams["beta"]
    assert beta.key == BETA
    assert beta.rate * 60 < 30  # rpm
    assert beta.rate * 60 * (beta.prompt_tokens + beta.max_tokens + 6) < 6000  # tpm


def test_flood_floods_far_past_the_flooders_budget_and_mixed_has_long_prompts():
    flood = {s.name: s for s in profiles.load_profile("flood").to_streams({})}
    assert flood["flood"].rate * 60 > 10 * 30 and flood["victim"].rate <= 5
    mixed = {s.name: s for s in profiles.load_profile("mixed").to_streams({})}
    assert mixed["batch"].prompt_tokens == 1024
    assert (mixed["interactive"].prompt_tokens, mixed["interactive"].max_tokens) == (128, 64)


def test_a_key_variable_wins_over_the_literal():
    profile = profiles.load_profile("steady")
    streams = profile.to_streams({"FORGE_ALPHA_KEY": "sk-real"})
    assert {s.name: s.key for s in streams} == {"alpha": "sk-real", "beta": BETA}


def test_unset_variable_without_literal_is_an_error_naming_it():
    spec = profiles.StreamSpec(name="x", key_env="NOPE_KEY", rate=1, prompt_tokens=1, max_tokens=1)
    with pytest.raises(ValueError, match="NOPE_KEY"):
        spec.to_stream({})


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ({"rate": 1, "prompt_tokens": 8, "max_tokens": 8}, "key"),
        ({"key": "k", "rate": 1, "prompt_tokens": 8, "max_tokens": 8, "rpm": 1}, "rpm"),
        ({"key": "k", "rate": -1, "prompt_tokens": 8, "max_tokens": 8}, "rate"),
        (
            {"key": "k", "rate": 1, "prompt_tokens": 8, "max_tokens": 8, "start_s": 5, "end_s": 2},
            "end_s",
        ),
    ],
)
def test_bad_profiles_name_the_field(tmp_path, stream, message):
    path = tmp_path / "p.yaml"
    path.write_text(
        "profiles:\n  p:\n    streams:\n      - name: s\n"
        + "".join(f"        {k}: {v}\n" for k, v in stream.items())
    )
    with pytest.raises(ValidationError, match=message):
        profiles.load_profiles(path)


def test_windows_and_headers_reach_the_stream():
    burst = {s.name: s for s in profiles.load_profile("burst").to_streams({})}
    assert (burst["alpha-burst"].start_s, burst["alpha-burst"].end_s) == (20, 35)
    mixed = {s.name: s for s in profiles.load_profile("mixed").to_streams({})}
    assert mixed["batch"].headers == {"cache-control": "no-cache"}


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(KeyError, match="steady"):
        profiles.load_profile("nope")


def test_table_has_a_row_per_stream_and_a_total():
    def r(stream, status, error=None):
        return Result(stream, 0.0, status, "primary", None, None, 0.1, 0.5, 1, 2, False, error)

    results = [r("a", 200), r("a", 429, "http_429"), r("b", 503, "http_503"), r("b", 200)]
    lines = profiles.table(results, ["a", "b"]).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["a", "b", "all"]
    total = [c.strip() for c in lines[-1].split("|")]
    assert total[2:7] == ["4", "2", "1", "1", "0"]


def test_list_prints_the_profiles(capsys):
    assert profiles.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("steady", "burst", "flood", "mixed"))
