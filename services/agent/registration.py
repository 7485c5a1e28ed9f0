"""Node registration: the agent writes its own ``node.<id>`` at start.

A node registers ALIVE and schedulable. On re-registration
(a daemon restart) it keeps its ``schedulable`` flag (a cordon survives) and the operator's labels, and
its status is reset to ALIVE. Capacity, os/arch and roles always come from the host and the flags.

Self-asserted labels: ``zattera.dev/os-arch`` always, and ``builder=true`` on a builder, except that an
operator's ``builder=false`` is kept (a restart does not revert it). An agent started without ``--builder`` drops a
``builder=true`` left by an earlier run, since nothing on this node would answer build requests.

The write is a single-key compare-and-set against the key's current revision, read from the server
(not the view, which may lag): on a conflict (an operator cordoned the node meanwhile) it re-reads and
retries, so the operator's change is merged, never overwritten.
"""

from __future__ import annotations

import logging
import platform
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import Clock, stamp
from shared.connection import Connection
from shared.jetstream import read_state_key
from shared.records import new_meta
from shared.retry import Attempt, RetriesExhausted, commit_with_retry
from shared.txn import Writer
from shared.version import zattera_version

log = logging.getLogger(__name__)

OS_ARCH_LABEL = "zattera.dev/os-arch"
BUILDER_LABEL = "builder"
ROLE_NAMES: Mapping[str, int] = {"worker": pb.NODE_ROLE_WORKER, "control": pb.NODE_ROLE_CONTROL}

_ARCH_ALIASES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm"}


def host_os_arch() -> str:
    """The host's platform as an OCI ``os/arch`` string, e.g. ``linux/amd64``."""
    machine = platform.machine().lower()
    return f"{platform.system().lower()}/{_ARCH_ALIASES.get(machine, machine)}"


def default_node_id() -> str:
    """The short host name, made a valid node id (a key and subject token)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0].lower()) or "node"


@dataclass(frozen=True)
class NodeIdentity:
    """What this agent asserts about its node."""

    node_id: str
    os_arch: str
    cpu_millis: int
    memory_mb: int
    disk_mb: int
    labels: Mapping[str, str] = field(default_factory=dict)
    roles: tuple[int, ...] = (pb.NODE_ROLE_WORKER,)
    builder: bool = False
    name: str = ""
    mesh_ip: str = ""
    version: str = ""
    runtime: str = "process"
    """How instances run here: process or docker (``launchers.py``)."""
    isolation: str = ""
    """How they are isolated: sandbox, container or none (``sandbox.py``)."""
    isolation_problem: str = ""
    """Why not, for none."""
    runtime_reason: str = ""
    """Why this runtime (``runtime_choice.choose_launcher``)."""
    wireguard_public_key: str = ""
    public_endpoints: tuple[str, ...] = ()
    """The mesh (services/agent/mesh.py): this node's WireGuard key and where other nodes reach it."""
    secrets_public_key: bytes = b""
    """The public half of the key pair the agent made for this registration (private half in memory only)."""

    @classmethod
    def from_host(
        cls,
        node_id: str,
        data_dir: Path,
        *,
        labels: Mapping[str, str] | None = None,
        roles: Iterable[str] = ("worker",),
        builder: bool = False,
        mesh_ip: str = "",
    ) -> NodeIdentity:
        data_dir.mkdir(parents=True, exist_ok=True)
        return cls(
            node_id=node_id,
            os_arch=host_os_arch(),
            cpu_millis=(psutil.cpu_count(logical=True) or 1) * 1000,
            memory_mb=psutil.virtual_memory().total // (1024 * 1024),
            disk_mb=psutil.disk_usage(str(data_dir)).total // (1024 * 1024),
            labels=dict(labels or {}),
            roles=tuple(ROLE_NAMES[r] for r in dict.fromkeys(roles)),
            builder=builder,
            name=socket.gethostname(),
            mesh_ip=mesh_ip,
            version=zattera_version(),
        )


def registered_node(identity: NodeIdentity, existing: pb.Node | None, now: float) -> pb.Node:
    """The node record to write, given what is stored (None on first registration)."""
    node = pb.Node()
    if existing is not None:
        node.CopyFrom(existing)
        stamp(node.meta.updated_at, now)
    else:
        new_meta(node.meta, now, identity.node_id)
        node.schedulable = True
    node.status = pb.NODE_STATUS_ALIVE
    node.os_arch = identity.os_arch
    node.capacity.cpu_millis = identity.cpu_millis
    node.capacity.memory_mb = identity.memory_mb
    node.capacity_disk_mb = identity.disk_mb
    del node.roles[:]
    node.roles.extend(identity.roles)  # type: ignore[arg-type]
    node.name = identity.name
    node.mesh_ip = identity.mesh_ip
    node.binary_version = identity.version
    node.secrets_public_key = identity.secrets_public_key
    node.wireguard_public_key = identity.wireguard_public_key
    del node.public_endpoints[:]
    node.public_endpoints.extend(identity.public_endpoints)
    node.runtime = identity.runtime
    node.isolation = identity.isolation
    node.isolation_problem = identity.isolation_problem
    node.runtime_reason = identity.runtime_reason
    node.labels.update(identity.labels)
    node.labels[OS_ARCH_LABEL] = identity.os_arch
    if identity.builder:
        if node.labels.get(BUILDER_LABEL) != "false":
            node.labels[BUILDER_LABEL] = "true"
    elif node.labels.get(BUILDER_LABEL) == "true":
        del node.labels[BUILDER_LABEL]
    return node


async def _read_node(conn: Connection, node_id: str) -> tuple[pb.Node | None, int]:
    """The stored node and the revision a compare-and-set must expect (a delete marker counts)."""
    last = await read_state_key(conn.js, K.node(node_id))  # a direct get: what an agent may read of its node
    return (None if last.data is None else pb.Node.FromString(last.data)), last.revision


async def register_node(conn: Connection, writer: Writer, identity: NodeIdentity, clock: Clock) -> pb.Node:
    """Create or refresh ``node.<id>``; returns what was written."""

    async def decide() -> Attempt[pb.Node]:
        existing, revision = await _read_node(conn, identity.node_id)
        node = registered_node(identity, existing, clock.now())
        return Attempt(writer.txn("register").put(node, expect=revision), node)

    try:
        node = await commit_with_retry(writer, decide, clock=clock, contended=f"node {identity.node_id}")
    except RetriesExhausted:
        raise RuntimeError(f"could not register node {identity.node_id}: it kept changing") from None
    log.info(
        "registered node %s (%s, %d mCPU, %d MB, labels %s)",
        identity.node_id,
        identity.os_arch,
        identity.cpu_millis,
        identity.memory_mb,
        dict(node.labels),
    )
    return node
