"""Pure decision tables: no NATS, an offline view and live view fed directly."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from services.autoscale import activator, autoscaler, scaletozero, serverless
from services.autoscale.common import Reading
from services.autoscale.settings import DEFAULTS as AUTOSCALE
from shared.clock import FakeClock
from shared.deployments import desired_replicas as current_replicas
from tests.autoscale.helpers import (
    MIB,
    base_objects,
    deployment,
    node_beat,
    offline_live,
    running,
    scaled_env,
    traffic,
    usage_beat,
)
from tests.memory_state import MemoryState

NOW = FakeClock().now()


def obs(replicas: int, cpu: float = 0.0, mem: float | None = None, rps: float = 0.0) -> autoscaler.Observation:
    return autoscaler.Observation(replicas=replicas, avg_cpu=cpu, avg_mem=mem, total_rps=rps)


@pytest.mark.parametrize(
    ("targets", "observation", "lo", "hi", "band", "expected"),
    [
        pytest.param((50, 0, 0), obs(2, cpu=90), 1, 5, 1.0, 4, id="cpu_ceil_of_3_6"),
        pytest.param((50, 0, 0), obs(2, cpu=100), 1, 3, 1.0, 3, id="clamped_to_max"),
        pytest.param((50, 0, 0), obs(4, cpu=10), 1, 5, 1.0, 1, id="low_cpu_to_min"),
        pytest.param((50, 0, 0), obs(4, cpu=10), 2, 5, 1.0, 2, id="never_below_min"),
        pytest.param((50, 0, 0), obs(4, cpu=45), 1, 5, 0.8, 5, id="down_band_asks_more"),
        pytest.param((0, 0, 100), obs(2, rps=500), 1, 10, 1.0, 5, id="rps_total_over_target"),
        pytest.param((0, 50, 0), obs(2, mem=80.0), 1, 10, 1.0, 4, id="memory_against_limit"),
        pytest.param((0, 50, 0), obs(2, mem=None), 1, 10, 1.0, 1, id="memory_without_limit_is_skipped"),
        pytest.param((50, 0, 100), obs(2, cpu=10, rps=700), 1, 10, 1.0, 7, id="max_of_the_signals"),
    ],
)
def test_scale_target(targets, observation, lo, hi, band, expected):
    spec = pb.Autoscale(
        target_cpu_percent=targets[0], target_memory_percent=targets[1], target_rps_per_replica=targets[2]
    )
    assert autoscaler.scale_target(spec, observation, lo, hi, band) == expected


def autoscale_decision(env: pb.Environment, *extra: Message, cpu: float | None = 90.0, stale: bool = False):
    runs = running(2)
    view = MemoryState(*base_objects(env, runs), *extra).store
    clock = FakeClock()
    beats = [] if cpu is None else [usage_beat(clock.now() - (31 if stale else 0), runs, cpu=cpu)]
    live = offline_live(clock, *beats)
    timers = autoscaler.Timers(low_since={env.meta.id: NOW - 10})
    return autoscaler.evaluate(Reading(view, live, env, 1, clock.now()), timers)


@pytest.mark.parametrize(
    ("env", "extra", "kw", "reason"),
    [
        pytest.param(scaled_env(max_replicas=5), (), {}, "no autoscale target", id="no_targets"),
        pytest.param(scaled_env(cpu=50, active_release_id=""), (), {}, "no autoscale target", id="no_release"),
        pytest.param(scaled_env(cpu=50, max_concurrency=5), (), {}, "serverless", id="serverless_env"),
        pytest.param(scaled_env(cpu=50), (deployment("d1"),), {}, "deployment", id="deploying"),
        pytest.param(scaled_env(cpu=50, min_replicas=0, max_replicas=1), (), {}, "no room", id="min0_max1_no_room"),
        pytest.param(scaled_env(cpu=50), (), {"cpu": None}, "frozen", id="no_samples"),
        pytest.param(scaled_env(cpu=50), (), {"stale": True}, "frozen", id="stale_samples"),
    ],
)
def test_autoscaler_skips_keep_the_hold_timer(env, extra, kw, reason):
    decision = autoscale_decision(env, *extra, **kw)
    assert decision.write is None
    assert reason in decision.reason
    assert decision.low_since == NOW - 10


def test_autoscaler_scales_while_a_promoted_deployment_keeps_its_blue_warm():
    draining = deployment("d1", phase=pb.DEPLOYMENT_PHASE_DRAINING_OLD)
    decision = autoscale_decision(scaled_env(cpu=50, max_replicas=10), draining)
    assert decision.write is not None and decision.write.target == 4


def test_autoscaler_does_not_skip_stateful_or_scale_to_zero_envs():
    decision = autoscale_decision(scaled_env(cpu=50, stateful=True, scale_to_zero=True, effective=2))
    assert decision.write is not None and decision.write.target == 4


def test_autoscaler_memory_percent_is_relative_to_the_envs_limit():
    env = scaled_env(memory=50, memory_mb=100, max_replicas=10)
    runs = running(2)
    clock = FakeClock()
    live = offline_live(clock, usage_beat(clock.now(), runs, cpu=0, mem=80 * MIB))
    decision = autoscaler.evaluate(
        Reading(MemoryState(*base_objects(env, runs)).store, live, env, 1, clock.now()), autoscaler.Timers()
    )
    assert decision.write is not None and decision.write.target == 4  # ceil(2 × 80 / 50)


def test_autoscaler_ignores_jobs_stopped_and_unknown_instances():
    env = scaled_env(cpu=50, max_replicas=10)
    runs = running(2)
    job = running(1)[0]
    job.meta.id, job.job_id = "job-1", "j1"
    stopped = running(1)[0]
    stopped.meta.id, stopped.desired = "stopped-1", pb.ASSIGNMENT_DESIRED_STOP
    clock = FakeClock()
    beat = node_beat(
        clock.now(),
        instances={a.meta.id: (100.0, 1) for a in runs}
        | {"job-1": (500.0, 1), "stopped-1": (500.0, 1), "x": (500.0, 1)},
    )
    view = MemoryState(*base_objects(env, [*runs, job, stopped])).store
    decision = autoscaler.evaluate(Reading(view, offline_live(clock, beat), env, 1, clock.now()), autoscaler.Timers())
    assert decision.write is not None and decision.write.target == 4


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(scaled_env(active_release_id=""), 0, id="no_release_runs_nothing"),
        pytest.param(scaled_env(scale_to_zero=True, effective=0, min_replicas=2), 0, id="s2z_zero_is_cold"),
        pytest.param(scaled_env(effective=0, min_replicas=2), 2, id="zero_follows_min"),
        pytest.param(scaled_env(effective=3, min_replicas=2), 3, id="effective_wins"),
    ],
)
def test_current_replicas(env, expected):
    assert current_replicas(env) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        pytest.param(None, AUTOSCALE.scale_to_zero_idle_timeout, id="unset_uses_default"),
        pytest.param(0.0, AUTOSCALE.scale_to_zero_idle_timeout, id="zero_uses_default"),
        pytest.param(90.0, 90.0, id="explicit"),
    ],
)
def test_idle_timeout(seconds, expected):
    assert scaletozero.idle_timeout(scaled_env(scale_to_zero=True, idle_timeout=seconds)) == expected


@pytest.mark.parametrize(
    ("s2z", "lo", "hi", "bounds"),
    [
        pytest.param(False, 2, 5, (2, 5), id="min_is_floor"),
        pytest.param(False, 0, 5, (1, 5), id="floor_at_least_one"),
        pytest.param(True, 2, 5, (0, 5), id="s2z_floor_zero"),
        pytest.param(True, 0, 0, (0, 1), id="s2z_ceiling_at_least_wake_target"),
        pytest.param(False, 3, 1, (3, 3), id="max_below_floor_lifted"),
    ],
)
def test_serverless_bounds(s2z, lo, hi, bounds):
    env = scaled_env(scale_to_zero=s2z, min_replicas=lo, max_replicas=hi, max_concurrency=10)
    assert serverless.replica_bounds(env) == bounds


@pytest.mark.parametrize(
    ("inflight", "held", "expected"),
    [
        pytest.param(0, 0, 0, id="idle"),
        pytest.param(10, 0, 1, id="exactly_one_cap"),
        pytest.param(10, 1, 2, id="held_counts_as_demand"),
        pytest.param(0, 3, 1, id="held_alone_wakes"),
        pytest.param(100, 100, 5, id="ceiling"),
    ],
)
def test_serverless_desired_counts_held_requests(inflight, held, expected):
    env = scaled_env(scale_to_zero=True, min_replicas=0, max_replicas=5, max_concurrency=10)
    clock = FakeClock()
    live = offline_live(clock, node_beat(clock.now(), proxy={env.meta.id: traffic(inflight=inflight, held=held)}))
    view = MemoryState(*base_objects(env)).store
    decision = serverless.evaluate(Reading(view, live, env, 1, clock.now()), None)
    target = decision.write.target if decision.write else current_replicas(env)
    assert target == expected


@pytest.mark.parametrize(
    ("env", "accepted", "target"),
    [
        pytest.param(scaled_env(min_replicas=1), False, None, id="not_s2z_rejected"),
        pytest.param(scaled_env(scale_to_zero=True, min_replicas=2), True, 2, id="cold_wakes_to_min"),
        pytest.param(scaled_env(scale_to_zero=True, min_replicas=0), True, 1, id="min0_wakes_to_one"),
        pytest.param(scaled_env(scale_to_zero=True, min_replicas=2, effective=3), True, None, id="warm_is_idempotent"),
        pytest.param(scaled_env(scale_to_zero=True, min_replicas=2, effective=1), True, 2, id="below_target_raised"),
    ],
)
def test_activation_decision(env, accepted, target):
    decision = activator.evaluate(env, 7)
    assert decision.accepted is accepted
    assert (decision.write.target if decision.write else None) == target
