"""A pool's autoscaling policy: Serve's own, on the requests a pool serves, not on its feeds.

Why: Serve counts every handle call in flight as an ongoing request, and a gateway replica's
feed (``replica/feed.py``) is one on each pool replica it streams from, serving none. So a busy
replica showed one request more per gateway replica than it served: with ``configs/gke.yaml``'s
2 gateways, 2 more against a target of 12; with 4 gateways and 3 replicas, 12 more, a whole
replica's target, and one more spot T4 ran whenever the pool was busy. Each replica reports its
open feeds (``Replica.record_autoscaling_stats``) and this policy takes them off Serve's count
before it divides by the target, as Serve's ``replica_queue_length_autoscaling_policy`` does.
Serve's wrapper around every policy applies the rest as before: the cold start, the scaling
factors, the delays and the bounds.

Serve pickles this module by value into its controller (``AutoscalingPolicy.serialize_policy``),
which has Ray but not always Forge: it imports nothing of Forge's.
"""

from __future__ import annotations

from typing import Any

# The metric a pool replica reports its open feeds under.
OPEN_FEEDS = "forge_open_feeds"
POLICY = "serve_app.replica.autoscaling:pool_autoscaling_policy"


def pool_autoscaling_policy(ctx: Any) -> tuple[float, dict]:
    """The replicas a pool wants: its ongoing requests, less its feeds, over the target."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}  # the cold start is Serve's (its wrapper)
    feeds = sum(((ctx.aggregated_metrics or {}).get(OPEN_FEEDS) or {}).values())
    requests = max(0.0, ctx.total_num_requests - feeds)
    return requests / ctx.config.get_target_ongoing_requests(), {}


def with_pool_policy(autoscaling_config: dict) -> dict:
    """``autoscaling_config`` with Forge's policy unless it names one of its own."""
    if "policy" in autoscaling_config:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": POLICY}}
