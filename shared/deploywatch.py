"""Following a deployment for a caller that is not a terminal (a ``git push``'s hook, a webhook): its phase
changes, its build's log and its release command's output, each as one line to a ``progress`` callback,
until it is live (promoted) or has ended. ``zattera deploy`` prints the same with colours (cli/watch.py) and
reads the release command's output with :class:`ReleaseOutput`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import AppLogLine, UnknownLogStream, read_app_logs
from shared.buildlogs import follow_build_log
from shared.connection import Connection
from shared.deployments import is_terminal
from shared.state.feed import StateView

Progress = Callable[[str], None]
"""Receives one line of progress (no newline)."""

LIVE_PHASES = frozenset({pb.DEPLOYMENT_PHASE_DRAINING_OLD, pb.DEPLOYMENT_PHASE_SUCCEEDED})
LOG_TAIL_WAIT = 5.0
"""How long a finished deployment waits for the rest of its build log / release output to be read."""
LOG_STREAM_WAIT = 0.5
"""How often the release output follower looks again for an env log stream that does not exist yet."""


def phase_name(phase: int) -> str:
    try:
        return pb.DeploymentPhase.Name(phase).removeprefix("DEPLOYMENT_PHASE_")  # type: ignore[arg-type]
    except ValueError:
        return f"UNKNOWN({phase})"


def release_job(view: StateView, d: pb.Deployment) -> pb.Job | None:
    job = view.get(K.JOB, d.release_job_id) if d.release_job_id else None
    return job if isinstance(job, pb.Job) else None


class ReleaseOutput:
    """Follows the release command's output (the env log stream, instance = the job's assignment) and hands
    each line to ``emit``; :meth:`finish` reads back what the follower had not reached yet, in order."""

    def __init__(self, conn: Connection, env_id: str, instance: str, emit: Callable[[AppLogLine], None]) -> None:
        self.conn, self.env_id, self.instance, self.emit = conn, env_id, instance, emit
        self.seen = 0
        self.task = asyncio.create_task(self._follow())

    def _read(self, *, follow: bool) -> AsyncIterator[AppLogLine]:
        return read_app_logs(self.conn, self.env_id, instance=self.instance, last=1_000_000, follow=follow)

    async def _follow(self) -> None:
        while True:
            try:
                async for line in self._read(follow=True):
                    self.seen += 1
                    self.emit(line)
                return
            except UnknownLogStream:
                await asyncio.sleep(LOG_STREAM_WAIT)

    async def finish(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        count = 0
        with contextlib.suppress(UnknownLogStream, TimeoutError):
            async with asyncio.timeout(LOG_TAIL_WAIT):
                async for line in self._read(follow=False):
                    count += 1
                    if count > self.seen:
                        self.seen += 1
                        self.emit(line)

    def cancel(self) -> None:
        self.task.cancel()


async def follow_deployment(
    conn: Connection, view: StateView, deployment_id: str, progress: Progress, *, timeout: float | None = None
) -> pb.Deployment | None:
    """Report the deployment until it is live or ended (or ``timeout`` seconds passed); returns it as last
    seen (None: it vanished)."""
    feed = view.subscribe({K.DEPLOYMENT, K.BUILD, K.JOB})
    started = time.monotonic()
    said = ""
    build_task: asyncio.Task[None] | None = None
    release: ReleaseOutput | None = None

    async def build_log(build_id: str) -> None:
        async for line in follow_build_log(conn, build_id):
            progress(f"build> {line}")

    d: pb.Deployment | None = None
    try:
        while True:
            d = view.deployment(deployment_id)
            if d is None:
                return None
            line = phase_name(d.phase)
            if line != said:
                progress(f"[{time.monotonic() - started:6.1f}s] {line}")
                said = line
            if d.build_id and build_task is None:
                build_task = asyncio.create_task(build_log(d.build_id))
            job = release_job(view, d)
            if job is not None and job.assignment_id and release is None:
                release = ReleaseOutput(
                    conn, d.environment_id, job.assignment_id, lambda x: progress(f"release> {x.line}")
                )
            if d.phase in LIVE_PHASES or is_terminal(d.phase):
                break
            if timeout is not None and time.monotonic() - started > timeout:
                break
            await feed.wait(timeout=5.0)
        if build_task is not None and not build_task.done():
            await asyncio.wait({build_task}, timeout=LOG_TAIL_WAIT)
        if release is not None:
            await release.finish()
        return d
    finally:
        feed.close()
        if build_task is not None:
            build_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await build_task
        if release is not None:
            release.cancel()
