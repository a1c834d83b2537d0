"""Prefix-aware routing through the real gateway: a prompt prefix finds its warm replica."""

from __future__ import annotations

import time

import pytest

from serve_app import replica_admin
from tests.e2e.conftest import APP

pytestmark = pytest.mark.e2e

# ~150 tokens: several full 16-token blocks shared by every request below.
SYSTEM = " ".join(f"rule {i}: answer briefly and cite the handbook section {i}." for i in range(15))


def _ask(client, model: str, question: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    return raw.headers["x-forge-replica"]


def _hits(deployment: str, replica: str) -> int:
    return replica_admin.stats(APP, deployment, replica)["prefix_cache_hits"]


@pytest.mark.parametrize("policy", ["prefix-affinity", "kv-aware"])
def test_a_shared_prefix_lands_on_the_replica_that_caches_it(openai_client, policy):
    deployment, model = f"pool-{policy}", f"forge-{policy}"
    first = _ask(openai_client, model, "what is rule 3?")
    time.sleep(0.6)  # replicas report their cache state every 0.2 s (kv_aware reads it)
    hits_before = _hits(deployment, first)
    followers = {_ask(openai_client, model, f"and rule {i}?") for i in range(4)}
    assert followers == {first}, "every request with the prefix went to the warm replica"
    assert _hits(deployment, first) - hits_before >= 4 * 16 * 4, "and hit its prefix cache"
