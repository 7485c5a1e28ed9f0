"""What every service runs in the process shell (shared/process.py): ``python -m services.<name> [--nats URL]``.

It connects (retrying with backoff while NATS is unreachable), creates the buckets and streams that are
missing (never changing existing ones), brings the cluster to this code's schema (the pending migrations,
``shared/migrations``; a cluster at a newer schema is refused), loads the state view, runs the service's
tasks (leader loops through :func:`run_while_leading`), and on SIGTERM/SIGINT cancels them (leases
released, no half-written state: every transition is one atomic batch), then drains the connection.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import BadRequestError

from shared.clock import Clock, RealClock
from shared.connection import Connection
from shared.events import EventPublisher
from shared.lease import default_holder, run_while_leading
from shared.loop import LeaderLoop, LoopDeps
from shared.migrations.runner import MigrationFailed, NotInitialised, upgrade
from shared.process import Process, run_process
from shared.provisioning import provision, provision_options
from shared.settings import Settings
from shared.skew import SkewRefused
from shared.state.feed import StateView
from shared.tasks import cancel_and_wait
from shared.txn import Writer

log = logging.getLogger(__name__)


@dataclass
class ServiceContext:
    name: str
    settings: Settings
    conn: Connection
    view: StateView
    clock: Clock
    holder: str
    events: EventPublisher = field(init=False)

    def __post_init__(self) -> None:
        self.events = EventPublisher(self.conn)

    def writer(self) -> Writer:
        """An unfenced writer (for writes that are not a leader loop's: activator, API)."""
        return Writer(
            self.conn,
            self.view,
            max_batch=self.settings.max_batch,
            tombstone_ttl=self.settings.tombstone_ttl,
        )

    @property
    def loop_deps(self) -> LoopDeps:
        """What the service's leader loops receive."""
        return LoopDeps(
            self.conn,
            self.view,
            self.clock,
            coalesce=self.settings.coalesce_window,
            max_batch=self.settings.max_batch,
            tombstone_ttl=self.settings.tombstone_ttl,
        )

    def lead(self, loop: LeaderLoop) -> Coroutine[Any, Any, None]:
        return run_while_leading(
            self.conn,
            loop.name,
            loop.run,
            holder=self.holder,
            ttl=self.settings.lease_ttl,
            renew_interval=self.settings.lease_renew,
            probe_interval=self.settings.lease_probe,
        )


Build = Callable[[ServiceContext], Awaitable[Sequence[Coroutine[Any, Any, None]]]]


async def provision_with_retry(process: Process, conn: Connection) -> bool:
    """Create what is missing (the recorded configuration decides how), retrying while JetStream cannot
    answer (a NATS cluster electing a leader, a server restarting): a service started during a NATS fault
    must wait, not exit. False when stopped first."""
    report = await process.retry(
        lambda: provision(conn.js, **provision_options(process.settings)),
        what="provisioning failed",
        retry_on=(NatsError, TimeoutError, OSError),
        fatal=(BadRequestError,),  # a configuration the server refuses: retrying cannot help
    )
    return report is not None


async def upgrade_with_retry(process: Process, conn: Connection) -> bool:
    """Bring the cluster to this code's schema (``shared/migrations``: one process runs the pending
    migrations under a lease, the others wait for it), retrying while JetStream cannot answer. False when
    stopped first; :class:`SkewRefused` (a downgrade, or too old) and :class:`MigrationFailed` propagate."""
    report = await process.retry(
        lambda: upgrade(conn, holder=default_holder(f"{process.name}-upgrade"), events=EventPublisher(conn)),
        what="upgrading the cluster schema",
        retry_on=(NatsError, TimeoutError, OSError),
        fatal=(SkewRefused, MigrationFailed, NotInitialised),
    )
    return report is not None


async def start_view_with_retry(process: Process, view: StateView) -> bool:
    """Load the state view, retrying while JetStream cannot answer (no stream leader yet: the consumer it
    creates times out); False once the process is stopped first. A service started during a quorum loss
    used to die here, right after its provisioning had waited the loss out."""

    async def attempt() -> bool:
        await view.start()
        return True

    return bool(
        await process.retry(attempt, what="loading the state view failed", retry_on=(NatsError, TimeoutError, OSError))
    )


async def serve(name: str, build: Build, argv: Sequence[str] | None = None) -> int:
    return await serve_all(name, {name: build}, argv)


async def serve_all(name: str, builds: Mapping[str, Build], argv: Sequence[str] | None = None) -> int:
    """One process ``name`` running the tasks of every service in ``builds``: one connection and one view,
    each service with its own context (its name, its lease holder), so its loops lead, fence and write as
    they would in a process of their own."""

    async def body(process: Process) -> int:
        return await _serve(process, builds)

    return await run_process(name, body, argv, prog=f"python -m services.{name}", description=f"Zattera {name} service")


async def _serve(process: Process, builds: Mapping[str, Build]) -> int:
    conn = await process.connect()
    if conn is None:
        return 0
    view = StateView(conn, name=process.name)
    tasks: list[asyncio.Task[None]] = []

    async def shutdown() -> None:
        await cancel_and_wait(*tasks)
        await view.stop()
        await conn.close()

    try:
        if not await provision_with_retry(process, conn):
            return 0
        try:
            if not await upgrade_with_retry(process, conn):
                return 0
        except (SkewRefused, MigrationFailed) as exc:
            log.error("%s: %s", process.name, exc)
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not await start_view_with_retry(process, view):
            return 0
        clock = RealClock()
        for service, build in builds.items():
            ctx = ServiceContext(service, process.settings, conn, view, clock, default_holder(service))
            tasks += [asyncio.create_task(c) for c in await build(ctx)]
        log.info("%s: running (%d tasks) against %s", process.name, len(tasks), process.nats_url)
        return await process.supervise(tasks, conn)
    finally:
        await process.shut_down(shutdown)


def main(name: str, build: Build) -> None:
    sys.exit(asyncio.run(serve(name, build)))
