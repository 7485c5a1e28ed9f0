"""Every effective_replicas write is fenced on the env's revision: an edit landing between a loop's
decision and its commit is never clobbered; the loop re-reads and re-decides. The reference did a blind
read-modify-write and recorded cooldown and events even for writes that did not land."""

from __future__ import annotations

from services.autoscale.autoscaler import Autoscaler
from services.autoscale.scaletozero import ScaleToZero
from services.autoscale.serverless import Serverless
from shared.subjects import EVENTS_STREAM
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import ENV, base_objects, node_beat, running, scaled_env, traffic, usage_beat


async def test_autoscaler_keeps_an_operators_new_max_and_scales_within_it(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=10), runs))
    edited = scaled_env(cpu=50, max_replicas=3)
    loop = await h.loop(Autoscaler, before_commit=lambda: h.edit_env(edited))
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))  # asks for 4 under the old max
    await loop.pass_once()
    env = h.env()
    assert env.service.replicas.max == 3
    assert env.effective_replicas == 3
    assert loop.conflicts == 1 and loop.writes == 1


async def test_a_write_that_did_not_land_starts_no_cooldown_and_emits_no_event(h: Harness):
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=10), runs))
    # The operator switches autoscaling off between the decision and the commit.
    edited = scaled_env(max_replicas=10, effective=2)
    loop = await h.loop(Autoscaler, before_commit=lambda: h.edit_env(edited))
    await h.beat(usage_beat(h.clock.now(), runs, cpu=100))
    await loop.pass_once()
    assert h.env().effective_replicas == 2
    assert loop.timers.last_change == {}
    assert (await h.conn.js.stream_info(EVENTS_STREAM)).state.messages == 0


async def test_scaletozero_does_not_cool_an_env_the_operator_just_edited(h: Harness):
    env = scaled_env(scale_to_zero=True, effective=1, idle_timeout=60.0)
    await h.seed(*base_objects(env, running(1)))
    beat = node_beat(h.clock.now(), proxy={ENV: traffic()})
    await h.beat(beat)
    edited = scaled_env(scale_to_zero=True, effective=1, idle_timeout=3600.0)
    loop = await h.loop(ScaleToZero, before_commit=lambda: h.edit_env(edited))
    await loop.pass_once()  # first sight
    await h.clock.advance(61)
    await h.beat(node_beat(h.clock.now(), proxy={ENV: traffic()}))
    await loop.pass_once()
    assert h.env().effective_replicas == 1  # re-decided against the new one-hour window
    assert loop.conflicts == 1 and loop.writes == 0


async def test_serverless_scale_up_is_redecided_after_a_concurrent_wake(h: Harness):
    await h.seed(*base_objects(scaled_env(max_concurrency=10, min_replicas=0, max_replicas=5, scale_to_zero=True)))
    woken = scaled_env(max_concurrency=10, min_replicas=0, max_replicas=5, scale_to_zero=True, effective=4)
    loop = await h.loop(Serverless, before_commit=lambda: h.edit_env(woken))
    await h.beat(node_beat(h.clock.now(), proxy={ENV: traffic(inflight=15)}))  # asks for 2
    await loop.pass_once()
    assert h.env().effective_replicas == 4  # not lowered to 2 by a blind write; the window applies
    assert loop.conflicts == 1
