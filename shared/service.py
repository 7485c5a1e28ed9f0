"""The process shell every service shares: ``python -m services.<name> [--nats URL]``.

It connects (retrying with backoff while NATS is unreachable), creates the buckets and streams that are
missing (never changing existing ones),
loads the state view, runs the service's tasks (leader loops through :func:`run_while_leading`), and on
SIGTERM/SIGINT cancels them (leases released, no half-written state: every transition is one atomic
batch), then drains the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nats.errors import Error as NatsError
from nats.js.errors import BadRequestError

from shared.backoff import retry_until_done
from shared.clock import Clock, RealClock
from shared.events import EventPublisher
from shared.lease import default_holder, run_while_leading
from shared.loop import LeaderLoop
from shared.metrics import add_metrics_argument, metrics_port, serve_metrics
from shared.natsio import Connection, connect_until_stopped, provision, provision_options
from shared.settings import Settings, settings
from shared.tasks import cancel_and_wait
from shared.telemetry import setup as setup_telemetry
from shared.txn import Writer
from shared.view import StateView

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 10.0


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

    def loop_kwargs(self) -> dict[str, Any]:
        return {
            "conn": self.conn,
            "view": self.view,
            "clock": self.clock,
            "coalesce": self.settings.coalesce_window,
            "max_batch": self.settings.max_batch,
            "tombstone_ttl": self.settings.tombstone_ttl,
        }

    def lead(self, loop: LeaderLoop) -> Coroutine[Any, Any, None]:
        return run_while_leading(
            self.conn,
            loop.name,
            loop.run,
            holder=self.holder,
            ttl=self.settings.lease_ttl,
            renew_interval=self.settings.lease_renew,
        )


Build = Callable[[ServiceContext], Awaitable[Sequence[Coroutine[Any, Any, None]]]]


def parse_args(name: str, argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=f"Zattera {name} service")
    parser.add_argument("--nats", default=None, help="NATS URL(s), comma-separated (default: $ZATTERA_NATS_URL)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_metrics_argument(parser)
    return parser.parse_args(argv)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def connect_with_retry(urls: str, name: str, stop: asyncio.Event) -> Connection | None:
    cfg = settings()
    return await connect_until_stopped(urls, name, stop, creds=cfg.nats_creds or None, tls_ca=cfg.nats_tls_ca or None)


async def provision_with_retry(conn: Connection, cfg: Settings, name: str, stop: asyncio.Event) -> bool:
    """Create what is missing (the recorded configuration decides how), retrying while JetStream cannot
    answer (a NATS cluster electing a leader, a server restarting): a service started during a NATS fault
    must wait, not exit. False when stopped first."""
    return await retry_until_done(
        lambda: provision(conn.js, **provision_options(cfg)),
        stop,
        what=f"{name}: provisioning failed",
        retry_on=(NatsError, TimeoutError, OSError),
        never_on=(BadRequestError,),  # a configuration the server refuses: retrying cannot help
    )


async def serve(name: str, build: Build, argv: Sequence[str] | None = None) -> int:
    return await serve_all(name, {name: build}, argv)


async def serve_all(name: str, builds: Mapping[str, Build], argv: Sequence[str] | None = None) -> int:
    """One process ``name`` running the tasks of every service in ``builds``: one connection and one view,
    each service with its own context (its name, its lease holder), so its loops lead, fence and write as
    they would in a process of their own."""
    args = parse_args(name, argv)
    configure_logging(args.log_level)
    setup_telemetry(f"zattera-{name}")
    cfg = settings()
    serve_metrics(f"zattera-{name}", metrics_port(args.metrics_port, cfg.metrics_port), cfg.metrics_host)
    urls = args.nats or cfg.nats_url
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    conn = await connect_with_retry(urls, f"zattera-{name}", stop)
    if conn is None:
        return 0
    view = StateView(conn, name=name)
    tasks: list[asyncio.Task[None]] = []
    exit_code = 0
    try:
        if not await provision_with_retry(conn, cfg, name, stop):
            return 0
        await view.start()
        clock = RealClock()
        for service, build in builds.items():
            ctx = ServiceContext(service, cfg, conn, view, clock, default_holder(service))
            tasks += [asyncio.create_task(c) for c in await build(ctx)]
        log.info("%s: running (%d tasks) against %s", name, len(tasks), urls)
        stopper = asyncio.create_task(stop.wait())
        lost = asyncio.create_task(conn.lost.wait())
        done, _ = await asyncio.wait({stopper, lost, *tasks}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stopper or task.cancelled():
                continue
            if task is lost:
                log.error("%s: lost its NATS connection for good; exiting so that it is restarted", name)
                exit_code = 1
                continue
            failure = task.exception()
            if failure is not None:
                log.error("%s: task failed: %r", name, failure)
            else:
                log.error("%s: a task ended on its own", name)
            exit_code = 1  # a supervisor restarts the process; exiting 0 would read as a clean stop
        stopper.cancel()
        lost.cancel()
    finally:
        log.info("%s: stopping (%d tasks)", name, len(tasks))
        try:
            await asyncio.wait_for(_shutdown(tasks, view, conn), SHUTDOWN_GRACE)
        except TimeoutError:
            # Every transition is one atomic batch, so nothing is half-written; leases expire by TTL.
            log.error("%s: did not stop within %.0fs; exiting anyway", name, SHUTDOWN_GRACE)
            logging.shutdown()
            os._exit(1)
        log.info("%s: stopped", name)
    return exit_code


async def _shutdown(tasks: list[asyncio.Task[None]], view: StateView, conn: Connection) -> None:
    await cancel_and_wait(*tasks)
    await view.stop()
    await conn.close()


def main(name: str, build: Build) -> None:
    sys.exit(asyncio.run(serve(name, build)))
