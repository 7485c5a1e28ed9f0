"""Private networking, the pure part (docs/networking.md): addresses, policy and what an app is told.

Every env with declared ports holds a VIP ``127.128.a.b`` (``vip.<env_id>``, the routes service: loopback, so it
never leaves the machine; nothing listens on it, it names the env). On a node,
each *consumer* env (one with instances here) gets a slot ``c`` (1..126) and sees each env it may reach at
its own loopback address ``127.(128+c).a.b``, on the target's declared container ports. Why per consumer:
on loopback the kernel gives every client the source address 127.0.0.1, so the forwarder could not tell
which env is connecting; with one address per (consumer, target) pair the address the connection arrived
on says it, and a pair the policy refuses has no listener at all (connection refused, nothing to check
per connection). All of 127/8 is routed to ``lo`` on Linux: no setup, no root.

Its resolver answers at ``127.(128+c).0.1`` (``b`` = 1 is never a VIP host), so the same query gets each
consumer its own answers: ``<app>.<env>.<project>.internal`` → the consumer's address of that env.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.errors import ZatteraError

MAX_SLOTS = 126
CONSUMER_BASE = 128  # consumer c's addresses are 127.(128 + c).a.b
RESOLVER_HOST = (0, 1)  # 127.(128 + c).0.1: never a VIP (VIP hosts are .2-.254)
HTTP_PORT = "http"
HTTP_DEFAULT_PORT = 80  # an "http" port declared without container_port (the zattera.toml default) is served on 80
_ENV_NAME = re.compile(r"[^A-Z0-9]")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class NetworkError(ZatteraError, ValueError):
    """A malformed name or address in private networking."""


@dataclass(frozen=True, slots=True)
class Consumer:
    """An env with instances on this node, as the forwarder serves it."""

    env_id: str
    project_id: str
    allow: frozenset[str] = frozenset()  # "project/app/env" of other projects' envs


@dataclass(frozen=True, slots=True)
class Target:
    """One env reachable by VIP (an ``InternalService`` of the route snapshot)."""

    env_id: str
    project_id: str
    path: str  # "project/app/env"
    vip: str
    ports: tuple[tuple[str, int, bool], ...]  # (name, port, http)
    scale_to_zero: bool


def fqdn_path(fqdn: str) -> str:
    """``app.env.project.internal.`` → ``project/app/env``; raises :class:`NetworkError` on a bad name."""
    labels = fqdn.rstrip(".").lower().split(".")
    if len(labels) != 4 or labels[3] != "internal" or not all(_NAME.match(label) for label in labels[:3]):
        raise NetworkError(f"{fqdn!r} is not <app>.<env>.<project>.internal")
    app, env, project = labels[:3]
    return f"{project}/{app}/{env}"


def targets_of(snapshot: cpb.RouteSnapshot) -> list[Target]:
    """The snapshot's internal services as targets (a service with a malformed name or VIP is skipped).
    A port named "http" is told as an ``http://`` URL (internal ports carry "tcp" whatever they declare) and,
    declared without a number, is served on port 80; another port without a number is not served."""
    targets = []
    for service in snapshot.internal_services:
        try:
            path = fqdn_path(service.fqdn)
            vip_octets(service.vip)
        except NetworkError:
            continue
        ports = tuple(
            (port.name, number, port.name == HTTP_PORT)
            for port in service.ports
            if (number := served_port(port.name, port.port))
        )
        targets.append(
            Target(service.environment_id, service.project_id, path, service.vip, ports, service.scale_to_zero)
        )
    return targets


def served_port(name: str, number: int) -> int:
    """The port an env's declared port is reached on (0: not served)."""
    return number or (HTTP_DEFAULT_PORT if name == HTTP_PORT else 0)


def vip_octets(vip: str) -> tuple[int, int]:
    """The two host octets ``a.b`` of a VIP ``x.y.a.b`` (host part 2..254)."""
    try:
        address = ipaddress.IPv4Address(vip)
    except ValueError:
        raise NetworkError(f"VIP {vip!r} is not an IPv4 address") from None
    a, b = address.packed[2], address.packed[3]
    if not 2 <= b <= 254:
        raise NetworkError(f"VIP {vip!r} has a reserved host part")
    return a, b


def consumer_address(slot: int, vip: str) -> str:
    """Where consumer ``slot`` reaches the env holding ``vip``."""
    a, b = vip_octets(vip)
    return f"127.{CONSUMER_BASE + slot}.{a}.{b}"


def resolver_address(slot: int) -> str:
    return f"127.{CONSUMER_BASE + slot}.{RESOLVER_HOST[0]}.{RESOLVER_HOST[1]}"


def slot_of_address(address: str) -> int | None:
    """The consumer slot a local address belongs to (None: not a consumer address)."""
    parts = address.split(".")
    if len(parts) != 4 or parts[0] != "127" or not parts[1].isdigit():
        return None
    slot = int(parts[1]) - CONSUMER_BASE
    return slot if 1 <= slot <= MAX_SLOTS else None


def allowed(consumer: Consumer, target: Target) -> bool:
    """The policy: an env reaches its own project's envs, and the other envs its allowlist names."""
    return target.project_id == consumer.project_id or target.path in consumer.allow


def consumer_of(assignment: pb.Assignment, release: pb.Release) -> Consumer:
    return Consumer(assignment.environment_id, assignment.project_id, frozenset(release.service.network.allow))


@dataclass
class SlotTable:
    """Consumer slots of this node: the lowest free one for a new env, kept while the env has instances."""

    consumers: dict[int, Consumer] = field(default_factory=dict)

    def slot(self, consumer: Consumer) -> int:
        """The env's slot (its record updated: a new release may change its allowlist)."""
        for slot, known in self.consumers.items():
            if known.env_id == consumer.env_id:
                self.consumers[slot] = consumer
                return slot
        free = next((slot for slot in range(1, MAX_SLOTS + 1) if slot not in self.consumers), None)
        if free is None:
            raise NetworkError(f"more than {MAX_SLOTS} envs on this node use private networking")
        self.consumers[free] = consumer
        return free

    def keep_only(self, env_ids: Iterable[str]) -> bool:
        """Free the slots of envs no longer on this node; True when one was freed."""
        keep = set(env_ids)
        gone = [slot for slot, consumer in self.consumers.items() if consumer.env_id not in keep]
        for slot in gone:
            del self.consumers[slot]
        return bool(gone)


Listen = tuple[str, int]
"""A listening address and port."""


def listeners(slots: Mapping[int, Consumer], targets: Iterable[Target]) -> dict[Listen, tuple[str, str]]:
    """Every (address, port) the forwarder listens on → (target env id, port name): each consumer's
    address of each target the policy lets it reach, on each of the target's ports."""
    wanted: dict[Listen, tuple[str, str]] = {}
    target_list = list(targets)
    for slot, consumer in slots.items():
        for target in target_list:
            if allowed(consumer, target):
                address = consumer_address(slot, target.vip)
                for name, port, _ in target.ports:
                    wanted[(address, port)] = (target.env_id, name)
    return wanted


def resolve(slot: int, consumer: Consumer, targets: Iterable[Target], name: str) -> str | None:
    """The A record a consumer gets for ``name``; None = no such name for it (NXDOMAIN)."""
    try:
        path = fqdn_path(name)
    except NetworkError:
        return None
    for target in targets:
        if target.path == path and allowed(consumer, target):
            return consumer_address(slot, target.vip)
    return None


def _env_part(text: str) -> str:
    return _ENV_NAME.sub("_", text.upper())


def service_env(slot: int, consumer: Consumer, targets: Iterable[Target], dns_port: int) -> dict[str, str]:
    """What an app is told (docs/networking.md): its resolver and, per env it may reach,
    ``ZATTERA_SERVICE_<APP>_<ENV>_{HOST,PORT,URL,PORT_<NAME>}`` (other projects' envs:
    ``ZATTERA_SERVICE_<PROJECT>_<APP>_<ENV>_...``)."""
    env = {"ZATTERA_DNS": f"{resolver_address(slot)}:{dns_port}"} if dns_port else {}
    for target in sorted(targets, key=lambda t: t.path):
        if not allowed(consumer, target) or not target.ports:
            continue
        project, app, env_name = target.path.split("/")
        parts = [app, env_name] if target.project_id == consumer.project_id else [project, app, env_name]
        prefix = "ZATTERA_SERVICE_" + "_".join(_env_part(part) for part in parts)
        host = consumer_address(slot, target.vip)
        name, port, http = target.ports[0]
        env[f"{prefix}_HOST"] = host
        env[f"{prefix}_PORT"] = str(port)
        env[f"{prefix}_URL"] = f"{'http' if http else 'tcp'}://{host}:{port}"
        for name, port, _ in target.ports:
            env[f"{prefix}_PORT_{_env_part(name)}"] = str(port)
    return env
