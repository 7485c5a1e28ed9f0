"""Route client and wire codec: the spec's C2 cases (against real NATS instead of a fake dialer), ordering
by version, the cache, chunking and compression."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.routeclient import RouteClient
from shared.routewire import (
    CHUNK_HEADER,
    ENCODING_HEADER,
    GZIP,
    UNCHANGED_HEADER,
    VERSION_HEADER,
    SnapshotAssembler,
    SnapshotDecodeError,
    content_digest,
    decode_body,
    encode_messages,
)
from shared.subjects import ROUTES_GET_SUBJECT, ROUTES_SNAPSHOT_SUBJECT
from tests.waiting import eventually


def snapshot(version: int, host: str) -> cpb.RouteSnapshot:
    return cpb.RouteSnapshot(version=version, http_routes=[cpb.HTTPRoute(hostname=host)])


async def publish(conn: Connection, snap: cpb.RouteSnapshot, max_message_bytes: int = 1 << 20) -> None:
    data = snap.SerializeToString(deterministic=True)
    for message in encode_messages(
        data, version=snap.version, digest=content_digest(data), max_message_bytes=max_message_bytes
    ):
        await conn.nc.publish(ROUTES_SNAPSHOT_SUBJECT, message.body, headers=message.headers)


# ---------------------------------------------------------------------------------------------- codec


def big_snapshot(version: int = 9, routes: int = 3000) -> cpb.RouteSnapshot:
    return cpb.RouteSnapshot(
        version=version, http_routes=[cpb.HTTPRoute(hostname=f"h{i}.example.com") for i in range(routes)]
    )


@pytest.mark.parametrize(
    ("snap", "compress_above", "max_message_bytes", "compressed", "chunks"),
    [
        (snapshot(1, "a"), 1 << 16, 1 << 20, False, 1),
        (big_snapshot(), 1024, 1 << 20, True, 1),
        (big_snapshot(), 1 << 30, 4096, False, 16),
        (big_snapshot(), 1024, 1024, True, 3),
    ],
    ids=["small-is-plain", "large-is-zstd", "too-big-is-chunked", "compressed-then-chunked"],
)
def test_encode_then_assemble_round_trips(
    snap: cpb.RouteSnapshot, compress_above: int, max_message_bytes: int, compressed: bool, chunks: int
) -> None:
    data = snap.SerializeToString(deterministic=True)
    messages = encode_messages(
        data, version=snap.version, digest="d", max_message_bytes=max_message_bytes, compress_above=compress_above
    )
    assert len(messages) == chunks
    assert all((ENCODING_HEADER in m.headers) == compressed for m in messages)
    assert all(len(m.body) <= max_message_bytes and m.headers[VERSION_HEADER] == str(snap.version) for m in messages)
    assembler = SnapshotAssembler()
    results = [assembler.add(m.headers, m.body) for m in messages]
    assert results[:-1] == [None] * (chunks - 1)
    assert results[-1] == snap


def test_assembler_drops_an_older_incomplete_snapshot_for_a_newer_one() -> None:
    old, new = big_snapshot(5), big_snapshot(6, routes=2000)
    old_msgs = encode_messages(old.SerializeToString(), version=5, digest="o", max_message_bytes=8192)
    new_msgs = encode_messages(new.SerializeToString(), version=6, digest="n", max_message_bytes=8192)
    assembler = SnapshotAssembler()
    assert assembler.add(old_msgs[0].headers, old_msgs[0].body) is None
    assert [assembler.add(m.headers, m.body) for m in new_msgs][-1] == new
    assert [assembler.add(m.headers, m.body) for m in old_msgs[1:]] == [None] * (len(old_msgs) - 1)


def test_gzip_bodies_are_accepted() -> None:
    snap = snapshot(3, "g")
    assert decode_body({ENCODING_HEADER: GZIP}, gzip.compress(snap.SerializeToString())) == snap


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({ENCODING_HEADER: "br"}, b""),
        ({ENCODING_HEADER: "zstd"}, b"not zstd"),
        ({}, b"\xff\xff\xff"),
        ({VERSION_HEADER: "1", CHUNK_HEADER: "3/2"}, b""),
        ({CHUNK_HEADER: "0/2"}, b""),
    ],
    ids=["unknown-encoding", "corrupt-zstd", "not-protobuf", "chunk-index-out-of-range", "chunk-without-version"],
)
def test_undecodable_messages_are_rejected(headers: dict[str, str], body: bytes) -> None:
    with pytest.raises(SnapshotDecodeError):
        SnapshotAssembler().add(headers, body)


# ---------------------------------------------------------------------------------------------- C2 and ordering


async def test_disk_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "proxy" / "routes.pb"
    first = RouteClient(path)
    assert first.apply(snapshot(7, "api.example.com"))
    await first.flush()
    assert first.version == 7
    second = RouteClient(path)
    assert second.version == 7
    assert [r.hostname for r in second.current.http_routes] == ["api.example.com"]
    assert not (tmp_path / "proxy" / "routes.pb.tmp").exists()


def test_unreadable_cache_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "routes.pb"
    path.write_bytes(b"\xff\xff garbage")
    assert RouteClient(path).current == cpb.RouteSnapshot()


async def test_stream_applies(conn: Connection, tmp_path: Path) -> None:
    client = RouteClient(tmp_path / "routes.pb")
    updates = client.updates()
    assert (await updates.get()).version == 0
    await client.start(conn)
    try:
        await publish(conn, snapshot(1, "a"))
        await publish(conn, snapshot(2, "b"))
        latest = await asyncio.wait_for(updates.get(), 3)
        while latest.version < 2:
            latest = await asyncio.wait_for(updates.get(), 3)
        assert client.version == 2
    finally:
        await client.stop()


async def test_sends_have_version(conn: Connection, tmp_path: Path) -> None:
    first = RouteClient(tmp_path / "routes.pb")
    first.apply(snapshot(5, "x"))
    await first.flush()
    seen: list[int] = []

    async def responder(msg: Msg) -> None:
        request = cpb.WatchRoutesRequest()
        request.ParseFromString(msg.data)
        seen.append(request.have_version)
        await msg.respond(b"")

    await conn.nc.subscribe(ROUTES_GET_SUBJECT, cb=responder)
    second = RouteClient(tmp_path / "routes.pb")
    await second.start(conn)
    try:
        await eventually(lambda: bool(seen), 5, "a routes.get request")
        assert seen[0] == 5
    finally:
        await second.stop()


async def test_older_and_duplicate_snapshots_are_ignored(conn: Connection, tmp_path: Path) -> None:
    client = RouteClient(tmp_path / "routes.pb")
    await client.start(conn)
    try:
        await publish(conn, snapshot(5, "new"))
        await eventually(lambda: client.version == 5, 5)
        await publish(conn, snapshot(3, "old"))
        await publish(conn, snapshot(5, "new"))
        await publish(conn, snapshot(6, "newer"))
        await eventually(lambda: client.version == 6, 5)
        assert client.dropped == 2
        assert client.apply(snapshot(4, "old")) is False
        await client.flush()
        assert RouteClient(tmp_path / "routes.pb").version == 6
    finally:
        await client.stop()


async def test_keeps_serving_while_the_control_plane_is_unreachable(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    conn = await connect(nats_server.url, name="proxy")
    client = RouteClient(tmp_path / "routes.pb", request_timeout=0.2)
    await client.start(conn)
    await publish(conn, snapshot(4, "kept.example.com"))
    await eventually(lambda: client.version == 4, 5)
    await client.flush()
    nats_server.kill()
    await eventually(lambda: not conn.nc.is_connected, 5)
    assert [r.hostname for r in client.current.http_routes] == ["kept.example.com"]
    assert not await client.fetch()
    assert client.version == 4
    restarted = RouteClient(tmp_path / "routes.pb")
    assert [r.hostname for r in restarted.current.http_routes] == ["kept.example.com"]
    await client.stop()
    with contextlib.suppress(OSError):
        await conn.nc.close()


# ---------------------------------------------------------------------------------------------- clusters

CLUSTER_A = cpb.ClusterIdentity(id="01OPENCLUSTER", epoch="2025-01-01T00:00:00+00:00")
CLUSTER_B = cpb.ClusterIdentity(id="01SECURECLUSTER", epoch="2025-02-01T00:00:00+00:00")


def of(cluster: cpb.ClusterIdentity, version: int, host: str) -> cpb.RouteSnapshot:
    snap = snapshot(version, host)
    snap.cluster.CopyFrom(cluster)
    return snap


async def route_service(conn: Connection, answer: cpb.RouteSnapshot, asked: list[cpb.WatchRoutesRequest]) -> None:
    """A route service that answers every routes.get with ``answer`` (or "unchanged", as the real one does)."""
    data = answer.SerializeToString(deterministic=True)

    async def respond(msg: Msg) -> None:
        request = cpb.WatchRoutesRequest.FromString(msg.data)
        asked.append(request)
        if request.have_version == answer.version and request.have_cluster == answer.cluster:
            await conn.nc.publish(msg.reply, b"", headers={UNCHANGED_HEADER: "true"})
            return
        for message in encode_messages(data, version=answer.version, digest="d", max_message_bytes=1 << 20):
            await conn.nc.publish(msg.reply, message.body, headers=message.headers)

    await conn.nc.subscribe(ROUTES_GET_SUBJECT, cb=respond)


async def test_a_cached_snapshot_of_another_cluster_gives_way_to_the_route_services_answer_whatever_its_version(
    conn: Connection, tmp_path: Path
) -> None:
    # The data dir of an open cluster (version 7725) started --secure: a new cluster, whose versions are lower.
    cached = RouteClient(tmp_path / "routes.pb")
    cached.apply(of(CLUSTER_A, 7725, "old.example.com"))
    await cached.flush()
    asked: list[cpb.WatchRoutesRequest] = []
    await route_service(conn, of(CLUSTER_B, 868, "new.example.com"), asked)
    client = RouteClient(tmp_path / "routes.pb")
    assert client.current.cluster == CLUSTER_A  # the cache names its cluster
    await client.start(conn)
    try:
        await eventually(lambda: client.current.cluster == CLUSTER_B, 5, "the new cluster's routes")
        assert (client.version, [r.hostname for r in client.current.http_routes]) == (868, ["new.example.com"])
        assert asked[0].have_cluster == CLUSTER_A and asked[0].have_version == 7725
        await publish(conn, of(CLUSTER_B, 870, "newer.example.com"))  # then ordered by version, as before
        await eventually(lambda: client.version == 870, 5)
        await client.flush()
        assert RouteClient(tmp_path / "routes.pb").current.cluster == CLUSTER_B
    finally:
        await client.stop()


async def test_a_pushed_snapshot_of_another_cluster_is_never_taken_by_its_version(
    conn: Connection, tmp_path: Path
) -> None:
    asked: list[cpb.WatchRoutesRequest] = []
    await route_service(conn, of(CLUSTER_B, 868, "mine.example.com"), asked)
    client = RouteClient(tmp_path / "routes.pb")
    await client.start(conn)
    try:
        await eventually(lambda: client.version == 868, 5)
        await publish(conn, of(CLUSTER_A, 7725, "stale.example.com"))
        await eventually(lambda: len(asked) >= 2, 5, "the route service asked about the foreign snapshot")
        await client.flush()
        assert client.current.cluster == CLUSTER_B and client.version == 868
        assert client.apply(of(CLUSTER_A, 9999, "stale.example.com")) is False
    finally:
        await client.stop()
