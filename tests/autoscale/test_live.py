"""LiveView: freshness, per-env and per-instance indexes, derived change kinds, the traffic-data guard."""

from __future__ import annotations

from shared.clock import FakeClock
from shared.live import ENV_TRAFFIC, INSTANCE, NODE, LiveView, node_key, proxy_key
from tests.autoscale.helpers import node_beat, offline_live, proxy_beat, traffic


def apply(live: LiveView, hb) -> None:
    key = node_key(hb.node_id) if hasattr(hb, "instances") else proxy_key(hb.proxy_id)
    live.apply(key, hb.SerializeToString())


async def test_env_traffic_sums_fresh_reporters_and_ignores_stale_ones():
    clock = FakeClock()
    now = clock.now()
    live = offline_live(
        clock,
        proxy_beat(now, "p1", {"e1": traffic(inflight=2, held=1, rps=3.0, last_request_at=now - 5)}),
        node_beat(now, "n1", proxy={"e1": traffic(inflight=1, rps=1.0, last_request_at=now - 1)}),
        proxy_beat(now - 31, "dead", {"e1": traffic(inflight=50)}),
    )
    t = live.env_traffic("e1")
    assert (t.inflight, t.held, t.rps, t.reporters) == (3, 1, 4.0, 2)
    assert t.last_request_at == now - 1
    assert live.env_traffic("other").reporters == 0


async def test_a_reporter_dropping_an_env_leaves_its_index():
    clock = FakeClock()
    live = offline_live(clock, proxy_beat(clock.now(), "p1", {"e1": traffic(inflight=2)}))
    apply(live, proxy_beat(clock.now(), "p1", {}))
    assert live.env_traffic("e1").inflight == 0
    live.apply(proxy_key("p1"), None)
    assert not live.has_fresh_traffic_data()


async def test_traffic_data_means_a_fresh_proxy_report_not_a_worker_heartbeat():
    clock = FakeClock()
    live = offline_live(clock, node_beat(clock.now(), "worker", instances={"a1": (1.0, 1)}))
    assert not live.has_fresh_traffic_data()
    apply(live, proxy_beat(clock.now(), "p1"))
    assert live.has_fresh_traffic_data()
    await clock.advance(31)
    assert not live.has_fresh_traffic_data()


async def test_fresh_instance_sample_prefers_the_assignments_node_and_skips_stale_nodes():
    clock = FakeClock()
    now = clock.now()
    live = offline_live(
        clock,
        node_beat(now, "n1", instances={"a1": (10.0, 1)}),
        node_beat(now, "n2", instances={"a1": (20.0, 1)}),
        node_beat(now - 31, "n3", instances={"a2": (30.0, 1)}),
    )
    preferred = live.fresh_instance_sample("a1", prefer_node="n2")
    fallback = live.fresh_instance_sample("a1", prefer_node="n9")
    assert preferred is not None and preferred.cpu_percent == 20.0
    assert fallback is not None and fallback.cpu_percent == 10.0
    assert live.fresh_instance_sample("a2") is None


async def test_derived_changes_name_only_what_changed_and_only_for_feeds_that_ask():
    clock = FakeClock()
    now = clock.now()
    live = offline_live(clock)
    derived = live.subscribe({ENV_TRAFFIC, INSTANCE})
    raw = live.subscribe()
    apply(live, node_beat(now, "n1", instances={"a1": (1.0, 1)}, proxy={"e1": traffic(inflight=1)}))
    assert derived.drain() == {(ENV_TRAFFIC, "e1"), (INSTANCE, "a1")}
    assert raw.drain() == {(NODE, "n1")}
    apply(live, node_beat(now + 1, "n1", instances={"a1": (1.0, 1)}, proxy={"e1": traffic(inflight=1)}))
    assert derived.drain() == set()  # a refresh with the same samples
    apply(live, node_beat(now + 2, "n1", instances={"a1": (5.0, 1)}, proxy={"e2": traffic()}))
    assert derived.drain() == {(ENV_TRAFFIC, "e1"), (ENV_TRAFFIC, "e2"), (INSTANCE, "a1")}


async def test_garbage_over_a_heartbeat_drops_the_stale_sample_and_is_counted():
    clock = FakeClock()
    live = offline_live(clock, proxy_beat(clock.now(), "p1", {"e1": traffic(inflight=2)}))
    live.apply(proxy_key("p1"), b"\xff\xfe\x00garbage")
    assert live.skipped == 1
    assert live.env_traffic("e1").inflight == 0
    assert not live.has_fresh_traffic_data()
