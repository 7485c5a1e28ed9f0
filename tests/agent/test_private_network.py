"""Private networking end to end on real NATS: a real agent runs a database-like env (a TCP echo process)
and a web env (a process) that reaches it by name through the node resolver and by its address; the
route snapshots come from a real route publisher. The database is replaced by a replica on another port
and the web env keeps connecting with the same configuration."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.network_cmds import app_address
from services.agent.network import resolver_address
from services.routes.publisher import RoutesPublisher
from shared import keys as K
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.embedded import free_port
from shared.ids import new_id
from shared.state.feed import StateView
from shared.subjects import ACTIVATE_SUBJECT
from shared.txn import Writer
from tests.agent.conftest import StartAgent, process_ref
from tests.routes import state as S
from tests.waiting import eventually

DB = """
import asyncio, os

NAME = os.environ["ZATTERA_ASSIGNMENT_ID"].encode()


async def serve(reader, writer):
    while data := await reader.read(1024):
        writer.write(NAME + b":" + data)
        await writer.drain()
    writer.close()


async def main():
    server = await asyncio.start_server(serve, os.environ["ZATTERA_BIND_ADDR"], int(os.environ["PORT"]))
    await server.serve_forever()


asyncio.run(main())
"""

WEB = """
import os, pathlib, socket, time
from dnslib import DNSRecord

out = pathlib.Path("answer.txt")
host, port = os.environ["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], int(os.environ["ZATTERA_SERVICE_DB_PRODUCTION_PORT"])
dns_host, dns_port = os.environ["ZATTERA_DNS"].split(":")
while True:
    try:
        query = DNSRecord.question("db.production.shop.internal")
        reply = DNSRecord.parse(query.send(dns_host, int(dns_port), timeout=1))
        by_name = str(reply.rr[0].rdata)
        with socket.create_connection((by_name, port), timeout=10) as s:
            s.sendall(b"ping")
            answer = s.recv(1024).decode()
        pathlib.Path("answer.tmp").write_text(f"{by_name} {host} {answer}")
        pathlib.Path("answer.tmp").replace(out)
    except (OSError, IndexError):
        pass
    time.sleep(0.05)
"""

DB_PORT_NAME = "db"


@pytest.fixture
async def routes(nats_url: str, conn: Connection) -> AsyncIterator[RoutesPublisher]:
    """A route publisher in its own connection (the bucket is provisioned by ``conn``)."""
    own = await connect(nats_url, name="routes")
    view = StateView(own, name="routes")
    await view.start()
    publisher = RoutesPublisher(own, view, domain="localhost", clock=RealClock())
    task = asyncio.create_task(publisher.run())
    await asyncio.wait_for(publisher.ready.wait(), 10)
    yield publisher
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await view.stop()
    await own.close()


def release(env_id: str, app_id: str, directory: Path, script: str) -> pb.Release:
    (directory / "main.py").write_text(script)
    r = pb.Release(
        environment_id=env_id,
        project_id="shop-id",
        app_id=app_id,
        version=1,
        image_ref=process_ref(directory, f"{sys.executable} main.py"),
    )
    r.meta.id = new_id()
    return r


def replica(node_id: str, rel: pb.Release) -> pb.Assignment:
    a = pb.Assignment(
        node_id=node_id,
        project_id=rel.project_id,
        app_id=rel.app_id,
        environment_id=rel.environment_id,
        release_id=rel.meta.id,
        desired=pb.ASSIGNMENT_DESIRED_RUN,
    )
    a.meta.id = new_id()
    return a


@dataclass
class Shop:
    """Project "shop": a database-like env (db/production, a TCP echo) and a web env, on node n1."""

    writer: Writer
    db: pb.Release
    web: pb.Release
    web_dir: Path

    @property
    def answer(self) -> Path:
        return self.web_dir / "answer.txt"

    async def seed(self, *, scale_to_zero: bool = False) -> None:
        _, db_env = S.env("db-env", app_id="db-app", project_id="shop-id", active_release_id=self.db.meta.id)
        assert isinstance(db_env, pb.Environment)
        db_env.service.CopyFrom(self.db.service)
        db_env.service.scale_to_zero = scale_to_zero
        await S.commit(
            self.writer,
            S.project("shop-id", "shop"),
            S.app("db-app", "db", "shop-id"),
            S.app("web-app", "web", "shop-id"),
            (K.env("db-env"), db_env),
            S.vip("db-env", "127.128.0.9"),
            (K.release(self.db.meta.id), self.db),
            (K.release(self.web.meta.id), self.web),
        )

    async def run(self, rel: pb.Release) -> pb.Assignment:
        a = replica("n1", rel)
        await S.commit(self.writer, (K.assignment("n1", a.meta.id), a))
        return a


@pytest.fixture
def shop(conn: Connection, tmp_path: Path) -> Shop:
    db_dir, web_dir = tmp_path / "db", tmp_path / "web"
    db_dir.mkdir()
    web_dir.mkdir()
    db = release("db-env", "db-app", db_dir, DB)
    db.service.ports.add(name=DB_PORT_NAME, container_port=free_port(), protocol=pb.PROTOCOL_TCP)
    db.service.healthcheck.type = pb.HEALTH_CHECK_TYPE_TCP
    db.service.healthcheck.interval.FromMilliseconds(200)
    web = release("web-env", "web-app", web_dir, WEB)
    return Shop(Writer(conn, StateView(conn, name="test-writer")), db, web, web_dir)


async def test_web_env_reaches_its_database_by_name_and_address_across_a_move(
    start_agent: StartAgent, routes: RoutesPublisher, shop: Shop
) -> None:
    running = await start_agent("n1", dns_port=free_port())
    forwarder = running.agent.forwarder
    assert forwarder is not None
    await shop.seed()
    first = await shop.run(shop.db)
    await eventually(lambda: bool(forwarder.endpoints("db-env", DB_PORT_NAME)), what="db endpoint routed")

    await shop.run(shop.web)
    answer = shop.answer
    await eventually(lambda: answer.exists() and first.meta.id in answer.read_text(), timeout=20, what="web → db")
    by_name, address, echoed = answer.read_text().split(" ")
    assert by_name == address and address.endswith(".0.9") and echoed == f"{first.meta.id}:ping"
    # What `zattera network` shows is the address the app was given, with its slot; the VIP names the env.
    (web_slot,) = [slot for slot, consumer in forwarder.slots.consumers.items() if consumer.env_id == "web-env"]
    assert app_address("127.128.0.9").replace("(128+c)", str(128 + web_slot)) == address

    # The database moves to a new replica (another host port); the web instance is not restarted.
    second = replica("n1", shop.db)
    await S.commit(shop.writer, (K.assignment("n1", second.meta.id), second), (K.assignment("n1", first.meta.id), None))
    await eventually(lambda: second.meta.id in answer.read_text(), timeout=20, what="web → the new db replica")
    assert answer.read_text().split(" ")[1] == address

    # A stopped agent leaves no address bound: a restarted one serves them again (its instances were adopted).
    resolver = (resolver_address(next(iter(forwarder.slots.consumers))), forwarder.dns_port)
    await running.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, socket.socket() as tcp:
        udp.bind(resolver)
        tcp.bind((address, shop.db.service.ports[0].container_port))


async def test_a_cold_database_is_woken_by_the_web_envs_first_connection(
    start_agent: StartAgent, routes: RoutesPublisher, shop: Shop, conn: Connection
) -> None:
    """The activator's part (placing a replica of the woken env) is played by a responder on
    ``zattera.activate`` that writes the assignment, as the activator and scheduler would."""
    woken: list[pb.Assignment] = []

    async def activator(msg: Msg) -> None:
        request = cpb.ActivateRequest.FromString(msg.data)
        if request.environment_id == "db-env" and not woken:
            woken.append(await shop.run(shop.db))
        await msg.respond(cpb.ActivateResponse().SerializeToString())

    subscription = await conn.nc.subscribe(ACTIVATE_SUBJECT, cb=activator)
    try:
        running = await start_agent("n1", dns_port=free_port())
        forwarder = running.agent.forwarder
        assert forwarder is not None
        await shop.seed(scale_to_zero=True)
        await eventually(lambda: forwarder.target("db-env") is not None, what="cold db known")
        assert forwarder.endpoints("db-env", DB_PORT_NAME) == []
        await shop.run(shop.web)
        await eventually(lambda: bool(woken), timeout=20, what="activation asked")
        await eventually(
            lambda: shop.answer.exists() and woken[0].meta.id in shop.answer.read_text(), timeout=20, what="woken"
        )
        assert forwarder.activations_sent == 1
    finally:
        await subscription.unsubscribe()
