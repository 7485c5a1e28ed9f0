"""Removing a server machine and retiring the first machine's extra seats, on a real secured JetStream cluster
on loopback (operator mode, the full resolver, authenticated routes, every stream at three copies placed by
``unique_tag``): the first machine's three seats (m1, m1-seat2, m1-seat3, one machine tag) and three more
server machines (m2, m3, m4), each with a join service answering as that machine's would.

* ``zattera nodes remove m4``, m4 leading JetStream's meta group (handed to a server that stays first): its
  credentials (the ones a join issued it and the ones it made itself) are refused by every server, its NATS
  server is not a JetStream peer any more, every stream keeps three copies, caught up, on the other machines;
* removing m3 next (two machines would be left for three copies) is refused and changes nothing;
* ``zattera cluster retire-seats``, m1-seat2 leading the meta group: m1's two extra seats are peer-removed and
  recorded, the first machine's supervisor stops them, every stream keeps three copies on m1, m2, m3 (a meta
  group of three);
* retiring again is refused; ``zattera up`` on the first machine starts one seat once they are retired.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import ServerError

from cli.machine import Machine, machine_cluster
from cli.up_cluster import Cluster
from shared.connection import Connection, connect
from shared.embedded import RETIRED_SEATS_FILE, SERVER_DIR, EmbeddedNats, start_cluster, wait_meta_group
from shared.replicas import plan
from shared.security import membership
from shared.security.authority import Authority, RoleIssuer
from shared.security.creds import inbox_prefix, read_user_jwt, write_private
from shared.security.join import JoinService
from shared.security.machine_service import Machines
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import JOIN_REMOVE_SUBJECT, Role
from shared.security.removal_answers import ask_removal, new_request_id
from shared.security.setup import SecureSetup, prepare
from tests.security.conftest import _provision
from tests.waiting import eventually

log = logging.getLogger(__name__)

NAMES = ["m1", "m1-seat2", "m1-seat3", "m2", "m3", "m4"]
MACHINE_OF = {"m1": "m1", "m1-seat2": "m1", "m1-seat3": "m1", "m2": "m2", "m3": "m3", "m4": "m4"}


@dataclass
class Machines4:
    setup: SecureSetup
    servers: dict[str, EmbeddedNats]
    first: Cluster
    """The first machine's supervisor, holding its three seats."""
    m4_creds: list[Path] = field(default_factory=list)

    @property
    def urls(self) -> str:
        return ",".join(s.url for s in self.servers.values() if s.exited() is None and s.pid is not None)


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machines4]:
    base = tmp_path_factory.mktemp("removal")
    setup = prepare(base / "security")
    extra = setup.server_config(resolver_dir=f"{SERVER_DIR}/jwt")
    tags: list[tuple[str, ...]] = [(f"machine:{MACHINE_OF[n]}",) for n in NAMES]
    servers = start_cluster(
        base / "cluster",
        len(NAMES),
        name="removal",
        extra_config=extra,
        routes=setup.route_security(),
        names=NAMES,
        unique_tag="machine:",
        tags=tags,
    )
    try:
        wait_meta_group(servers, timeout=60)
        by_name = {s.name: s for s in servers}
        first = Cluster(data_dir=base / "m1", machine={"seats": {}}, cluster_servers=servers[:3], with_node=False)
        # m4's credentials: one a join issued it (its agent's), two it made itself from the trust root (control,
        # system).
        m4_creds = [base / "m4-agent.creds", base / "m4-control.creds", base / "m4-system.creds"]
        setup.issue(Role.BUILDER, "m4", m4_creds[0])
        setup.issue(Role.CONTROL, "m4", m4_creds[1])
        write_private(m4_creds[2], Authority.load(setup.directory).system_user_creds())
        cluster = Machines4(setup, by_name, first, m4_creds)
        asyncio.run(_provisioned(cluster.urls, str(setup.control_creds)))
        yield cluster
    finally:
        for server in servers:
            server.stop()


async def _provisioned(urls: str, creds: str) -> None:
    """Every stream at three copies; a JetStream request left unanswered on a loaded machine, or a stream a
    server failed to create (500 "error creating store for stream", seen once while the cluster had just
    formed), is asked again, as the services' provisioning does (creating what is missing is idempotent)."""
    deadline = time.monotonic() + 90
    while True:
        try:
            await _provision(urls, creds, replicas=3)
            return
        except (TimeoutError, nats.errors.TimeoutError, ServerError):
            if time.monotonic() > deadline:
                raise


def _user(creds: Path) -> str:
    return str(decode_claims(read_user_jwt(creds))["sub"])


def _meta_peers(server: EmbeddedNats) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/jsz", timeout=5) as resp:
        meta = json.loads(resp.read())["meta_cluster"]
    # The server itself, the leader, the other peers (the replicas as this server sees them).
    return {server.name, meta["leader"], *(p["name"] for p in meta.get("replicas") or [])}


async def _connects(url: str, creds: Path) -> bool:
    try:
        nc = await nats.connect(
            servers=[url],
            user_credentials=str(creds),
            inbox_prefix=inbox_prefix(str(creds)),
            allow_reconnect=False,
            connect_timeout=2,
        )
    except Exception as exc:  # nats-py raises the server's -ERR as a plain Error
        assert "authorization" in str(exc).lower() or "revoked" in str(exc).lower(), exc
        return False
    await nc.close()
    return True


async def _refused(url: str, creds: Path) -> bool:
    return not await _connects(url, creds)


@dataclass
class Control:
    conn: Connection
    services: list[JoinService]


@pytest.fixture
async def control(machines: Machines4) -> AsyncIterator[Control]:
    """The join services of m1 (its seats, its control dir) and m2; m3 and m4 registered as their own would."""
    directory = machines.setup.directory
    issuers = {role: RoleIssuer.load(directory, role) for role in (Role.AGENT, Role.BUILDER, Role.PROXY)}
    conns: list[Connection] = []
    tasks = []
    services = []
    seats = machines.servers
    for node_id, names in (("m1", ["m1", "m1-seat2", "m1-seat3"]), ("m2", ["m2"])):
        conn = await connect(machines.urls, name=f"join-{node_id}", creds=str(machines.setup.control_creds))
        conns.append(conn)
        own = Machines(
            conn,
            machines.urls,
            directory,
            node_id=node_id,
            client_url=",".join(seats[n].url for n in names if n in seats),
            route_url=",".join(f"nats-route://127.0.0.1:{seats[n].cluster_port}" for n in names if n in seats),
            server_names=names,
            control_dir=machines.first.layout.control if node_id == "m1" else None,
        )
        service = JoinService(conn, issuers, machines.setup.sentinel_jwt(), machines=own)
        tasks.append(asyncio.create_task(service.run()))
        await asyncio.wait_for(service.ready.wait(), 20)
        services.append(service)
    kv = services[0].kv
    for node_id in ("m3", "m4"):
        server = machines.servers[node_id]
        users = [_user(p) for p in machines.m4_creds[1:]] if node_id == "m4" else []
        await membership.register_server(
            kv, node_id, server.url, f"nats-route://127.0.0.1:{server.cluster_port}", [node_id], users
        )
    await kv.put("token-of-m4", json.dumps({"used_by": "m4", "public_key": _user(machines.m4_creds[0])}).encode())
    try:
        yield Control(conns[0], services)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in conns:
            await conn.close()


async def _ask(machines: Machines4, request: dict[str, Any]) -> dict[str, Any]:
    """As ``zattera nodes remove`` / ``cluster retire-seats`` ask (a request id, asked again with it while no
    answer came): with the operator credential, from a machine that stays (the servers of the machine the
    request removes are left out, docs/cluster.md)."""
    creds = str(machines.setup.operator_creds)
    leaving = str(request.get("node_id", ""))
    urls = [s.url for n, s in machines.servers.items() if MACHINE_OF[n] != leaving and s.pid is not None]
    nc = await nats.connect(servers=urls, user_credentials=creds, inbox_prefix=inbox_prefix(creds))
    try:
        log.info("asking %s through %s", request, nc.connected_url.port if nc.connected_url else "?")
        data = await ask_removal(nc, JOIN_REMOVE_SUBJECT, request, timeout=200)
        log.info("answered %s", data[:200])
    finally:
        await nc.close()
    reply: dict[str, Any] = json.loads(data)
    return reply


async def _lead_on(machines: Machines4, name: str) -> None:
    """Make ``name`` JetStream's meta leader (the worst case for its removal: a meta leader peer-removed would
    stop its meta group and answer every stream request "unavailable" until stopped)."""
    conn = await connect(machines.urls, name="test-lead", creds=str(machines.setup.system_creds))
    body = json.dumps({"placement": {"preferred": name}}).encode()
    try:

        async def leading() -> bool:
            if await membership.meta_leader(conn.nc) == name:
                return True
            with contextlib.suppress(nats.errors.TimeoutError):  # an election under way: asked again
                await conn.nc.request(membership.META_STEPDOWN, body, timeout=5)
            return False

        await eventually(leading, what=f"{name} leading the meta group", timeout=60)
    finally:
        await conn.close()


async def _streams(machines: Machines4) -> list[dict[str, Any]]:
    """Every stream's copies, asked through the servers still running."""
    conn = await connect(machines.urls, name="test-streams", creds=str(machines.setup.control_creds))
    try:
        streams: list[dict[str, Any]] = (await plan(conn.nc))["streams"]
        return streams
    finally:
        await conn.close()


def _by_stream(streams: list[dict[str, Any]]) -> dict[str, set[str]]:
    return {s["stream"]: {MACHINE_OF[n] for n in s["servers"]} for s in streams}


@pytest.mark.timeout(600)
async def test_a_server_machine_removed_and_then_the_first_machines_seats_retired(
    machines: Machines4, control: Control
) -> None:
    m1 = machines.servers["m1"]
    before = (await plan(control.conn.nc))["streams"]
    assert before and {s["replicas"] for s in before} == {3}
    assert all(len(machines) == 3 for machines in _by_stream(before).values()), "one copy per machine"
    assert "m4" in _meta_peers(m1)
    assert all([await _connects(m1.url, creds) for creds in machines.m4_creds])

    # zattera nodes remove m4 (m4 leading the meta group): revoked, peer-removed, every stream back at three
    # copies elsewhere.
    await _lead_on(machines, "m4")
    request_id = new_request_id()
    removed = await _ask(machines, {"node_id": "m4", "request_id": request_id})
    assert "error" not in removed, removed
    assert "repeated" not in removed
    assert removed["peer_removed"] is True and removed["servers"] == ["m4"]
    assert set(removed["revoked"]) == {_user(p) for p in machines.m4_creds}
    assert removed["short"] == [], "every stream keeps its three copies on the remaining machines"
    machines.servers["m4"].stop()  # the operator stops the removed machine
    assert "m4" not in _meta_peers(m1) and "m4" not in _meta_peers(machines.servers["m2"])
    for server in (m1, machines.servers["m2"], machines.servers["m3"]):
        for creds in machines.m4_creds:
            # The agent's at once; the control and system ones just after the answer (see push_accounts).
            is_refused = functools.partial(_refused, server.url, creds)
            await eventually(is_refused, what=f"{creds.name} refused by {server.name}")
    after = await _streams(machines)
    for stream, on in _by_stream(after).items():
        assert "m4" not in on and len(on) == 3, (stream, on)
    assert all(s["current"] == 3 for s in after)
    assert "m4" not in await membership.servers(control.services[0].kv)
    # Asked again with the same request id (an answer lost on its way back): the first answer, nothing run again.
    again = await _ask(machines, {"node_id": "m4", "request_id": request_id})
    assert again == {**removed, "repeated": True}

    # Two server machines would be left for three copies: refused, nothing changed.
    refused = await _ask(machines, {"node_id": "m3"})
    assert "would leave 2 server machine(s) for streams of 3 copies" in refused["error"], refused
    assert "m3" in _meta_peers(m1) and "m3" in await membership.servers(control.services[0].kv)

    # zattera cluster retire-seats (a seat leading the meta group): m1's extra seats leave; its supervisor stops
    # them.
    await _lead_on(machines, "m1-seat2")
    retired = await _ask(machines, {"seats": True})
    assert "error" not in retired, retired
    assert (retired["node_id"], retired["retired"]) == ("m1", ["m1-seat2", "m1-seat3"])
    assert retired["short"] == []
    marker = machines.first.layout.control / RETIRED_SEATS_FILE
    assert json.loads(marker.read_text()) == ["m1-seat2", "m1-seat3"]
    machines.first.stop_retired_seats()
    assert [s.name for s in machines.first.cluster_servers] == ["m1"]
    assert machines.servers["m1-seat2"].pid is None and machines.servers["m1-seat3"].pid is None
    assert _meta_peers(m1) == {"m1", "m2", "m3"} == _meta_peers(machines.servers["m2"])
    streams = await _streams(machines)
    assert all(on == {"m1", "m2", "m3"} for on in _by_stream(streams).values()), _by_stream(streams)
    assert all(s["current"] == 3 and s["leader"] for s in streams)
    record = (await membership.servers(control.services[0].kv))["m1"]
    assert record["names"] == ["m1"] and record["client_url"] == m1.url

    again = await _ask(machines, {"seats": True})
    assert "no server machine has extra seats" in again["error"]
    kv = await control.conn.js.key_value("zattera-state")
    await kv.put("node.after", b"written")  # the cluster of three machines still writes
    assert (await kv.get("node.after")).value == b"written"


def test_the_first_machine_starts_one_seat_once_its_seats_are_retired(tmp_path: Path) -> None:
    first = Machine("m1", "server", "127.0.0.1")
    assert machine_cluster(tmp_path, first).machine["seats"]["size"] == 3
    marker = Cluster(data_dir=tmp_path).layout.control / RETIRED_SEATS_FILE
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(["m1-seat2", "m1-seat3"]))
    seats = machine_cluster(tmp_path, first).machine["seats"]
    assert (seats["size"], seats["names"]) == (1, ["m1"])
