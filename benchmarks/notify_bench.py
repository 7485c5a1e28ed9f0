"""Notifications and the audit log (issue 38 item 5, their half), in one run.

* **event → notification**: the secrets service's ``notify`` loop (``services/secrets/notify.py``, the product
  code: durable consumer on the events stream, sealed channel settings, HMAC-signed POST) delivering to an
  HTTP receiver on loopback that verifies every signature. 200 ``deploy.failed`` events (full: 1,000), one
  every 10 ms; the figure is the time from the event's publish to its receipt, p50 and p99 (target p99
  ≤ 2 s).
* **audit cost**: a secured cluster (operator mode, ``zattera up --secure``'s accounts) with the join
  service's relay in the benchmark's process; the operator credential writes 300 single keys one after the
  other (full: 1,000), through the relay, with the audit log on and off (alternating rounds); the figure is
  the write's round trip at the operator, p50 and p99 each way, and what the audit adds (the relay records
  the entry, acknowledged by the stream, before it answers the write).

    .venv/bin/python -m benchmarks.notify_bench [--full]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

from aiohttp import web
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, percentile, row
from services.secrets.notify import Notifier, NotifySettings
from shared import notify
from shared.actions.context import ActionContext
from shared.actions.notify import AddChannel, add_channel
from shared.clock import RealClock
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.events import ERROR, EventPublisher, make_event
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, Keyring, key_id, public_bytes
from shared.security.authority import RoleIssuer
from shared.security.join import JoinService
from shared.security.permissions import Role
from shared.security.setup import prepare
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX
from shared.txn import Writer

EVENT_GAP = 0.010
TOKEN = "bench-token"


class Receiver:
    """A webhook receiver on loopback: verifies each delivery's signature, notes when each event came."""

    def __init__(self) -> None:
        self.secret = ""
        self.arrived: dict[str, float] = {}
        self.order: list[str] = []
        self.bad = 0
        self.expected = 0
        self.all_arrived = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        payload = await request.read()
        if not notify.verify(self.secret, request.headers, payload, now=time.time()):
            self.bad += 1
            return web.Response(status=401)
        event_id = str(json.loads(payload)["id"])
        self.order.append(event_id)
        self.arrived.setdefault(event_id, time.perf_counter())
        if len(self.arrived) >= self.expected:
            self.all_arrived.set()
        return web.Response(status=200)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post(f"/hooks/{TOKEN}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}/hooks/{TOKEN}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _notification_latency(server: EmbeddedNats, events: int) -> list[float]:
    conn = await connect(server.url, name="bench-notify")
    await provision(conn.js)
    view = StateView(conn, name="bench")
    await view.start()
    receiver = Receiver()
    loop: Notifier | None = None
    try:
        key = PrivateKey.generate()
        writer = Writer(conn, view)
        record = pb.SecretsKey(key_id=key_id(public_bytes(key)), public_key=public_bytes(key))
        record.meta.id = CLUSTER_KEY
        await writer.commit(writer.txn().create(record))
        ctx = ActionContext(conn, writer, "bench")
        added = await add_channel(ctx, AddChannel("ops", await receiver.start(), events=["deploy.failed"]))
        receiver.secret = added.signing_secret
        keyring = Keyring([key])
        loop = Notifier(LoopDeps(conn, view, RealClock(), coalesce=0.0), lambda: keyring, settings=NotifySettings())
        loop.writer = Writer(conn, view)  # a leader's term without the lease
        await loop.begin_term()
        await loop.run_pass()
        publisher = EventPublisher(conn)
        receiver.expected = events
        sent: dict[str, float] = {}
        for i in range(events):
            event = make_event("deploy.failed", f"release v{i} failed: health check timed out", severity=ERROR)
            sent[event.meta.id] = time.perf_counter()
            await publisher.publish(event)
            await asyncio.sleep(EVENT_GAP)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(receiver.all_arrived.wait(), 30.0)
        if receiver.bad or len(receiver.arrived) < events:
            raise RuntimeError(f"{len(receiver.arrived)}/{events} delivered, {receiver.bad} bad signatures")
        if receiver.order != list(sent):
            raise RuntimeError("deliveries out of order or duplicated")
        return [receiver.arrived[i] - sent[i] for i in sent]
    finally:
        if loop is not None:
            await loop.end_term()
        await receiver.stop()
        await view.stop()
        await conn.close()


async def _writes(operator: Connection, count: int, tag: str) -> list[float]:
    took = []
    for i in range(count):
        started = time.perf_counter()
        reply = await operator.nc.request(f"{STATE_PREFIX}env.bench-{tag}-{i}", b"x" * 200, timeout=5)
        took.append(time.perf_counter() - started)
        if b'"error"' in reply.data:
            raise RuntimeError(f"write refused: {reply.data!r}")
    return took


async def _audit_cost(base: Path, writes: int, rounds: int) -> dict[bool, list[float]]:
    setup = prepare(base / "security")
    server = EmbeddedNats(data_dir=base / "nats", extra_config=setup.server_config()).start()
    try:
        control = await connect(server.url, name="bench-control", creds=str(setup.control_creds))
        await provision(control.js)
        operator = await connect(server.url, name="bench-cli", creds=str(setup.operator_creds))
        issuers = {role: RoleIssuer.load(setup.directory, role) for role in (Role.AGENT, Role.BUILDER)}
        samples: dict[bool, list[float]] = {True: [], False: []}
        try:
            for round_ in range(rounds):
                for audit in (True, False) if round_ % 2 == 0 else (False, True):
                    service = JoinService(control, issuers, setup.sentinel_jwt(), audit=audit)
                    task = asyncio.create_task(service.run())
                    await asyncio.wait_for(service.ready.wait(), 10)
                    await _writes(operator, 20, f"warm-{round_}-{audit}")
                    samples[audit] += await _writes(operator, writes // rounds, f"{round_}-{audit}")
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        finally:
            await operator.close()
            await control.close()
        return samples
    finally:
        server.stop()


def run(quick: bool = True) -> list[Row]:
    events = 200 if quick else 1000
    writes = 300 if quick else 1000
    rounds = 2 if quick else 4
    with embedded_server("zattera-bench-notify-") as server:
        latency = asyncio.run(_notification_latency(server, events))
    with tempfile.TemporaryDirectory(prefix="zattera-bench-audit-", dir=Path.home() / ".cache") as tmp:
        cost = asyncio.run(_audit_cost(Path(tmp), writes, rounds))
    on, off = cost[True], cost[False]
    ms = 1000.0
    return [
        row(f"event → notification delivered, p50 ({events} events)", percentile(latency, 50) * ms, "ms"),
        row(f"event → notification delivered, p99 ({events} events)", percentile(latency, 99) * ms, "ms", "≤ 2000"),
        row(f"operator state write via relay, audit off, p50 ({len(off)})", percentile(off, 50) * ms, "ms"),
        row(f"operator state write via relay, audit off, p99 ({len(off)})", percentile(off, 99) * ms, "ms"),
        row(f"operator state write via relay, audit on, p50 ({len(on)})", percentile(on, 50) * ms, "ms"),
        row(f"operator state write via relay, audit on, p99 ({len(on)})", percentile(on, 99) * ms, "ms"),
        row("audit cost per write (p50 on − p50 off)", (percentile(on, 50) - percentile(off, 50)) * ms, "ms"),
    ]


if __name__ == "__main__":
    bench_main("Notifications and audit", run, __doc__, "1,000 events and 1,000 writes, 4 rounds")
