"""The node forwarder with real sockets: a web env reaches a database-like env (a TCP echo) by name and by
address, across a restart of the database on another port, draining the old connection; policy between
projects; a cold env woken by a connection; bad names. Snapshots are fed as the route client would."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from dnslib import RCODE, DNSRecord
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.forwarder import Forwarder
from services.agent.network import consumer_address
from shared.embedded import free_port
from shared.files import write_atomic
from tests.waiting import eventually

DB_VIP = "127.128.0.5"
DB_FQDN = "db.production.shop.internal."


class Echo:
    """A database stand-in: answers every read with its name and the bytes read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Echo:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(self.name.encode() + b":" + data)
            await writer.drain()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def snapshot(version: int, *services: cpb.InternalService) -> cpb.RouteSnapshot:
    return cpb.RouteSnapshot(version=version, internal_services=list(services))


def service(
    port: int,
    *endpoints: str,
    env_id: str = "db-env",
    project_id: str = "shop-id",
    fqdn: str = DB_FQDN,
    vip: str = DB_VIP,
    scale_to_zero: bool = False,
) -> cpb.InternalService:
    internal = cpb.InternalService(
        fqdn=fqdn, project_id=project_id, environment_id=env_id, vip=vip, scale_to_zero=scale_to_zero
    )
    internal.ports.add(
        name="db",
        port=port,
        protocol="tcp",
        endpoints=[cpb.Endpoint(assignment_id=f"a{i}", addr=addr, healthy=True) for i, addr in enumerate(endpoints)],
    )
    return internal


def consumer(env_id: str, project_id: str, *allow: str) -> tuple[pb.Assignment, pb.Release]:
    assignment = pb.Assignment(environment_id=env_id, project_id=project_id, node_id="n1")
    release = pb.Release(environment_id=env_id, project_id=project_id)
    release.service.network.allow.extend(allow)
    return assignment, release


async def exchange(host: str, port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1024), 5)
    finally:
        writer.close()


async def lookup(resolver: str, name: str, qtype: str = "A") -> DNSRecord:
    host, _, port = resolver.rpartition(":")
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        await loop.sock_sendto(sock, DNSRecord.question(name, qtype).pack(), (host, int(port)))
        data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)
    return DNSRecord.parse(data)


@pytest.fixture
async def forwarder() -> AsyncIterator[Forwarder]:
    fw = Forwarder(dns_port=free_port(), hold_timeout=10)
    yield fw
    await fw.close()


async def test_web_reaches_the_database_by_address_and_name_across_a_restart(forwarder: Forwarder) -> None:
    db_port = free_port()
    first = await Echo("first").start()
    await forwarder.apply(snapshot(1, service(db_port, first.addr)))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    host, port = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], int(env["ZATTERA_SERVICE_DB_PRODUCTION_PORT"])
    assert (port, env["ZATTERA_SERVICE_DB_PRODUCTION_URL"]) == (db_port, f"tcp://{host}:{db_port}")
    assert await exchange(host, port, b"by-address") == b"first:by-address"

    answer = await lookup(env["ZATTERA_DNS"], DB_FQDN)
    assert [str(rr.rdata) for rr in answer.rr] == [host]
    assert await exchange(str(answer.rr[0].rdata), port, b"by-name") == b"first:by-name"

    # A connection open across the restart stays on the old replica (drained); new ones go to the new one.
    reader, writer = await asyncio.open_connection(host, port)
    second = await Echo("second").start()
    await forwarder.apply(snapshot(2, service(db_port, second.addr)))
    assert await exchange(host, port, b"after") == b"second:after"
    writer.write(b"still")
    assert await asyncio.wait_for(reader.read(1024), 5) == b"first:still"
    writer.close()
    await first.stop()
    await second.stop()


async def test_endpoints_are_tried_in_turn_and_a_dead_one_is_skipped(forwarder: Forwarder) -> None:
    db_port = free_port()
    alive = await Echo("alive").start()
    await forwarder.apply(snapshot(1, service(db_port, f"127.0.0.1:{free_port()}", alive.addr)))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
    for _ in range(3):
        assert await exchange(host, db_port, b"x") == b"alive:x"
    await alive.stop()


async def test_other_projects_are_refused_unless_allowed(forwarder: Forwarder) -> None:
    db_port = free_port()
    db = await Echo("db").start()
    await forwarder.apply(snapshot(1, service(db_port, db.addr)))
    outsider = await forwarder.instance_env(*consumer("blog-env", "blog-id"))
    assert not [key for key in outsider if key.startswith("ZATTERA_SERVICE_")]
    outsider_slot = next(s for s, c in forwarder.slots.consumers.items() if c.env_id == "blog-env")
    with pytest.raises(ConnectionRefusedError):
        await exchange(consumer_address(outsider_slot, DB_VIP), db_port, b"x")
    assert (await lookup(outsider["ZATTERA_DNS"], DB_FQDN)).header.rcode == RCODE.NXDOMAIN

    partner = await forwarder.instance_env(*consumer("api-env", "partner-id", "shop/db/production"))
    host = partner["ZATTERA_SERVICE_SHOP_DB_PRODUCTION_HOST"]
    assert await exchange(host, db_port, b"allowed") == b"db:allowed"
    await db.stop()


async def test_a_cold_env_is_woken_by_the_first_connection(forwarder: Forwarder) -> None:
    db_port = free_port()
    db = await Echo("woken").start()
    woken: list[str] = []

    async def activate(env_id: str) -> None:
        woken.append(env_id)
        await forwarder.apply(snapshot(2, service(db_port, db.addr, scale_to_zero=True)))

    forwarder.activate = activate
    await forwarder.apply(snapshot(1, service(db_port, scale_to_zero=True)))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    assert await exchange(env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], db_port, b"hello") == b"woken:hello"
    assert woken == ["db-env"]
    await db.stop()


async def test_connections_beyond_the_hold_cap_are_closed_at_once() -> None:
    db_port = free_port()
    asked = asyncio.Event()

    async def activate(env_id: str) -> None:
        asked.set()

    forwarder = Forwarder(activate=activate, max_held_per_env=1, hold_timeout=10)
    try:
        await forwarder.apply(snapshot(1, service(db_port, scale_to_zero=True)))
        env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
        host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
        _, held = await asyncio.open_connection(host, db_port)
        await asyncio.wait_for(asked.wait(), 5)
        try:
            assert await exchange(host, db_port, b"x") == b""
        except ConnectionResetError:
            pass
        assert forwarder.refused == 1
        held.close()
    finally:
        await forwarder.close()


async def test_no_endpoint_and_not_scale_to_zero_closes_the_connection(forwarder: Forwarder) -> None:
    db_port = free_port()
    await forwarder.apply(snapshot(1, service(db_port)))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    try:  # closed at once: an end of stream, or a reset when our bytes arrived before the close
        assert await exchange(env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], db_port, b"x") == b""
    except ConnectionResetError:
        pass
    await eventually(lambda: forwarder.refused == 1)


@pytest.mark.parametrize(
    ("name", "rcode"),
    [
        ("db.production.shop.internal", RCODE.NOERROR),
        ("DB.Production.Shop.Internal.", RCODE.NOERROR),
        ("db.staging.shop.internal", RCODE.NXDOMAIN),
        ("db.shop.internal", RCODE.NXDOMAIN),
        ("x.db.production.shop.internal", RCODE.NXDOMAIN),
        ("db_1.production.shop.internal", RCODE.NXDOMAIN),
        ("example.com", RCODE.REFUSED),
    ],
)
async def test_resolver_names(forwarder: Forwarder, name: str, rcode: int) -> None:
    await forwarder.apply(snapshot(1, service(free_port())))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    answer = await lookup(env["ZATTERA_DNS"], name)
    assert answer.header.rcode == rcode
    assert len(answer.rr) == (1 if rcode == RCODE.NOERROR else 0)


async def test_malformed_services_in_a_snapshot_are_skipped(forwarder: Forwarder) -> None:
    await forwarder.apply(
        snapshot(
            1,
            service(free_port(), env_id="e1", fqdn="not-a-name."),
            service(free_port(), env_id="e2", vip="127.128.0.255"),
            service(free_port(), env_id="e3", vip="bogus"),
        )
    )
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    assert not [key for key in env if key.startswith("ZATTERA_SERVICE_")]


async def test_consumers_survive_an_agent_restart(tmp_path: object) -> None:
    from pathlib import Path

    state = Path(str(tmp_path)) / "forwarder.json"
    db_port = free_port()
    first = Forwarder(state_path=state)
    await first.apply(snapshot(1, service(db_port)))
    env = await first.instance_env(*consumer("web-env", "shop-id"))
    await first.close()
    again = Forwarder(state_path=state)
    await again.apply(snapshot(1, service(db_port)))
    assert again.slots.consumers == first.slots.consumers
    assert (await again.instance_env(*consumer("web-env", "shop-id"))) == env
    await again.close()


async def test_the_consumer_table_is_written_once_per_burst_and_only_when_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import services.agent.forwarder as module

    written: list[bytes] = []

    def counting(path: Path, data: bytes) -> Path:
        written.append(data)
        return write_atomic(path, data)

    monkeypatch.setattr(module, "write_atomic", counting)
    state = tmp_path / "forwarder.json"
    fw = Forwarder(state_path=state)

    async def start(env_id: str, *allow: str) -> None:
        await fw.instance_env(*consumer(env_id, "shop-id", *allow))
        on_disk = json.loads(state.read_bytes())  # a consumer is on disk before its instance gets its variables
        assert env_id in {c["env_id"] for c in on_disk.values()}

    # 30 instances of 10 envs starting at once: one write holds all 10 consumers
    await asyncio.gather(*(start(f"env-{i % 10}") for i in range(30)))
    assert len(written) == 1
    # a consumer coming while a write is under way waits for the next one, which holds every change since
    first = asyncio.create_task(start("env-10"))
    await asyncio.sleep(0)  # its write started
    await asyncio.gather(first, *(start(f"env-{i}") for i in range(11, 15)))
    assert len(written) == 3
    assert Forwarder(state_path=state).slots.consumers == fw.slots.consumers
    await start("env-3")  # an instance of a known consumer: nothing to write
    assert len(written) == 3
    await start("env-3", "other/app/env")  # its new release allows more: written
    assert len(written) == 4
    assert Forwarder(state_path=state).slots.consumers == fw.slots.consumers
    await fw.close()


async def test_a_large_transfer_keeps_flow_control_and_a_half_close_is_passed_on(forwarder: Forwarder) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()  # after the client's half close: everything was echoed

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    db_port = free_port()
    await forwarder.apply(snapshot(1, service(db_port, f"127.0.0.1:{server.sockets[0].getsockname()[1]}")))
    env = await forwarder.instance_env(*consumer("web-env", "shop-id"))
    reader, writer = await asyncio.open_connection(env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], db_port)
    payload = bytes(range(256)) * (16 * 1024)  # 4 MiB: far above every socket buffer on the way

    async def send() -> None:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()

    sending = asyncio.create_task(send())
    received = await asyncio.wait_for(reader.read(), 20)  # until the end of stream
    await sending
    writer.close()
    server.close()
    assert received == payload
