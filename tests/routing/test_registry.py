"""The policy registry: every policy built under its name, bad names and arguments named."""

from __future__ import annotations

import pytest

from serve_app.routing import POLICY_NAMES, build_policy
from serve_app.routing.prefix_affinity import PrefixAffinityPolicy


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_registry_builds_every_policy_under_its_name(name: str) -> None:
    assert build_policy(name).name == name


def test_registry_passes_arguments() -> None:
    policy = build_policy("prefix_affinity", prefix_blocks=2, load_factor=1.5)
    assert isinstance(policy, PrefixAffinityPolicy)
    assert (policy.prefix_blocks, policy.load_factor) == (2, 1.5)


def test_registry_rejects_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown routing policy 'fastest'.*round_robin.*kv_aware"
    ):
        build_policy("fastest")


def test_registry_rejects_unknown_arguments_naming_the_policy() -> None:
    with pytest.raises(ValueError, match=r"routing policy 'round_robin'.*vnodes"):
        build_policy("round_robin", vnodes=3)


def test_registry_surfaces_bad_values() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        build_policy("kv_aware", load_factor=0.5)
