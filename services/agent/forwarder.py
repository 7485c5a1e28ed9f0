"""The node forwarder (docs/networking.md): each consumer env's addresses of the envs it may reach → the
healthy endpoints of those envs, following the route snapshots; and each consumer's resolver.

* Listeners: :func:`services.agent.network.listeners` of the consumers on this node and the snapshot's
  internal services, re-derived on every snapshot and every new consumer (bound before the consumer's
  instance starts). The policy is in that set: a pair it refuses has no listener.
* A connection goes to an endpoint of the target's port in the newest snapshot (round robin, the next one
  when a connect fails): endpoint changes are a table swap, so they apply as fast as snapshots arrive.
* Drain: a connection keeps its endpoint until either side closes, whatever later snapshots say; only new
  connections follow them (the agent stops a replica only after the drain window, or once no proxy and
  no forwarder reports anything open to it: :meth:`Forwarder.old_connections`, in the node's heartbeat).
* Wake on connect: a scale-to-zero env with no endpoint holds the connection (nothing read from it) and
  asks the activator, retrying while held, until an endpoint appears or ``hold_timeout`` passes; beyond
  ``max_held_per_env`` waiting connections, more are closed at once.
* Consumers are kept in ``state_path`` so an agent restarted with adopted instances serves the addresses
  those instances were given: a new or changed consumer is on disk before its instance gets its variables.
  The table is written only when it changed, off the event loop, by one writer at a time: the changes made
  while a write is under way go to disk together in the next one (many instances starting at once cost
  one or two writes, not one each).
* Kernel path (``kernel``, :mod:`services.agent.kernelnet`): where iptables can be used, each listened pair
  whose target has endpoints is also a DNAT rule, re-pointed with every snapshot: connections to it are
  translated by the kernel and never reach the listener (which still holds a scale-to-zero env's
  connections, and carries everything when iptables is missing or fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.kernelnet import CONNTRACK, KernelPath, KernelPathError, dnats, unavailable
from services.agent.kernelnet import old_connections as kernel_old_connections
from services.agent.network import (
    Consumer,
    Listen,
    NetworkError,
    SlotTable,
    Target,
    consumer_of,
    listeners,
    resolve,
    resolver_address,
    service_env,
    targets_of,
)
from shared.backoff import Backoff
from shared.files import write_atomic
from shared.tasks import Signal, raise_if_cancelling

log = logging.getLogger(__name__)

HOLD_TIMEOUT = 60.0
MAX_HELD_PER_ENV = 100  # as the proxies: more connections waiting for one cold env are closed at once
CONNECT_TIMEOUT = 5.0
ACTIVATE_RETRY_INITIAL = 0.5
ACTIVATE_RETRY_MAX = 5.0
DNS_TTL = 5

Activate = Callable[[str], Awaitable[object]]
"""Asks the control plane to wake an env; raises when it must be asked again."""


@dataclass(eq=False, kw_only=True)
class Forwarder:
    activate: Activate | None = None
    dns_port: int = 0
    state_path: Path | None = None
    hold_timeout: float = HOLD_TIMEOUT
    max_held_per_env: int = MAX_HELD_PER_ENV
    connect_timeout: float = CONNECT_TIMEOUT
    kernel: KernelPath | None = None

    def __post_init__(self) -> None:
        self.slots = SlotTable(_load_consumers(self.state_path))
        self.version = 0
        self._targets: list[Target] = []
        self._by_env: dict[str, Target] = {}
        self._endpoints: dict[tuple[str, str], list[str]] = {}
        self._turn = itertools.count()
        self._routes: dict[Listen, tuple[str, str]] = {}
        self._servers: dict[Listen, asyncio.Server] = {}
        self._resolvers: dict[int, asyncio.DatagramTransport] = {}
        self._sync_lock = asyncio.Lock()
        self._changed = Signal()
        self._applied = Signal()
        self._activations: dict[str, asyncio.Task[None]] = {}
        self._held: dict[str, int] = {}
        self._connections: set[asyncio.Task[None]] = set()  # being joined to an endpoint
        self._pipes: weakref.WeakSet[_Pipe] = weakref.WeakSet()  # accepted, open or not yet collected
        self._outbound: weakref.WeakSet[_Pipe] = weakref.WeakSet()  # joined to an endpoint (its ``route``)
        self._changes = 0  # of the consumer table, counted; ``_saved``: as many are on disk
        self._saved = 0
        self._saving: asyncio.Task[None] | None = None
        self.activations_sent = 0
        self.refused = 0
        self.kernel_active = False
        self.path = "user-space forwarder"
        """Which path carries connections to endpoints: "kernel (iptables DNAT)" or "user-space forwarder"."""

    async def start_kernel(self) -> str:
        """Install the kernel path's chains when there is one to install; returns :attr:`path`."""
        if self.kernel is None:
            return self.path
        why = unavailable()
        if not why:
            try:
                await asyncio.to_thread(self.kernel.install)
                self.kernel_active = True
                self.path = "kernel (iptables DNAT)"
                await self._sync()
                return self.path
            except KernelPathError as exc:
                why = str(exc)
                await asyncio.to_thread(self.kernel.remove)
                self.kernel_active = False
        self.path = f"user-space forwarder ({why})"
        return self.path

    # ------------------------------------------------------------------ following the snapshots

    async def run(self, snapshots: AsyncIterator[cpb.RouteSnapshot], local_envs: Callable[[], Iterable[str]]) -> None:
        """Apply every snapshot; consumers whose env left this node (``local_envs``) lose their slot."""
        async for snapshot in snapshots:
            if self.slots.keep_only(local_envs()):
                self._changes += 1
                await self._persist()
            await self.apply(snapshot)

    async def apply(self, snapshot: cpb.RouteSnapshot) -> None:
        targets = targets_of(snapshot)
        endpoints: dict[tuple[str, str], list[str]] = {}
        for service in snapshot.internal_services:
            for port in service.ports:
                endpoints[(service.environment_id, port.name)] = [e.addr for e in port.endpoints if e.healthy]
        self._targets, self._by_env, self._endpoints = targets, {t.env_id: t for t in targets}, endpoints
        self.version = snapshot.version
        self._changed.notify()
        await self._sync()
        self._applied.notify()

    def target(self, env_id: str) -> Target | None:
        """The env as the newest snapshot has it (None: no VIP or not in it)."""
        return self._by_env.get(env_id)

    def endpoints(self, env_id: str, port_name: str) -> list[str]:
        """The addresses new connections to that port of the env go to now."""
        return self._endpoints.get((env_id, port_name), [])

    async def changed(self) -> None:
        """Returns at the next applied snapshot."""
        await self._changed.wait()

    async def applied(self) -> None:
        """Returns once the next snapshot's listeners and kernel rules are in place."""
        await self._applied.wait()

    async def instance_env(self, assignment: pb.Assignment, release: pb.Release) -> dict[str, str]:
        """The variables an instance of ``assignment`` is started with; its listeners are bound first."""
        consumer = consumer_of(assignment, release)
        before = dict(self.slots.consumers)
        try:
            slot = self.slots.slot(consumer)
        except NetworkError as exc:
            log.warning("private networking off for env %s: %s", consumer.env_id, exc)
            return {}
        if self.slots.consumers != before:
            self._changes += 1
        await self._persist()
        await self._sync()
        return service_env(slot, consumer, self._targets, self.dns_port)

    async def _sync(self) -> None:
        """Bind what :func:`listeners` wants and close what it no longer does (open connections stay)."""
        loop = asyncio.get_running_loop()
        async with self._sync_lock:
            wanted = listeners(self.slots.consumers, self._targets)
            self._routes = wanted
            for listen in [listen for listen in self._servers if listen not in wanted]:
                self._servers.pop(listen).close()
            for listen in wanted:
                if listen not in self._servers:
                    try:
                        self._servers[listen] = await loop.create_server(
                            functools.partial(self._accept, listen), listen[0], listen[1]
                        )
                    except OSError as exc:
                        log.warning("forwarder: cannot listen on %s:%d: %s", listen[0], listen[1], exc)
            if self.dns_port:
                await self._sync_resolvers()
            if self.kernel_active and self.kernel is not None:
                await self._sync_kernel(self.kernel)

    async def _sync_kernel(self, kernel: KernelPath) -> None:
        """Re-point the DNAT rules at the newest endpoints (one transaction); on failure fall back for good."""
        try:
            await asyncio.to_thread(kernel.apply, dnats(self._routes, self._endpoints))
        except KernelPathError as exc:
            log.error("forwarder: kernel path failed (%s); the user-space forwarder carries every connection", exc)
            self.kernel_active = False
            self.path = f"user-space forwarder ({exc})"
            await asyncio.to_thread(kernel.remove)

    # ------------------------------------------------------------------ connections

    def _accept(self, listen: Listen) -> _Pipe:
        """A new connection on ``listen``: not read from until it is joined to an endpoint."""
        inbound = _Pipe(functools.partial(self._start_join, listen))
        self._pipes.add(inbound)
        return inbound

    def _start_join(self, listen: Listen, inbound: _Pipe) -> None:
        task = asyncio.create_task(self._join(listen, inbound))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _join(self, listen: Listen, inbound: _Pipe) -> None:
        route = self._routes.get(listen)
        outbound = await self._connect(route) if route is not None else None
        if outbound is None or inbound.lost:
            self.refused += outbound is None
            inbound.close()
            if outbound is not None:
                outbound.close()
            return
        inbound.join(outbound)
        self._outbound.add(outbound)

    def old_connections(self) -> dict[str, int]:
        """Env id → open connections to an endpoint the newest snapshot no longer lists for their port
        (an old release after a promotion, issue 42: the orchestrator's drain waits for them)."""
        old: dict[str, int] = {}
        if self.kernel_active:
            with contextlib.suppress(OSError):
                conntrack = CONNTRACK.read_text(errors="replace")
                old = kernel_old_connections(conntrack, self._routes, self._endpoints)
        for pipe in list(self._outbound):
            if pipe.lost or pipe.route is None:
                continue
            if pipe.addr not in self._endpoints.get(pipe.route, ()):
                old[pipe.route[0]] = old.get(pipe.route[0], 0) + 1
        return old

    async def _connect(self, route: tuple[str, str]) -> _Pipe | None:
        """A connection to an endpoint of ``route``, holding while a scale-to-zero env wakes."""
        addresses = self._endpoints.get(route) or await self._hold(route)
        loop = asyncio.get_running_loop()
        start = next(self._turn)
        for i in range(len(addresses)):
            host, _, port = addresses[(start + i) % len(addresses)].rpartition(":")
            try:
                async with asyncio.timeout(self.connect_timeout):
                    _, pipe = await loop.create_connection(_Pipe, host, int(port))
                pipe.route, pipe.addr = route, f"{host}:{port}"
                return pipe
            except (OSError, TimeoutError, ValueError) as exc:
                log.debug("forwarder: endpoint %s:%s refused (%s), trying the next", host, port, exc)
        return None

    async def _hold(self, route: tuple[str, str]) -> list[str]:
        env_id = route[0]
        target = self._by_env.get(env_id)
        if target is None or not target.scale_to_zero or self.activate is None:
            return []
        if self._held.get(env_id, 0) >= self.max_held_per_env:
            log.warning("forwarder: %d connections already wait for env %s; closing one", self.max_held_per_env, env_id)
            return []
        self._held[env_id] = self._held.get(env_id, 0) + 1
        try:
            if env_id not in self._activations:
                task = asyncio.create_task(self._activate_while_held(env_id))
                self._activations[env_id] = task
                task.add_done_callback(lambda _: self._activations.pop(env_id, None))
            async with asyncio.timeout(self.hold_timeout):
                while not (addresses := self._endpoints.get(route)):
                    await self._changed.wait()
                return addresses
        except TimeoutError:
            log.warning("forwarder: env %s not woken within %.0fs; connection closed", env_id, self.hold_timeout)
            return []
        finally:
            self._held[env_id] -= 1
            if not self._held[env_id]:
                del self._held[env_id]

    async def _activate_while_held(self, env_id: str) -> None:
        assert self.activate is not None
        backoff = Backoff(ACTIVATE_RETRY_INITIAL, ACTIVATE_RETRY_MAX)
        while self._held.get(env_id):
            self.activations_sent += 1
            delay = next(backoff)
            try:
                await self.activate(env_id)
                return
            except Exception as exc:
                raise_if_cancelling()
                log.warning("forwarder: waking env %s failed (%s); retrying in %.1fs while held", env_id, exc, delay)
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ resolver

    async def _sync_resolvers(self) -> None:
        loop = asyncio.get_running_loop()
        for slot in [slot for slot in self._resolvers if slot not in self.slots.consumers]:
            self._resolvers.pop(slot).close()
        for slot in self.slots.consumers:
            if slot not in self._resolvers:
                try:
                    transport, _ = await loop.create_datagram_endpoint(
                        functools.partial(_Resolver, self, slot), local_addr=(resolver_address(slot), self.dns_port)
                    )
                except OSError as exc:
                    log.warning("forwarder: no resolver for slot %d: %s", slot, exc)
                    continue
                self._resolvers[slot] = transport

    def answer(self, slot: int, query: bytes) -> bytes | None:
        """The reply to a DNS query sent to consumer ``slot``'s resolver (None: not a DNS message)."""
        # Here: a node whose envs consume no private service never answers a query (PERFORMANCE.md "A lighter node")
        from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSRecord

        try:
            request = DNSRecord.parse(query)
        except DNSError:
            return None
        reply = request.reply()
        consumer = self.slots.consumers.get(slot)
        question = request.q
        name = str(question.qname).rstrip(".").lower()
        if not name.endswith(".internal"):
            reply.header.rcode = RCODE.REFUSED  # no recursion: only *.internal is answered here
            return bytes(reply.pack())
        address = resolve(slot, consumer, self._targets, name) if consumer is not None else None
        if address is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif question.qtype in (QTYPE.A, QTYPE.ANY):
            reply.add_answer(RR(question.qname, QTYPE.A, rdata=A(address), ttl=DNS_TTL))
        return bytes(reply.pack())

    # ------------------------------------------------------------------ state and shutdown

    async def _persist(self) -> None:
        """Until the consumer table as it is now is on disk (see the module). The one writer task is shielded:
        a caller cancelled meanwhile never leaves a write running beside a newer one."""
        if self.state_path is None:
            return
        wanted = self._changes
        while self._saved < wanted:
            if self._saving is None or self._saving.done():
                self._saving = asyncio.create_task(self._save_consumers(self.state_path), name="forwarder-consumers")
            await asyncio.shield(self._saving)

    async def _save_consumers(self, path: Path) -> None:
        """Write the table until what is on disk has every change counted (a write failing ends it: the
        callers waiting for it get the error, and the next caller starts a new writer)."""
        while self._saved < self._changes:
            changes = self._changes
            data = {
                str(slot): {"env_id": c.env_id, "project_id": c.project_id, "allow": sorted(c.allow)}
                for slot, c in self.slots.consumers.items()
            }
            await asyncio.to_thread(write_atomic, path, json.dumps(data, sort_keys=True).encode())
            self._saved = changes

    def stop(self, *, keep_rules: bool = False) -> None:
        """Close every listener, resolver and connection and cancel the pending work, at once (no await: it
        also runs when the caller is being cancelled again, as on an agent shutdown). The kernel path's rules
        are removed (blocking, a few iptables commands), unless ``keep_rules`` (an agent handing its instances
        over: the next agent takes the chains over)."""
        if self.kernel is not None and self.kernel_active and not keep_rules:
            self.kernel.remove()
        self.kernel_active = False
        for server in self._servers.values():
            server.close()
        for transport in self._resolvers.values():
            transport.close()
        self._servers.clear()
        self._resolvers.clear()
        for pipe in list(self._pipes):
            pipe.close()
        for task in [*self._activations.values(), *self._connections]:
            task.cancel()

    async def close(self) -> None:
        """:meth:`stop`, then wait for the cancelled work to end."""
        pending = [*self._activations.values(), *self._connections]
        self.stop()
        await asyncio.gather(*pending, return_exceptions=True)


class _Resolver(asyncio.DatagramProtocol):
    def __init__(self, forwarder: Forwarder, slot: int) -> None:
        self.forwarder = forwarder
        self.slot = slot
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        reply = self.forwarder.answer(self.slot, data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class _Pipe(asyncio.Protocol):
    """One side of a forwarded connection: what it receives is written to its peer, with the peer's flow
    control (a full peer pauses reading here); an end of input is passed on as a half close, and the
    connection is closed once both sides ended or either is lost."""

    def __init__(self, on_made: Callable[[_Pipe], None] | None = None) -> None:
        self.on_made = on_made
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.ended = False
        self.lost = False
        self.route: tuple[str, str] | None = None
        """An outbound side: the (env id, port name) and the endpoint address it was connected to."""
        self.addr = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.peer is None:
            self.transport.pause_reading()  # until joined: a held connection is not read
        if self.on_made is not None:
            self.on_made(self)

    def join(self, peer: _Pipe) -> None:
        self.peer, peer.peer = peer, self
        for pipe in (self, peer):
            if pipe.transport is not None:
                pipe.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)

    def eof_received(self) -> bool:
        self.ended = True
        peer = self.peer
        if peer is None or peer.transport is None or peer.ended or not peer.transport.can_write_eof():
            self.close()
            return False
        peer.transport.write_eof()
        return True  # the other direction may still carry data

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.peer is not None:
            self.peer.close()

    def close(self) -> None:
        """Close both sides (what was written is flushed first)."""
        for pipe in (self, self.peer):
            if pipe is not None and pipe.transport is not None:
                pipe.transport.close()


def _load_consumers(path: Path | None) -> dict[int, Consumer]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_bytes())
        return {int(slot): Consumer(c["env_id"], c["project_id"], frozenset(c["allow"])) for slot, c in data.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("forwarder state %s unreadable, starting without consumers: %s", path, exc)
        return {}
