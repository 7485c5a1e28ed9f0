"""Serverless on real NATS with a fake clock: the reference table and the fixes (held requests as
demand, the scale-down window, the ceiling never below the wake target)."""

from __future__ import annotations

import asyncio

import pytest

from services.autoscale.serverless import Serverless
from services.autoscale.settings import DEFAULTS
from shared.loop import LoopDeps
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import base_objects, deployment, node_beat, proxy_beat, scaled_env, traffic
from tests.waiting import eventually


def serverless_env(cap: int, lo: int, hi: int, s2z: bool = False, effective: int | None = None):
    return scaled_env(
        max_concurrency=cap,
        min_replicas=lo,
        max_replicas=hi,
        scale_to_zero=s2z,
        effective=lo if effective is None else effective,
    )


def demand(now: float, inflight: int = 0, held: int = 0):
    return node_beat(now, proxy={"env1": traffic(inflight=inflight, held=held)})


@pytest.mark.parametrize(
    ("cap", "lo", "hi", "s2z", "inflight", "expected"),
    [
        pytest.param(10, 1, 5, False, 0, 1, id="idle_holds_min"),
        pytest.param(10, 0, 5, True, 0, 0, id="idle_scales_to_zero"),
        pytest.param(10, 1, 5, False, 10, 1, id="one_replica_per_cap"),
        pytest.param(10, 1, 5, False, 11, 2, id="rounds_up"),
        pytest.param(10, 1, 5, False, 35, 4, id="scales_with_load"),
        pytest.param(10, 1, 5, False, 200, 5, id="clamped_at_max"),
        pytest.param(1, 0, 8, True, 6, 6, id="cap_one_tracks_inflight"),
    ],
)
async def test_serverless_table(h: Harness, cap, lo, hi, s2z, inflight, expected):
    await h.seed(*base_objects(serverless_env(cap, lo, hi, s2z)))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), inflight))
    await loop.pass_once()
    assert h.env().effective_replicas == expected
    assert loop.writes == (1 if expected != lo else 0)


async def test_freezes_without_data(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 5, effective=3)))
    loop = await h.loop(Serverless)
    await loop.pass_once()
    await h.clock.advance(DEFAULTS.serverless_scale_down_window + 1)
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_skips_during_a_deployment(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 5, effective=2)), deployment("d1"))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), 100))
    await loop.pass_once()
    assert h.env().effective_replicas == 2


async def test_held_requests_drive_scale_up(h: Harness):
    # Reference bug §7.3.1(b): the proxy caps in-flight at replicas × cap, so queued load never scaled.
    await h.seed(*base_objects(serverless_env(10, 1, 5, effective=2)))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), inflight=20, held=15))
    await loop.pass_once()
    assert h.env().effective_replicas == 4


async def test_a_wake_is_not_undone_while_requests_wait(h: Harness):
    # Reference bug §7.3.1(a): the activator's wake was reverted on the next tick (in-flight 0).
    await h.seed(*base_objects(serverless_env(10, 0, 5, s2z=True, effective=1)))
    loop = await h.loop(Serverless)
    for _ in range(4):
        await h.beat(demand(h.clock.now(), held=3))
        await loop.pass_once()
        await h.clock.advance(DEFAULTS.serverless_scale_down_window)
    assert h.env().effective_replicas == 1


async def test_s2z_env_without_max_can_still_wake(h: Harness):
    # Footgun §7.2.11: min 0 and no max pinned the env at 0, undoing every wake.
    await h.seed(*base_objects(serverless_env(10, 0, 0, s2z=True, effective=0)))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), held=1))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_scales_down_only_after_the_window_to_the_highest_demand_in_it(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 10, effective=5)))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), inflight=10))  # wants 1
    await loop.pass_once()
    await h.clock.advance(DEFAULTS.serverless_scale_down_window / 2)
    await h.beat(demand(h.clock.now(), inflight=30))  # wants 3, still below 5
    await loop.pass_once()
    await h.clock.advance(DEFAULTS.serverless_scale_down_window / 2 - 1)
    await h.beat(demand(h.clock.now(), inflight=0))
    await loop.pass_once()
    assert h.env().effective_replicas == 5  # the window is not over
    await h.clock.advance(1)
    await h.beat(demand(h.clock.now(), inflight=0))
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_demand_back_at_the_current_count_restarts_the_window(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 10, effective=3)))
    loop = await h.loop(Serverless)
    await h.beat(demand(h.clock.now(), inflight=0))
    await loop.pass_once()
    await h.clock.advance(DEFAULTS.serverless_scale_down_window - 1)
    await h.beat(demand(h.clock.now(), inflight=30))
    await loop.pass_once()
    await h.clock.advance(2)
    await h.beat(demand(h.clock.now(), inflight=0))
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_stale_inflight_of_a_dead_proxy_does_not_pin_the_env_up(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 5, effective=5)))
    loop = await h.loop(Serverless, scale_down_window=10.0)
    await h.beat(proxy_beat(h.clock.now(), "dead", {"env1": traffic(inflight=50)}))
    await h.clock.advance(31)
    await h.beat(proxy_beat(h.clock.now(), "alive"))
    await loop.pass_once()
    await h.clock.advance(10)
    await h.beat(proxy_beat(h.clock.now(), "alive"))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_loop_scales_up_as_soon_as_a_proxy_reports_load(h: Harness):
    await h.seed(*base_objects(serverless_env(10, 1, 5)))
    loop = Serverless(LoopDeps(h.conn, h.view, h.clock), live=h.live)
    task = asyncio.create_task(loop.run(await h.leadership(loop.name)))
    try:
        await h.started(loop)
        await h.beat(proxy_beat(h.clock.now(), envs={"env1": traffic(inflight=41)}))
        await eventually(lambda: h.env().effective_replicas == 5, what="scale up on the report")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
