"""Autoscaler on real NATS with a fake clock: the reference cases, strengthened, and the fixes."""

from __future__ import annotations

import asyncio

from services.autoscale.autoscaler import COOLDOWN, SCALE_DOWN_HOLD, Autoscaler
from shared.loop import LoopDeps
from shared.subjects import EVENTS_STREAM
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import ENV, base_objects, running, scaled_env, usage_beat
from tests.waiting import eventually


async def test_scales_up_on_cpu_spike(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    assert h.env().effective_replicas == 4  # ceil(2 × 90 / 50)


async def test_clamps_to_max(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=3), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_scales_on_rps(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(rps=100, max_replicas=10), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=5, rps=500))
    await loop.pass_once()
    assert h.env().effective_replicas == 5


async def test_scales_down_only_after_sustained_low_and_the_hold(h: Harness):
    runs = running(4)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5, effective=4), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=10))
    await loop.pass_once()
    assert h.env().effective_replicas == 4  # the hold starts
    await h.clock.advance(120)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=10))
    await loop.pass_once()
    assert h.env().effective_replicas == 4
    await h.clock.advance(240)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=10))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_freezes_without_samples_even_past_every_window(h: Harness):
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5, effective=3), running(2)))
    loop = await h.loop(Autoscaler)
    await loop.pass_once()
    await h.clock.advance(SCALE_DOWN_HOLD + COOLDOWN + 1)
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_cooldown_blocks_a_second_scale_up_then_expires(h: Harness):
    # The reference's step 2 repeated an equal target; here the second reading really wants more.
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=10), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    assert h.env().effective_replicas == 4
    await h.clock.advance(60)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=150))  # ceil(2 × 150 / 50) = 6 > 4
    await loop.pass_once()
    assert h.env().effective_replicas == 4  # in cooldown
    await h.clock.advance(180)
    runs3 = running(3)
    await h.seed(runs3[2])
    await h.beat(usage_beat(h.clock.now(), runs3, cpu=100))
    await loop.pass_once()
    assert h.env().effective_replicas == 6


async def test_cooldown_also_gates_a_scale_down_past_the_hold(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=10), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    assert h.env().effective_replicas == 4
    loop.hold = 30.0  # a short hold, so only the 3-minute cooldown can be what blocks
    await h.beat(usage_beat(h.clock.now(), runs, cpu=5))
    await loop.pass_once()
    await h.clock.advance(60)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=5))
    await loop.pass_once()
    assert h.env().effective_replicas == 4
    await h.clock.advance(121)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=5))
    await loop.pass_once()
    assert h.env().effective_replicas == 1


async def test_without_targets_nothing_is_written(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(min_replicas=2, max_replicas=5), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))
    await loop.pass_once()
    await h.clock.advance(SCALE_DOWN_HOLD + 1)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))
    await loop.pass_once()
    assert h.env().effective_replicas == 0
    assert loop.writes == 0


async def test_a_dead_nodes_last_sample_stops_counting_after_30s(h: Harness):
    # Reference bug §5.4: the last sample of a node that stopped reporting counted forever.
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5, effective=3), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))  # would ask for 4
    await h.clock.advance(31)
    await loop.pass_once()
    assert h.env().effective_replicas == 3


async def test_new_term_clears_the_cooldown_and_restarts_the_hold(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=10), runs))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    assert h.env().effective_replicas == 4
    await h.clock.advance(10)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=150))
    loop.on_term_start()
    await loop.pass_once()
    assert h.env().effective_replicas == 6  # no cooldown carried into the new term


async def test_reacts_to_a_sample_as_it_arrives_and_scales_down_when_the_tick_passes_the_hold(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5), runs))
    loop = Autoscaler(LoopDeps(h.conn, h.view, h.clock), live=h.live, tick=15.0)
    task = asyncio.create_task(loop.run(await h.leadership(loop.name)))
    try:
        await h.started(loop)
        await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
        # No clock movement: the heartbeat itself triggers the evaluation.
        await eventually(lambda: h.env().effective_replicas == 4, what="scale up on the sample")
        # The first low sample is evaluated on arrival: the hold starts now; the ticks carry it on.
        await h.beat(usage_beat(h.clock.now() + 15, runs, cpu=10))
        await eventually(lambda: loop.timers.low_since.get(ENV) == h.clock.now(), what="hold started")
        await h.tick(loop, 15)
        for _ in range(int(SCALE_DOWN_HOLD) // 15 - 2):
            await h.beat(usage_beat(h.clock.now() + 15, runs, cpu=10))
            await h.tick(loop, 15)
        assert h.env().effective_replicas == 4  # 285 s into the 300 s hold
        await h.beat(usage_beat(h.clock.now() + 15, runs, cpu=10))
        await h.tick(loop, 15)
        await eventually(lambda: h.env().effective_replicas == 1, what="scale down after hold and cooldown")
        info = await h.conn.js.stream_info(EVENTS_STREAM)
        assert info.state.messages == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_skips_while_a_deployment_is_under_way(h: Harness):
    from tests.autoscale.helpers import deployment

    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5), runs), deployment("d1"))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    assert h.env(ENV).effective_replicas == 0
