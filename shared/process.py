"""The one process shell of every long-running Zattera process: a service (``python -m services.<name>``,
shared/service.py), the all-in-one control plane, a node agent, an ingress proxy.

:func:`run_process` parses the flags every process has (``--nats``, ``--log-level``, ``--metrics-port``)
beside the process's own, sets up logging, tracing and the metrics endpoint, turns SIGTERM/SIGINT into
:attr:`Process.stop` and runs the process's body, which uses:

* :meth:`Process.connect`: connect, retrying with backoff while NATS is unreachable;
* :meth:`Process.retry`: the same backoff for any step that waits on the cluster (provisioning);
* :meth:`Process.supervise`: run until stopped, the connection lost for good, or a task ending, touching
  the heartbeat file of ``ZATTERA_HEALTH_FILE`` meanwhile (shared/health.py: containers' health checks);
* :meth:`Process.shut_down`: cancel and clean up, within a grace after which the process exits anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nats.errors import Error as NatsError

from shared import health
from shared.backoff import exponential
from shared.connection import Connection, connect
from shared.metrics import add_metrics_argument, metrics_port, serve_metrics
from shared.migrations.registry import SCHEMA
from shared.provisioning import recorded_config
from shared.settings import Settings, settings
from shared.skew import Component, SkewRefused, Verdict, judge
from shared.tasks import cancel_and_wait
from shared.telemetry import setup as setup_telemetry
from shared.version import VERSION

log = logging.getLogger(__name__)

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FIRST_RETRY = 0.2
"""Seconds before the first retry of a step that waits on the cluster; it doubles up to ``LAST_RETRY``."""
LAST_RETRY = 5.0
SHUTDOWN_GRACE = 10.0
"""Seconds a stopping process is given to cancel its tasks and close its connection."""
LEFTOVER_GRACE = 5.0
"""Seconds the tasks still running after that are given to end once cancelled (:func:`end_leftovers`)."""
RESTART_SIGNAL = signal.SIGUSR2
"""Stop to be restarted at once (``zattera up`` rolling its processes onto new code): like SIGTERM, but what
outlives a restart is kept (:attr:`Process.restarting`)."""


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def _unless_stopped(stop: asyncio.Event, attempt: Awaitable[T]) -> asyncio.Future[T] | None:
    """``attempt`` run to its end (its result or error read from the future returned), or cancelled as
    soon as ``stop`` is set (None): one attempt can take long (a connect to a NATS server that accepts
    the connection but does not answer tries for 10 s), and a SIGTERM must not wait for it."""
    work = asyncio.ensure_future(attempt)
    stopped = asyncio.ensure_future(stop.wait())
    finished = False
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finished = work.done()
    finally:
        # nats-py's connect can swallow one cancellation: cancel_and_wait repeats it
        await cancel_and_wait(stopped, None if finished else work)
    return work if finished else None


async def retry_until_stopped(
    stop: asyncio.Event,
    attempt: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    fatal: tuple[type[BaseException], ...] = (),
    level: int = logging.WARNING,
    first: float | None = None,
    last: float | None = None,
) -> T | None:
    """``attempt()`` until it returns, with backoff while it raises one of ``retry_on`` (``fatal`` ones
    propagate: retrying cannot help); None once ``stop`` is set first. ``what`` names the failure logged.
    The delays double from ``first`` to ``last`` (default :data:`FIRST_RETRY`, :data:`LAST_RETRY`)."""
    failures = 0
    while not stop.is_set():
        try:
            finished = await _unless_stopped(stop, attempt())
            return None if finished is None else finished.result()
        except fatal:
            raise
        except retry_on as exc:
            failures += 1
            delay = exponential(FIRST_RETRY if first is None else first, failures, LAST_RETRY if last is None else last)
            log.log(level, "%s (%s); retrying in %.1fs", what, exc or type(exc).__name__, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return None


async def connect_with_retry(
    urls: str, name: str, stop: asyncio.Event, *, creds: str | None = None, tls_ca: str | None = None
) -> Connection | None:
    """Connect as ``name``, retrying while NATS is unreachable; None once ``stop`` is set. ``creds`` and
    ``tls_ca`` default to the settings' (``ZATTERA_NATS_CREDS``, ``ZATTERA_NATS_TLS_CA``)."""
    cfg = settings()
    creds, tls_ca = creds or cfg.nats_creds or None, tls_ca or cfg.nats_tls_ca or None
    return await retry_until_stopped(
        stop,
        # fail_fast: once every server refused, back off here (and say so) rather than inside nats-py for 10 s
        lambda: connect(urls, name=name, creds=creds, tls_ca=tls_ca, fail_fast=True),
        what=f"{name}: NATS at {urls} unreachable",
    )


async def heartbeat(path: Path, conn: Connection | None) -> None:
    """Touch ``path`` every :data:`shared.health.HEARTBEAT` seconds while ``conn`` is connected (always
    without one): what a container's health check reads (``sh shared/health.sh``)."""
    failing = False
    while True:
        if conn is None or conn.nc.is_connected:
            try:
                health.touch(path)
                failing = False
            except OSError as exc:
                if not failing:  # once per failure, not every beat
                    log.warning("heartbeat file %s: %s", path, exc.strerror or exc)
                failing = True
        await asyncio.sleep(health.HEARTBEAT)


@dataclass
class Process:
    """One running process: its flags, the shared settings, and the event set on SIGTERM/SIGINT."""

    name: str
    args: argparse.Namespace
    settings: Settings
    stop: asyncio.Event
    metrics: bool
    """Whether its metrics endpoint is served."""
    restarting: bool = False
    """Stopped by :data:`RESTART_SIGNAL`: to be started again at once (an upgrade rolling over it), so what
    outlives a restart is kept (an agent's instances, whatever ``--stop-on-exit`` says)."""

    @property
    def nats_url(self) -> str:
        return str(self.args.nats or self.settings.nats_url)

    async def connect(
        self, client_name: str = "", *, creds: str | None = None, tls_ca: str | None = None
    ) -> Connection | None:
        """Connect (as ``client_name``, default ``zattera-<name>``); None when stopped first."""
        return await connect_with_retry(
            self.nats_url, client_name or f"zattera-{self.name}", self.stop, creds=creds, tls_ca=tls_ca
        )

    async def retry(
        self,
        attempt: Callable[[], Awaitable[T]],
        *,
        what: str,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        fatal: tuple[type[BaseException], ...] = (),
        level: int = logging.WARNING,
    ) -> T | None:
        """:func:`retry_until_stopped` until this process is stopped."""
        return await retry_until_stopped(
            self.stop, attempt, what=f"{self.name}: {what}", retry_on=retry_on, fatal=fatal, level=level
        )

    async def await_compatible(self, conn: Connection, component: Component, poll: float = 2.0) -> bool:
        """Wait until the cluster's recorded schema and version let ``component`` of this version run
        (``shared/skew.py``): True to go on, False when stopped first. One line says why it waits (a cluster
        the control plane has not upgraded yet) or runs one release behind; :class:`SkewRefused` when it
        may not run at all (too old)."""
        said = ""
        while not self.stop.is_set():
            recorded = await self.retry(
                lambda: recorded_config(conn.js),
                what="reading the cluster's version",
                retry_on=(NatsError, TimeoutError, OSError),
            )
            if recorded is not None:  # None: stopped, or no cluster yet (its init comes first)
                skew = judge(component, VERSION, SCHEMA, recorded.version, recorded.schema)
                if skew.refused:
                    raise SkewRefused(skew.message)
                if skew.message and skew.message != said:
                    said = skew.message
                    log.warning("%s: %s", self.name, skew.message)
                if skew.verdict is not Verdict.WAIT:
                    return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), poll)
        return False

    async def supervise(self, tasks: Sequence[asyncio.Task[None]], conn: Connection | None = None) -> int:
        """Wait until stopped (exit status 0), ``conn`` closed for good (1: a process left with it is alive
        but deaf) or one of ``tasks`` ending (1: a supervisor restarts the process; 0 would read as a
        clean stop). The tasks are left to :meth:`shut_down`. Meanwhile the heartbeat file (setting
        ``health_file``) is touched while ``conn`` is connected, and removed at the end."""
        stopper = asyncio.create_task(self.stop.wait())
        lost = asyncio.create_task(conn.lost.wait()) if conn is not None else None
        beating = self.settings.health_file
        heart = asyncio.create_task(heartbeat(Path(beating), conn)) if beating else None
        watched = {stopper, *tasks} | ({lost} if lost is not None else set())
        exit_code = 0
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if lost is not None:
                lost.cancel()
            if heart is not None:
                await cancel_and_wait(heart)
                health.clear(Path(beating))
        for task in done:
            if task is stopper or task.cancelled():
                continue
            if task is lost:
                log.error("%s: lost its NATS connection for good; exiting so that it is restarted", self.name)
            elif (failure := task.exception()) is not None:
                log.error("%s: task failed: %r", self.name, failure)
            else:
                log.error("%s: a task ended on its own", self.name)
            exit_code = 1
        return exit_code

    async def shut_down(self, cleanup: Callable[[], Awaitable[None]], grace: float | None = SHUTDOWN_GRACE) -> None:
        """Run ``cleanup`` (cancel the tasks, close the connection); past ``grace`` seconds (None: no
        limit) exit at once with status 1: every transition is one atomic batch, so nothing is
        half-written, and leases expire by TTL."""
        log.info("%s: stopping", self.name)
        work = asyncio.ensure_future(cleanup())
        done, _ = await asyncio.wait({work}, timeout=grace)  # not wait_for: it waits for a cancelled clean-up
        if not done:
            log.error("%s: did not stop within %.0fs; exiting anyway", self.name, grace)
            logging.shutdown()
            os._exit(1)
        failure = None if work.cancelled() else work.exception()
        if failure is not None:  # a connection already gone, say: the process stops all the same
            log.error("%s: stop: clean-up failed: %r", self.name, failure)
        log.info("%s: stopped", self.name)


async def run_process(
    name: str,
    body: Callable[[Process], Awaitable[int]],
    argv: Sequence[str] | None = None,
    *,
    prog: str,
    description: str,
    arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse the flags (the common ones and those ``arguments`` adds), set up logging, tracing, metrics and
    the stop signals, then run ``body``; its result is the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--nats", default=None, help="NATS URL(s), comma-separated (default: $ZATTERA_NATS_URL)")
    if arguments is not None:
        arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    add_metrics_argument(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    log.info("%s: Zattera %s (schema %d) starting", name, VERSION, SCHEMA)
    setup_telemetry(f"zattera-{name}")
    cfg = settings()
    served = serve_metrics(f"zattera-{name}", metrics_port(args.metrics_port, cfg.metrics_port), cfg.metrics_host)
    stop = asyncio.Event()
    process = Process(name, args, cfg, stop, metrics=served is not None)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def restart() -> None:
        process.restarting = True
        stop.set()

    loop.add_signal_handler(RESTART_SIGNAL, restart)
    try:
        return await body(process)
    finally:
        await end_leftovers(name)


async def end_leftovers(
    name: str, grace: float = LEFTOVER_GRACE, *, exit_now: Callable[[int], object] = os._exit
) -> None:
    """Cancel the tasks still running once the process body is done, again while they run, for at most
    ``grace`` seconds. One that outlives that (a library swallowed each cancellation, and a retry loop around
    it went on) would keep ``asyncio.run``, which waits for every task, from ever returning: the process
    exits at once with status 1 instead, naming the tasks."""
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    if not left:
        return
    ending = asyncio.ensure_future(cancel_and_wait(*left))  # cancels again while they run
    done, _ = await asyncio.wait({ending}, timeout=grace)
    if done:
        return
    ending.cancel()
    still = sorted(t.get_name() for t in left if not t.done())
    log.error("%s: %d task(s) did not end when cancelled (%s); exiting anyway", name, len(still), ", ".join(still))
    logging.shutdown()
    exit_now(1)
