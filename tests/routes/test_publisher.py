"""Distribution against real NATS: versions, byte identity across replicas, keep-alive, routes.get,
chunking, and a client seeing promotion as one snapshot."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.routes.publisher import RoutesPublisher
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection, connect
from shared.provisioning import cluster_identity, provision
from shared.routeclient import RouteClient
from shared.routewire import DIGEST_HEADER, UNCHANGED_HEADER, VERSION_HEADER
from shared.state.feed import StateView
from shared.subjects import ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT, STATE_STREAM
from shared.txn import Writer
from tests.routes import state as S
from tests.routes.state import DOMAIN
from tests.waiting import eventually

IMPLICIT = "api-production.apps.example.com"
Replica = Callable[..., Awaitable[RoutesPublisher]]


@pytest.fixture
async def replica(nats_url: str, conn: Connection) -> AsyncIterator[Replica]:
    """Starts route publishers, each with its own connection and view (as separate replicas would)."""
    tasks: list[asyncio.Task[None]] = []
    owned: list[tuple[Connection, StateView]] = []

    async def start(clock: FakeClock | None = None, **options: object) -> RoutesPublisher:
        own = await connect(nats_url, name=f"routes-{len(owned)}")
        view = StateView(own, name=f"routes-{len(owned)}")
        await view.start()
        owned.append((own, view))
        publisher = RoutesPublisher(own, view, domain=DOMAIN, clock=clock or FakeClock(), **options)  # type: ignore[arg-type]
        tasks.append(asyncio.create_task(publisher.run()))
        await asyncio.wait_for(publisher.ready.wait(), 10)
        return publisher

    yield start
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for own, view in owned:
        await view.stop()
        await own.close()


def endpoints(snapshot: cpb.RouteSnapshot, hostname: str = IMPLICIT) -> list[str]:
    return [e.addr for r in snapshot.http_routes if r.hostname == hostname for e in r.endpoints]


def current(publisher: RoutesPublisher) -> cpb.RouteSnapshot:
    assert publisher.current is not None
    snapshot = cpb.RouteSnapshot()
    snapshot.ParseFromString(publisher.current.encoded())
    return snapshot


async def test_two_replicas_publish_identical_bytes_and_version(writer: Writer, replica: Replica) -> None:
    await S.commit(writer, *S.seed_route_env(), S.domain())
    first, second = await replica(), await replica()
    assert first.current is not None and second.current is not None
    assert first.current.encoded() == second.current.encoded()
    await S.commit(writer, S.healthy_assignment("a1", "relA", 30001))
    await S.commit(writer, (K.lease("scheduler"), pb.Lease(holder="elsewhere", term=3)))
    for publisher in (first, second):
        await eventually(lambda p=publisher: endpoints(current(p)) == ["10.90.0.1:30001"], 5)  # type: ignore[misc]
    assert first.current.encoded() == second.current.encoded()
    assert current(first).version == first.builder.revision < first.view.last_revision


async def test_restart_never_goes_back_in_version(writer: Writer, replica: Replica) -> None:
    await S.commit(writer, *S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001), S.domain())
    first = await replica()
    published = current(first).version
    await S.commit(writer, (K.release("relA"), pb.Release(environment_id="env1")))
    await S.commit(writer, S.node("n9"))  # read by the builder, but no route changes
    restarted = await replica()
    assert current(restarted).version == published
    assert restarted.publishes == 0
    await S.commit(writer, (K.domain("dom1"), None))
    await eventually(lambda: len(current(restarted).http_routes) == 1, 5)
    assert current(restarted).version > published


async def test_unchanged_content_is_not_republished_but_kept_alive(writer: Writer, replica: Replica) -> None:
    await S.commit(writer, *S.seed_route_env())
    clock = FakeClock()
    publisher = await replica(clock=clock)
    seen: list[str] = []

    async def collect(msg: Msg) -> None:
        seen.append((msg.headers or {}).get(VERSION_HEADER, ""))

    await publisher.conn.nc.subscribe(ROUTES_SNAPSHOT_SUBJECT, cb=collect)
    await publisher.conn.nc.flush()
    version = current(publisher).version
    await S.commit(writer, S.node(), S.project())  # rewrites with identical content
    await S.commit(writer, S.healthy_assignment("a1", "relA", 30001))
    await eventually(lambda: len(seen) == 1, 5, "one publish for the one route change")
    changed = current(publisher).version
    assert changed > version
    await eventually(lambda: clock.sleepers > 0, 5)
    await clock.advance(15)
    await eventually(lambda: len(seen) == 2, 5, "a keep-alive")
    assert seen == [str(changed), str(changed)]


async def test_routes_get_answers_unchanged_or_the_snapshot(
    conn: Connection, writer: Writer, replica: Replica, tmp_path: Path
) -> None:
    await S.commit(writer, *S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001))
    publisher = await replica()
    version = current(publisher).version
    request = cpb.WatchRoutesRequest(have_version=version)
    replies: list[Msg] = []

    async def answered() -> bool:  # as RouteClient.fetch does, ask again while no responder is seen yet
        with contextlib.suppress(NoRespondersError):
            replies.append(await conn.nc.request(ROUTES_GET_SUBJECT, request.SerializeToString(), timeout=5))
        return bool(replies)

    await eventually(answered, 5, "a route replica answers routes.get")
    reply = replies[0]
    assert (reply.headers or {}).get(UNCHANGED_HEADER) == "true" and reply.data == b""
    client = RouteClient(tmp_path / "routes.pb")
    await client.start(conn)
    try:
        await eventually(lambda: client.version == version, 5)
        assert client.current == current(publisher)
    finally:
        await client.stop()


async def test_snapshots_too_big_for_one_message_go_through_in_chunks(
    conn: Connection, writer: Writer, replica: Replica, tmp_path: Path
) -> None:
    await S.commit(writer, S.project(), S.app(), S.node())
    await S.commit(writer, *[S.env(f"env{i:03d}", name=f"e{i}") for i in range(40)])
    publisher = await replica(compress_above=1 << 30, max_message_bytes=1024)
    assert publisher.current is not None
    assert len(publisher.current.messages(1024, 1 << 30)) > 3
    client = RouteClient(tmp_path / "routes.pb")
    await client.start(conn)
    try:
        await eventually(lambda: client.version == current(publisher).version, 5, "fetched in chunks")
        await S.commit(writer, S.env("env999", name="late"))
        await eventually(lambda: len(client.current.http_routes) == 41, 5, "published in chunks")
        assert client.current == current(publisher)
    finally:
        await client.stop()


async def test_a_client_sees_promotion_as_one_snapshot(
    conn: Connection, writer: Writer, replica: Replica, tmp_path: Path
) -> None:
    await S.commit(writer, *S.seed_route_env(), S.healthy_assignment("a1", "relA", 30001))
    await replica()
    client = RouteClient(tmp_path / "routes.pb")
    updates = client.updates()
    await client.start(conn)
    seen: list[list[str]] = []

    async def watch() -> None:
        async for snapshot in updates:
            seen.append(endpoints(snapshot))

    watcher = asyncio.create_task(watch())
    try:
        await eventually(lambda: seen[-1:] == [["10.90.0.1:30001"]], 5)
        await S.commit(writer, S.healthy_assignment("a2", "relB", 30002))
        await S.commit(writer, S.env(active_release_id="relB", route_generation=2))
        await eventually(lambda: seen[-1:] == [["10.90.0.1:30002"]], 5)
        assert all(addrs in (["10.90.0.1:30001"], ["10.90.0.1:30002"]) for addrs in seen[1:]), seen
    finally:
        watcher.cancel()
        await client.stop()


async def test_a_burst_of_changes_is_coalesced(writer: Writer, replica: Replica) -> None:
    await S.commit(writer, *S.seed_route_env())
    publisher = await replica(quiet=0.3, max_delay=2.0)
    before = publisher.publishes
    for i in range(10):
        await S.commit(writer, S.healthy_assignment(f"a{i}", "relA", 30000 + i))
    await eventually(lambda: len(endpoints(current(publisher))) == 10, 10)
    assert publisher.publishes - before <= 2


async def test_snapshots_name_their_cluster_and_routes_get_says_unchanged_only_for_the_same_cluster(
    conn: Connection, writer: Writer, replica: Replica
) -> None:
    await S.commit(writer, *S.seed_route_env())
    publisher = await replica()
    snapshot = current(publisher)
    identity = await cluster_identity(conn.js)
    assert identity.id and identity.epoch  # recorded by the init
    assert snapshot.cluster == cpb.ClusterIdentity(id=identity.id, epoch=identity.epoch)

    async def ask(request: cpb.WatchRoutesRequest) -> Msg:
        return await conn.nc.request(ROUTES_GET_SUBJECT, request.SerializeToString(), timeout=5)

    same = cpb.WatchRoutesRequest(have_version=snapshot.version, have_cluster=snapshot.cluster)
    assert ((await ask(same)).headers or {}).get(UNCHANGED_HEADER) == "true"
    other = cpb.WatchRoutesRequest(have_version=snapshot.version, have_cluster=cpb.ClusterIdentity(id="01OTHER"))
    answer = await ask(other)
    assert UNCHANGED_HEADER not in (answer.headers or {})
    assert cpb.RouteSnapshot.FromString(answer.data) == snapshot


async def test_a_version_published_before_the_state_stream_was_created_does_not_hold_back_the_new_one(
    conn: Connection, replica: Replica
) -> None:
    # The routes stream outlived the state stream (created anew since): its last version belongs to another life.
    await conn.js.publish(ROUTES_SNAPSHOT_SUBJECT, b"", headers={VERSION_HEADER: str(10**9), DIGEST_HEADER: "old"})
    before = await cluster_identity(conn.js)
    await conn.js.delete_stream(STATE_STREAM)
    await provision(conn.js)
    assert (await cluster_identity(conn.js)).id != before.id
    view = StateView(conn, name="t2")
    await view.start()
    try:
        await S.commit(Writer(conn, view), *S.seed_route_env())
        publisher = await replica()
        snapshot = current(publisher)
        assert 0 < snapshot.version < 10**9 and [r.hostname for r in snapshot.http_routes] == [IMPLICIT]
        assert publisher.publishes == 1
    finally:
        await view.stop()
