"""Bad input never crashes a service and never stops other keys from flowing (DESIGN §5): random bytes
and valid-but-absurd protobufs under every key kind of ``zattera-state`` and of ``zattera-live``, and as
route snapshots, while every service (and an agent with its builder) runs. The skipped-value counters
(``StateView.skipped``, ``LiveView.skipped``) say exactly what was skipped. Request subjects:
``test_requests.py``."""

from __future__ import annotations

import itertools
from pathlib import Path

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.live import publish_node_heartbeat
from shared.routeclient import RouteClient
from shared.routewire import decode_body
from shared.subjects import (
    ACTIVATE_SUBJECT,
    LIVE_PREFIX,
    LIVE_STREAM,
    ROUTES_GET_SUBJECT,
    ROUTES_SNAPSHOT_SUBJECT,
    STATE_PREFIX,
    STATE_STREAM,
)
from tests.badinput.rig import AGENT_NODE, Rig
from tests.badinput.strategies import IDS, absurd
from tests.waiting import eventually

EXAMPLES = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
KINDS = sorted(K.ALL_KINDS)
OTHER_NODES = IDS.filter(lambda n: n != AGENT_NODE)  # garbage never lands on the running agent's own keys
_sentinels = itertools.count(1)


def state_key(kind: str, ident: str, node: str) -> str:
    return f"{kind}.{node}.{ident}" if kind in K.PER_NODE_KINDS else f"{kind}.{ident}"


def undecodable(key: str, data: bytes) -> bool:
    """What the view skips: a bad key, bytes that do not decode, or a value whose own id names another key."""
    try:
        k = K.parse(key)
        return bool(K.names_another_key(K.decode(k.kind, data), key))
    except (K.BadKey, DecodeError, ValueError, RuntimeError):
        return True


async def publish_state(rig: Rig, key: str, data: bytes) -> int:
    ack = await rig.conn.js.publish(STATE_PREFIX + key, data, stream=STATE_STREAM)
    return int(ack.seq)


async def state_flows(rig: Rig) -> None:
    """A valid write lands after the bad one and the view applies it (others keep flowing)."""
    p = pb.Project(name="sentinel")
    p.meta.id = f"sentinel-{next(_sentinels)}"
    rev = await publish_state(rig, K.key_of(p), K.encode(p))
    await eventually(lambda: rig.view.rev(K.key_of(p)) == rev, 10, "the sentinel write")


def assert_services_alive(rig: Rig) -> None:
    dead = rig.dead()
    assert not dead, f"services died: {dead}"


@EXAMPLES
@given(kind=st.sampled_from([*KINDS, "bogus"]), ident=IDS, node=OTHER_NODES, data=st.binary(max_size=300))
def test_random_bytes_under_every_key_kind(rig: Rig, kind: str, ident: str, node: str, data: bytes) -> None:
    key = state_key(kind, ident, node)
    if kind == K.LEASE:
        key = f"{K.LEASE}.bad-{ident}"  # never a running loop's lease
    before = rig.view.skipped
    rig.run(publish_state(rig, key, data))
    rig.run(state_flows(rig))
    assert rig.view.skipped == before + undecodable(key, data)
    assert_services_alive(rig)


@EXAMPLES
@given(kind=st.sampled_from([k for k in KINDS if k != K.LEASE]), ident=IDS, node=OTHER_NODES, data=st.data())
def test_absurd_protobufs_under_every_key_kind(rig: Rig, kind: str, ident: str, node: str, data: st.DataObject) -> None:
    msg = data.draw(absurd(K.MESSAGE_TYPES[kind]))
    if hasattr(msg, "meta"):
        msg.meta.id = ident
    if isinstance(msg, pb.Assignment):
        msg.node_id = node
    key = state_key(kind, ident, node)
    if isinstance(msg, pb.ServiceVIP):
        msg.environment_id = ident
    before = rig.view.skipped
    rig.run(publish_state(rig, key, msg.SerializeToString()))
    rig.run(state_flows(rig))
    assert rig.view.skipped == before
    assert_services_alive(rig)


@EXAMPLES
@given(kind=st.sampled_from(["node", "proxy", "bogus"]), ident=OTHER_NODES, data=st.binary(max_size=300))
def test_random_bytes_in_the_live_bucket(rig: Rig, kind: str, ident: str, data: bytes) -> None:
    key = f"{kind}.{ident}"
    expected = kind not in ("node", "proxy")
    if not expected:
        try:
            (cpb.Heartbeat() if kind == "node" else cpb.ProxyHeartbeat()).ParseFromString(data)
        except (DecodeError, ValueError, RuntimeError):
            expected = True
    before = rig.live.skipped

    async def go() -> None:
        await rig.conn.js.publish(LIVE_PREFIX + key, data, stream=LIVE_STREAM)
        hb = cpb.Heartbeat(node_id=f"live-sentinel-{next(_sentinels)}")
        hb.time.GetCurrentTime()
        await publish_node_heartbeat(rig.conn, hb)
        await eventually(lambda: rig.live.node_heartbeat(hb.node_id) is not None, 10, "the sentinel heartbeat")

    rig.run(go())
    assert rig.live.skipped == before + expected
    assert_services_alive(rig)


@EXAMPLES
@given(kind=st.sampled_from(["node", "proxy"]), ident=OTHER_NODES, data=st.data())
def test_absurd_heartbeats_in_the_live_bucket(rig: Rig, kind: str, ident: str, data: st.DataObject) -> None:
    """Decodable but absurd samples (NaN and huge usage, far-past or far-future times, unknown and existing
    env ids with NaN rates) are kept, not skipped; the autoscalers and liveness read them and live on."""
    msg: cpb.Heartbeat | cpb.ProxyHeartbeat
    if kind == "node":
        msg = data.draw(absurd(cpb.Heartbeat, huge=300), label="sample")
    else:
        msg = data.draw(absurd(cpb.ProxyHeartbeat, huge=300), label="sample")
    envs = [e.meta.id for e in rig.view.envs()]
    if envs:  # traffic for envs that exist (the absurd ones written under env.*), so the autoscalers act on it
        samples = msg.proxy if isinstance(msg, cpb.Heartbeat) else msg.envs
        for env_id in data.draw(st.lists(st.sampled_from(envs), max_size=3), label="existing envs"):
            samples[env_id].CopyFrom(data.draw(absurd(cpb.ProxySample), label="sample of an existing env"))
    before = rig.live.skipped

    async def go() -> None:
        await rig.conn.js.publish(f"{LIVE_PREFIX}{kind}.{ident}", msg.SerializeToString(), stream=LIVE_STREAM)
        hb = cpb.Heartbeat(node_id=f"live-sentinel-{next(_sentinels)}")
        hb.time.GetCurrentTime()
        await publish_node_heartbeat(rig.conn, hb)
        await eventually(lambda: rig.live.node_heartbeat(hb.node_id) is not None, 10, "the sentinel heartbeat")

    rig.run(go())
    assert rig.live.skipped == before
    if isinstance(msg, cpb.Heartbeat):  # served as written (bytes compared: NaN != NaN)
        served = rig.live.node_heartbeat(ident)
        assert served is not None
        assert served.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)
    assert_services_alive(rig)


@EXAMPLES
@given(
    data=st.one_of(st.binary(max_size=500), absurd(cpb.RouteSnapshot).map(lambda m: m.SerializeToString())),
    encoding=st.sampled_from([None, "gzip", "zstd", "br"]),
)
def test_random_route_snapshots(rig: Rig, data: bytes, encoding: str | None) -> None:
    headers = {"Content-Encoding": encoding} if encoding else None
    rig.run(rig.conn.js.publish(ROUTES_SNAPSHOT_SUBJECT, data, headers=headers))
    assert_services_alive(rig)


def test_after_the_garbage_every_service_still_answers(rig: Rig) -> None:
    """Valid requests still get valid answers, the state view still applies writes, the agent heartbeats."""
    assert_services_alive(rig)

    async def go() -> None:
        reply = await rig.conn.nc.request(ROUTES_GET_SUBJECT, cpb.WatchRoutesRequest().SerializeToString(), timeout=5.0)
        decode_body(reply.headers, reply.data)
        answer = await rig.conn.nc.request(
            ACTIVATE_SUBJECT, cpb.ActivateRequest(environment_id="nope").SerializeToString(), timeout=5.0
        )
        cpb.ActivateResponse.FromString(answer.data)
        await state_flows(rig)
        seen = rig.live.node_seen_at(AGENT_NODE)
        await eventually(lambda: (rig.live.node_seen_at(AGENT_NODE) or 0) > (seen or 0), 20, "agent heartbeats")

    rig.run(go(), 60)
    assert_services_alive(rig)


def test_a_garbage_route_snapshot_does_not_pin_the_route_client(rig: Rig, tmp_path: Path) -> None:
    async def go() -> None:
        client = RouteClient(tmp_path / "fresh.cache", request_timeout=1.0)
        await client.start(rig.conn)
        try:
            bogus = cpb.RouteSnapshot(version=2**60)
            await rig.conn.js.publish(ROUTES_SNAPSHOT_SUBJECT, bogus.SerializeToString())
            await eventually(lambda: client.applied > 0, 5, "the snapshot message handled")

            async def follows_the_routes_service() -> bool:
                r = await rig.conn.nc.request(
                    ROUTES_GET_SUBJECT, cpb.WatchRoutesRequest().SerializeToString(), timeout=5
                )
                return client.version == decode_body(r.headers, r.data).version

            await eventually(follows_the_routes_service, 4, "the client back on the real snapshots")
        finally:
            await client.stop()

    rig.run(go(), 60)
