"""ScaleToZero on real NATS with a fake clock: the reference cases — the guards now proven by
seeding, advancing past the idle window and evaluating again — and the fixes."""

from __future__ import annotations

import asyncio

from zattera.v1 import types_pb2 as pb

from services.autoscale.scaletozero import ScaleToZero
from services.autoscale.settings import DEFAULTS
from shared.loop import LoopDeps
from shared.subjects import EVENTS_STREAM
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import (
    base_objects,
    deployment,
    node_beat,
    proxy_beat,
    running,
    scaled_env,
    traffic,
)
from tests.waiting import eventually

IDLE = 15 * 60.0


def s2z_env(**kw: object):
    defaults: dict[str, object] = {"scale_to_zero": True, "effective": 1, "idle_timeout": IDLE}
    defaults.update(kw)
    return scaled_env(**defaults)  # type: ignore[arg-type]


def beat(now: float, *, last_request_at: float | None = None, inflight: int = 0, held: int = 0):
    return node_beat(now, proxy={"env1": traffic(inflight=inflight, held=held, last_request_at=last_request_at)})


async def seed_then_idle(h: Harness, loop: ScaleToZero, idle_for: float, **beat_kw: object) -> None:
    """First sight (seeds a full window), then a report after ``idle_for`` seconds, evaluated again."""
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    await h.clock.advance(idle_for)
    await h.beat(beat(h.clock.now(), **beat_kw))  # type: ignore[arg-type]
    await loop.pass_once()


async def test_cools_after_the_idle_timeout(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    t0 = h.clock.now()
    await h.beat(beat(t0, last_request_at=t0))
    await loop.pass_once()
    assert h.env().effective_replicas == 1
    await h.clock.advance(16 * 60)
    await h.beat(beat(h.clock.now(), last_request_at=t0))
    await loop.pass_once()
    assert h.env().effective_replicas == 0
    info = await h.conn.js.stream_info(EVENTS_STREAM)
    assert info.state.messages == 1


async def test_recent_traffic_stays_warm(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60, last_request_at=h.clock.now() + 15 * 60)
    assert h.env().effective_replicas == 1


async def test_inflight_stays_warm(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60, last_request_at=h.clock.now() - 14 * 60, inflight=3)
    assert h.env().effective_replicas == 1


async def test_held_requests_stay_warm(h: Harness):
    # Fix: requests parked at a proxy waiting for a replica are activity; cooling would undo the wake.
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60, held=2)
    assert h.env().effective_replicas == 1


async def test_stateful_never_cools(h: Harness):
    await h.seed(*base_objects(s2z_env(stateful=True), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60)
    assert h.env().effective_replicas == 1


async def test_serverless_env_is_left_to_the_serverless_loop(h: Harness):
    await h.seed(*base_objects(s2z_env(max_concurrency=10), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60)
    assert h.env().effective_replicas == 1


async def test_without_idle_timeout_cools_after_the_default(h: Harness):
    # Fix: the reference never cooled such an env; it now uses the documented default.
    await h.seed(*base_objects(s2z_env(idle_timeout=None), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, DEFAULTS.scale_to_zero_idle_timeout - 1)
    assert h.env().effective_replicas == 1
    await h.clock.advance(2)
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    assert h.env().effective_replicas == 0


async def test_blackout_freezes(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await loop.pass_once()
    await h.clock.advance(30 * 60)
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_stale_proxy_reports_are_a_blackout(h: Harness):
    # Reference bug §5.4: a dead proxy's last report counted as data forever.
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    await h.clock.advance(30 * 60)
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_a_dead_proxys_last_inflight_no_longer_keeps_an_env_warm(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await h.beat(proxy_beat(h.clock.now(), "dead", {"env1": traffic(inflight=5)}))
    await h.beat(proxy_beat(h.clock.now(), "alive"))
    await loop.pass_once()
    for _ in range(16):
        await h.clock.advance(60)
        await h.beat(proxy_beat(h.clock.now(), "alive"))
        await loop.pass_once()
    assert h.env().effective_replicas == 0


async def test_a_worker_only_heartbeat_is_not_traffic_data(h: Harness):
    # Reference bug §7.3.4: a node heartbeat without proxy data let envs cool during an ingress blackout.
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await h.beat(node_beat(h.clock.now(), instances={"env1-a0": (5.0, 1)}))
    await loop.pass_once()
    await h.clock.advance(30 * 60)
    await h.beat(node_beat(h.clock.now(), instances={"env1-a0": (5.0, 1)}))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_already_zero_is_left_alone(h: Harness):
    await h.seed(*base_objects(s2z_env(effective=0)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60)
    assert h.env().effective_replicas == 0
    assert loop.writes == 0


async def test_a_deployment_forgets_activity_and_grants_a_full_window_after_it(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)), deployment("d1"))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 16 * 60)
    assert h.env().effective_replicas == 1
    done = deployment("d1", phase=7 + 1)  # SUCCEEDED
    await h.seed(done)
    await loop.pass_once()  # first sight after the deployment
    await h.clock.advance(14 * 60)
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    assert h.env().effective_replicas == 1
    await h.clock.advance(2 * 60)
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    assert h.env().effective_replicas == 0


async def test_new_term_grants_a_full_window(h: Harness):
    await h.seed(*base_objects(s2z_env(), running(1)))
    loop = await h.loop(ScaleToZero)
    await seed_then_idle(h, loop, 14 * 60)
    loop.on_term_start()
    await h.clock.advance(2 * 60)
    await h.beat(beat(h.clock.now()))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_loop_cools_on_its_tick_when_the_window_ends(h: Harness):
    await h.seed(*base_objects(s2z_env(idle_timeout=60.0), running(1)))
    loop = ScaleToZero(LoopDeps(h.conn, h.view, h.clock), live=h.live, tick=15.0)
    task = asyncio.create_task(loop.run(await h.leadership(loop.name)))
    try:
        await h.started(loop)
        await h.beat(proxy_beat(h.clock.now()))
        await h.tick(loop, 15)  # first sight with data: the 60 s window starts here
        for _ in range(3):
            await h.beat(proxy_beat(h.clock.now() + 15))
            await h.tick(loop, 15)
        assert h.env().effective_replicas == 1
        await h.beat(proxy_beat(h.clock.now() + 15))
        await h.tick(loop, 15)
        await eventually(lambda: h.env().effective_replicas == 0, what="cooled on the tick")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_promoted_deployment_keeping_blue_warm_does_not_hold_off_cooling(h: Harness):
    """After a deploy the env cools within idle timeout + one tick, drain window or not."""
    idle, tick = 60.0, 15.0
    draining = deployment("d1", phase=pb.DEPLOYMENT_PHASE_DRAINING_OLD)
    await h.seed(*base_objects(s2z_env(idle_timeout=idle), running(1)), draining)
    loop = ScaleToZero(LoopDeps(h.conn, h.view, h.clock), live=h.live, tick=tick)
    task = asyncio.create_task(loop.run(await h.leadership(loop.name)))
    try:
        await h.started(loop)
        await h.beat(proxy_beat(h.clock.now()))
        await h.tick(loop, tick)  # first sight with data: the idle window starts here
        window_start = h.clock.now()
        while h.env().effective_replicas and h.clock.now() < window_start + idle + tick:
            await h.beat(proxy_beat(h.clock.now() + tick))
            await h.tick(loop, tick)
        await eventually(lambda: h.env().effective_replicas == 0, what="cooled while the blue is kept warm")
        assert h.clock.now() <= window_start + idle + tick
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
