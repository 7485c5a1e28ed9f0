"""Scale events on real NATS with a fake clock: who decided and from → to, for the autoscaler, the
serverless loop, a cool to zero and a wake; each stored once per landed write, none for a refused one."""

from __future__ import annotations

from services.autoscale.activator import Activator
from services.autoscale.autoscaler import Autoscaler
from services.autoscale.scaletozero import ScaleToZero
from services.autoscale.serverless import Serverless
from services.autoscale.settings import DEFAULTS
from shared import keys as K
from shared.events import EventPublisher
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import base_objects, node_beat, running, scaled_env, traffic, usage_beat
from tests.eventlog import one, stored_events, stored_kinds


async def test_an_autoscale_names_the_autoscaler_and_from_to(h: Harness) -> None:
    runs = running(2)
    await h.seed(*base_objects(scaled_env(cpu=50, max_replicas=5, effective=2), runs))
    revision = h.view.rev(K.env("env1"))
    loop = await h.loop(Autoscaler)
    await h.beat(usage_beat(h.clock.now(), runs, cpu=90))
    await loop.pass_once()
    scaled = one(await stored_events(h.conn), "autoscale.scaled")
    assert dict(scaled.fields) == {"actor": "system:autoscaler", "from": "2", "to": "4"}
    assert scaled.environment_id == "env1" and scaled.project_id == "p1" and scaled.app_id == "a1"
    assert scaled.transition == f"env.env1@{revision}:autoscale.scaled"
    assert scaled.meta.created_at.ToNanoseconds() == int(h.clock.now() * 1e9)
    # Published again (a retry after a lost ack): stored once.
    await EventPublisher(h.conn).publish(scaled)
    assert await stored_kinds(h.conn) == ["autoscale.scaled"]


async def test_serverless_scales_up_then_cools_to_zero(h: Harness) -> None:
    env = scaled_env(max_concurrency=10, min_replicas=0, max_replicas=5, scale_to_zero=True, effective=1)
    await h.seed(*base_objects(env))
    loop = await h.loop(Serverless)
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic(inflight=25)}))
    await loop.pass_once()
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic()}))
    await loop.pass_once()  # the scale-down window starts
    await h.clock.advance(DEFAULTS.serverless_scale_down_window + 1)
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic()}))
    await loop.pass_once()
    events = await stored_events(h.conn)
    assert [(e.kind, e.fields["actor"], e.fields["from"], e.fields["to"]) for e in events] == [
        ("serverless.scaled", "system:serverless", "1", "3"),
        ("scaletozero.cooled", "system:serverless", "3", "0"),
    ]


async def test_an_idle_env_cools_and_a_request_wakes_it(h: Harness) -> None:
    await h.seed(*base_objects(scaled_env(scale_to_zero=True, min_replicas=2, effective=2), running(2)))
    loop = await h.loop(ScaleToZero)
    t0 = h.clock.now()
    await h.beat(node_beat(t0, proxy={"env1": traffic(last_request_at=t0)}))
    await loop.pass_once()
    await h.clock.advance(16 * 60)
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic(last_request_at=t0)}))
    await loop.pass_once()
    activator = Activator(conn=h.conn, view=h.view, writer=h.writer, clock=h.clock)
    await activator.activate("env1", node_id="n7")
    cooled, woken = await stored_events(h.conn)
    assert (cooled.kind, cooled.fields["actor"], cooled.fields["from"], cooled.fields["to"]) == (
        "scaletozero.cooled",
        "system:scaletozero",
        "2",
        "0",
    )
    assert (woken.kind, woken.fields["actor"], woken.fields["from"], woken.fields["to"]) == (
        "scaletozero.woken",
        "system:activator",
        "0",
        "2",
    )
    assert woken.fields["requested_by_node"] == "n7"
    # Already warm: no write, no event.
    await activator.activate("env1")
    assert await stored_kinds(h.conn) == ["scaletozero.cooled", "scaletozero.woken"]


async def test_serverless_demand_on_a_cold_env_is_a_wake(h: Harness) -> None:
    env = scaled_env(max_concurrency=10, min_replicas=0, max_replicas=5, scale_to_zero=True, effective=0)
    await h.seed(*base_objects(env))
    loop = await h.loop(Serverless)
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic(held=4)}))
    await loop.pass_once()
    [woken] = await stored_events(h.conn)
    assert (woken.kind, woken.fields["actor"], woken.fields["from"], woken.fields["to"]) == (
        "scaletozero.woken",
        "system:serverless",
        "0",
        "1",
    )
