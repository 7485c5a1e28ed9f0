"""Live progress for ``zattera deploy`` / ``deployments watch``, and a one-shot route snapshot fetch."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from rich.markup import escape
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.client import control, err
from cli.render import enum_name
from shared import keys as K
from shared.deployments import is_terminal
from shared.natsio import Connection
from shared.routeclient import RouteClient
from shared.view import StateView

_LIVE = (pb.DEPLOYMENT_PHASE_DRAINING_OLD, pb.DEPLOYMENT_PHASE_SUCCEEDED)


def _phase(d: pb.Deployment) -> str:
    return enum_name(pb.DeploymentPhase, d.phase, "DEPLOYMENT_PHASE_").upper()


def _replicas(view: StateView, d: pb.Deployment) -> str:
    mine = [
        a
        for a in view.assignments(d.environment_id)
        if a.release_id == d.release_id and a.desired == pb.ASSIGNMENT_DESIRED_RUN
    ]
    if not mine:
        return ""
    healthy = sum(1 for a in mine if a.observed.state == pb.INSTANCE_STATE_HEALTHY)
    return f"{healthy}/{len(mine)} healthy"


async def watch_deployment(deployment_id: str, *, until_done: bool) -> int:
    async with control() as c:
        feed = c.view.subscribe({K.DEPLOYMENT, K.ASSIGNMENT, K.BUILD})
        started = time.monotonic()
        last = ""
        log_task: asyncio.Task[None] | None = None
        try:
            while True:
                d = c.view.deployment(deployment_id)
                if d is None:
                    err.print(f"[red]error:[/] deployment {deployment_id!r} not found")
                    return 2
                line = f"{_phase(d)} {_replicas(c.view, d)}".strip()
                if line != last:
                    err.print(f"[{time.monotonic() - started:6.1f}s] {line}")
                    last = line
                if d.phase == pb.DEPLOYMENT_PHASE_BUILDING and d.build_id and log_task is None:
                    log_task = asyncio.create_task(_stream_build_log(c.conn, d.build_id))
                if d.phase == pb.DEPLOYMENT_PHASE_FAILED or (
                    is_terminal(d.phase) and d.phase != pb.DEPLOYMENT_PHASE_SUCCEEDED
                ):
                    err.print(f"[red]deployment {_phase(d).lower()}[/]: {d.error or 'no reason recorded'}")
                    return 1
                if d.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED or (d.phase in _LIVE and not until_done):
                    err.print(f"[green]live[/]: release {d.release_id} serves traffic")
                    return 0
                await feed.wait(timeout=5.0)
        finally:
            feed.close()
            if log_task is not None:
                log_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await log_task


async def _stream_build_log(conn: object, build_id: str) -> None:
    from shared.buildlogs import follow_build_log

    async for line in follow_build_log(conn, build_id):  # type: ignore[arg-type]
        err.print(f"  [dim]build>[/] {escape(line)}", highlight=False)  # the log line itself stays literal


async def fetch_routes(timeout: float = 5.0) -> cpb.RouteSnapshot | None:
    async with control(view=False) as c:
        return await route_snapshot(c.conn, timeout)


async def route_snapshot(conn: Connection, timeout: float = 5.0) -> cpb.RouteSnapshot | None:
    """The current route snapshot, fetched as a proxy does (None: none published within ``timeout``)."""
    with tempfile.TemporaryDirectory() as tmp:
        client = RouteClient(Path(tmp) / "routes.pb")
        await client.start(conn)
        try:
            deadline = time.monotonic() + timeout
            while client.version == 0 and time.monotonic() < deadline:
                if await client.fetch():
                    break
                await asyncio.sleep(0.1)
            return client.current if client.version else None
        finally:
            await client.stop()
