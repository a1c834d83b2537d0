"""A pool's autoscaling policy, run as Serve's controller runs it: wrapped by Serve (cold start,
delays, bounds) and loaded from the bytes Serve pickles, in a process without Forge."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ray.serve.autoscaling_policy import (
    _apply_autoscaling_config,
    replica_queue_length_autoscaling_policy,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from serve_app.app import _replica_options
from serve_app.config.models import PoolConfig
from serve_app.replica.autoscaling import OPEN_FEEDS, POLICY, pool_autoscaling_policy

# configs/gke.yaml's chat pool, decisions taken at once.
CONFIG = {
    "min_replicas": 0,
    "max_replicas": 3,
    "target_ongoing_requests": 12,
    "upscale_delay_s": 0,
    "downscale_delay_s": 0,
}


def context(replicas: int, ongoing: float, feeds: dict[str, float] | None) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="pool-primary",
        app_name="forge",
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        running_replicas=[],
        total_num_requests=ongoing,
        total_queued_requests=0.0,
        aggregated_metrics={OPEN_FEEDS: feeds} if feeds is not None else {},
        raw_metrics={},
        capacity_adjusted_min_replicas=CONFIG["min_replicas"],
        capacity_adjusted_max_replicas=CONFIG["max_replicas"],
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=AutoscalingConfig(**CONFIG),
    )


def decide(policy, replicas: int, ongoing: float, feeds: dict[str, float] | None) -> int:
    return _apply_autoscaling_config(policy)(context(replicas, ongoing, feeds))[0]


def test_feeds_do_not_count_as_requests_where_serve_would_add_a_replica_for_them():
    # Two replicas serving 12 streams each, and 4 gateway replicas' feeds on each: Serve's own
    # policy sees 32 ongoing and starts a third replica (a spot T4) for the feeds.
    feeds = {"r1": 4.0, "r2": 4.0}
    assert decide(replica_queue_length_autoscaling_policy, 2, 32.0, feeds) == 3
    assert decide(pool_autoscaling_policy, 2, 32.0, feeds) == 2
    # Requests past the target still add one.
    assert decide(pool_autoscaling_policy, 2, 33.0, feeds) == 3


def test_without_feeds_it_decides_as_serves_own_policy():
    for replicas, ongoing in [(1, 0.0), (1, 5.0), (1, 13.0), (2, 30.0), (3, 40.0), (3, 2.0)]:
        for feeds in (None, {}, {"r1": 0.0}):
            assert decide(pool_autoscaling_policy, replicas, ongoing, feeds) == decide(
                replica_queue_length_autoscaling_policy, replicas, ongoing, feeds
            ), (replicas, ongoing, feeds)


def test_a_pool_at_zero_wakes_for_a_call_and_an_idle_one_goes_to_zero():
    assert decide(pool_autoscaling_policy, 0, 1.0, None) == 1  # the gateway's warm-up call
    assert decide(pool_autoscaling_policy, 1, 1.0, {"r1": 1.0}) == 0  # a feed alone: idle


def test_every_autoscaled_pool_gets_it_and_an_operators_own_policy_is_kept():
    def options(deployment: dict) -> dict:
        return _replica_options(
            PoolConfig.model_validate({"name": "p", "model": "m", "deployment": deployment})
        )

    scaled = options({"autoscaling_config": {"max_replicas": 3}})["autoscaling_config"]
    assert scaled == {"max_replicas": 3, "policy": {"policy_function": POLICY}}
    AutoscalingConfig(**scaled)  # as Serve takes it
    own = {"max_replicas": 3, "policy": {"policy_function": "team.scaling:policy"}}
    assert options({"autoscaling_config": own})["autoscaling_config"] == own
    assert "autoscaling_config" not in options({"num_replicas": 2})


def test_serves_controller_loads_it_without_forge_installed():
    # The bytes Serve sends its controller, loaded where importing serve_app fails (a cluster
    # whose head runs Ray's own image, Forge shipped in the applications' runtime_env).
    pickled = AutoscalingPolicy(policy_function=POLICY).get_serialized_policy_def()
    script = textwrap.dedent(
        f"""
        import sys
        from types import SimpleNamespace

        class NoForge:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "serve_app":
                    raise ImportError("no Forge here")

        sys.meta_path.insert(0, NoForge())
        from ray import cloudpickle

        policy = cloudpickle.loads({pickled!r})
        config = SimpleNamespace(get_target_ongoing_requests=lambda: 12)
        ctx = SimpleNamespace(
            current_num_replicas=2, target_num_replicas=2, total_num_requests=32.0,
            aggregated_metrics={{{OPEN_FEEDS!r}: {{"r1": 4.0, "r2": 4.0}}}}, config=config,
        )
        print(policy(ctx)[0])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2.0"
