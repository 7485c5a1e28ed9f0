"""One machine of a cluster of machines: what ``zattera up --name N --advertise IP`` (the first server),
``zattera up --join TOKEN --server`` (another server) and ``zattera up --join TOKEN`` (a worker) run.

A *server machine* runs a NATS server that is a member of the cluster's routes (client port 4222 and route
port 6222 on its advertised address, monitoring on 127.0.0.1), the whole control plane (one more replica of
every service: leader loops take turns through their leases) with the control credential, and the node: an
agent (a builder) and the proxy, with credentials of their own. A *worker machine* runs the agent and the
proxy, connected to the servers. The join happens once: the token is exchanged for credentials (and, for a
server, the cluster's trust root), everything is written under the data dir and ``machine.json`` records it
last; a later ``zattera up`` with the same data dir resumes the machine (the token is not used again). A
refused or unreachable join writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cli.layout import NODE_CREDS, PROXY_CREDS, DataLayout
from cli.supervised import Supervised
from cli.up_cluster import Cluster
from services.join.__main__ import (
    MACHINE_CLIENT_URL_ENV,
    MACHINE_MESH_IP_ENV,
    MACHINE_NODE_ENV,
    MACHINE_ROUTE_URL_ENV,
    MACHINE_SERVER_NAMES_ENV,
)
from shared.embedded import RETIRED_SEATS_FILE, SERVER_DIR
from shared.errors import ZatteraError
from shared.security.creds import creds_text, write_private
from shared.security.join import JoinRefused, JoinUnavailable
from shared.security.join_client import exchange
from shared.security.machines import MachineToken, MachineTokenError, open_bundle
from shared.security.membership import MESH_NETWORK
from shared.security.nkeyjwt import KeyKind, KeyPair
from shared.security.permissions import Role
from shared.security.setup import prepare

MACHINE_FILE = "machine.json"
CLIENT_PORT = 4222
ROUTE_PORT = 6222
CLUSTER_NAME = "zattera"
JOIN_TIMEOUT = 10.0
FIRST_MESH_IP = f"{MESH_NETWORK}.0.1"
"""The first server machine's mesh address (its join service records it before anyone else joins)."""


class MachineError(ZatteraError):
    """The machine cannot join or start as asked; the message names the problem in one line."""


@dataclass
class Machine:
    """What a machine is, recorded in ``<data dir>/machine.json``."""

    node_id: str
    role: str  # "server" or "worker"
    advertise: str
    servers: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)
    mesh_ip: str = ""
    tls: bool = False

    @classmethod
    def load(cls, data_dir: Path) -> Machine | None:
        path = data_dir / MACHINE_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else None

    def save(self, data_dir: Path) -> None:
        write_private(data_dir / MACHINE_FILE, json.dumps(asdict(self), indent=2))

    @property
    def client_url(self) -> str:
        return f"nats://{self.advertise}:{CLIENT_PORT}"

    @property
    def route_url(self) -> str:
        return f"nats-route://{self.advertise}:{ROUTE_PORT}"


SEATS = 3
"""The first server machine holds three seats of the JetStream cluster (three NATS servers, its client ports
4222-4224, route ports 6222-6224): JetStream needs a quorum from the start, and nats-server cannot turn a
single server's store into a cluster's. ``unique_tag`` keeps two replicas of a stream off one machine, so
streams stay at one replica until other server machines join and ``zattera cluster replicas 3``."""


def bootstrap(data_dir: Path, node_id: str, advertise: str, *, tls: bool) -> Machine:
    """The first server machine (``zattera up --secure --name N --advertise IP``): a cluster of one that others
    join. Resumes the recorded machine when there is one."""
    existing = Machine.load(data_dir)
    if existing is not None:
        if existing.node_id != node_id:
            raise MachineError(f"{data_dir} holds machine {existing.node_id}, not {node_id}")
        return existing
    machine = Machine(node_id, "server", advertise, tls=tls, mesh_ip=FIRST_MESH_IP)
    machine.save(data_dir)
    return machine


def join(data_dir: Path, token_text: str, node_id: str, advertise: str, *, server: bool) -> Machine:
    """Exchange a machine token once; see the module docstring. Raises :class:`MachineError` (one line)."""
    existing = Machine.load(data_dir)
    if existing is not None:
        if existing.node_id != node_id:
            raise MachineError(f"{data_dir} already holds machine {existing.node_id}, not {node_id}")
        return existing
    try:
        token = MachineToken.parse(token_text)
    except MachineTokenError as exc:
        raise MachineError(str(exc)) from None
    agent_key, proxy_key = KeyPair.generate(KeyKind.USER), KeyPair.generate(KeyKind.USER)
    request = {"node_id": node_id, "public_key": agent_key.public_key, "proxy_public_key": proxy_key.public_key}
    with tempfile.TemporaryDirectory() as scratch:
        ca = ""
        if token.ca_pem:
            ca = str(write_private(Path(scratch) / "ca.pem", token.ca_pem))
        try:
            reply = asyncio.run(exchange(list(token.urls), token.join_token, request, tls_ca=ca, timeout=JOIN_TIMEOUT))
        except JoinUnavailable as exc:
            named = ", ".join(token.urls)
            raise MachineError(f"cannot join: the cluster's servers ({named}) are unreachable: {exc}") from None
        except JoinRefused as exc:
            raise MachineError(f"join refused: {exc}") from None
    if server and not reply.get("bundle"):
        raise MachineError("join refused: this is a worker's token; a server needs zattera nodes join-token --server")
    if not server and reply.get("bundle"):
        raise MachineError("this is a server machine's token: add --server (it was used: ask for a new one)")
    layout = DataLayout(data_dir)  # the node's own credentials in its own directories (cli/layout.py)
    security = layout.security
    write_private(layout.agent / NODE_CREDS, creds_text(str(reply["jwt"]), agent_key.seed))
    write_private(layout.proxy / PROXY_CREDS, creds_text(str(reply["proxy_jwt"]), proxy_key.seed))
    if token.ca_pem:
        write_private(security / "tls" / "ca.pem", token.ca_pem)
    if server:
        try:
            open_bundle(token.secret, str(reply["bundle"]), security)
        except MachineTokenError as exc:
            raise MachineError(str(exc)) from None
    servers = [str(u) for u in reply.get("servers") or token.urls]
    if server and not reply.get("routes"):  # a server machine with no routes would start a cluster of its own
        raise MachineError("cannot join as a server machine: the cluster named no server routes to join")
    machine = Machine(
        node_id,
        "server" if server else "worker",
        advertise,
        servers=servers,
        routes=[str(r) for r in reply.get("routes") or []],
        mesh_ip=str(reply.get("mesh_ip") or ""),
        tls=bool(token.ca_pem),
    )
    machine.save(data_dir)
    return machine


def machine_cluster(data_dir: Path, machine: Machine, **options: Any) -> Cluster:
    """The :class:`Cluster` that runs ``machine`` (``options``: the proxy's and metrics' settings)."""
    layout = DataLayout(data_dir)
    security = layout.security
    own_creds = {"agent": str(layout.agent / NODE_CREDS), "proxy": str(layout.proxy / PROXY_CREDS)}
    agent_args = ["--mesh-ip", machine.mesh_ip] if machine.mesh_ip else []
    agent_args += ["--public-endpoint", machine.advertise]
    if machine.role == "worker":
        ca = security / "tls" / "ca.pem"
        return Cluster(
            data_dir=data_dir,
            services=[],
            node_id=machine.node_id,
            tls_ca=str(ca) if ca.exists() else "",
            node_creds=own_creds,
            machine={"servers": machine.servers, "agent_args": agent_args},
            **options,
        )
    hosts = [machine.advertise, "127.0.0.1", "localhost"]
    setup = prepare(security, tls=machine.tls, hosts=hosts)
    if not (layout.agent / NODE_CREDS).exists():  # the first server: its own node's, issued here
        setup.issue(Role.BUILDER, machine.node_id, layout.agent / NODE_CREDS)
        setup.issue(Role.PROXY, machine.node_id, layout.proxy / PROXY_CREDS)
    node_creds = own_creds
    routes = setup.route_security()
    tags = f'server_tags: ["machine:{machine.node_id}"]\n'
    extra = setup.server_config(resolver_dir=f"{SERVER_DIR}/jwt") + tags
    env = {
        MACHINE_MESH_IP_ENV: machine.mesh_ip,
        MACHINE_NODE_ENV: machine.node_id,
        MACHINE_CLIENT_URL_ENV: machine.client_url,
        MACHINE_ROUTE_URL_ENV: machine.route_url,
        MACHINE_SERVER_NAMES_ENV: machine.node_id,
    }
    join_service = Supervised("join", [sys.executable, "-m", "services.join"], layout.logs / "join.log", {})
    common: dict[str, Any] = {"servers": machine.servers, "agent_args": [*agent_args, "--builder"], "env": env}
    if not machine.routes:  # the first server machine
        # Its extra seats, once retired (``zattera cluster retire-seats``), are not started again.
        names = [machine.node_id, *(f"{machine.node_id}-seat{i}" for i in range(2, SEATS + 1))]
        retired = layout.control / RETIRED_SEATS_FILE
        size = 1 if retired.exists() and set(json.loads(retired.read_text())) >= set(names[1:]) else SEATS
        seats = {
            "size": size,
            "name": CLUSTER_NAME,
            "host": machine.advertise,
            "ports": (CLIENT_PORT, ROUTE_PORT),
            "names": names[:size],
            "unique_tag": "machine:",
        }
        env[MACHINE_SERVER_NAMES_ENV] = ",".join(names)
        env[MACHINE_CLIENT_URL_ENV] = ",".join(f"nats://{machine.advertise}:{CLIENT_PORT + i}" for i in range(SEATS))
        env[MACHINE_ROUTE_URL_ENV] = ",".join(
            f"nats-route://{machine.advertise}:{ROUTE_PORT + i}" for i in range(SEATS)
        )
        return Cluster(
            data_dir=data_dir,
            node_id=machine.node_id,
            extra=[join_service],
            nats_extra_config=extra,
            nats_routes=asdict(routes),
            creds=str(setup.control_creds),
            tls_ca=str(setup.tls_ca or ""),
            node_creds=node_creds,
            machine={"seats": seats, **common},
            **options,
        )
    nats = {
        "name": machine.node_id,
        "host": machine.advertise,
        "port": CLIENT_PORT,
        "http_host": "127.0.0.1",
        "cluster_name": CLUSTER_NAME,
        "cluster_port": ROUTE_PORT,
        "routes": [r for r in machine.routes if r != machine.route_url],
        "route_user": routes.user,
        "route_password": routes.password,
        "cluster_extra": routes.cluster_config,
        "unique_tag": "machine:",
    }
    return Cluster(
        data_dir=data_dir,
        node_id=machine.node_id,
        extra=[join_service],
        nats_extra_config=extra,
        creds=str(setup.control_creds),
        tls_ca=str(setup.tls_ca or ""),
        node_creds=node_creds,
        machine={"nats": nats, **common},
        **options,
    )
