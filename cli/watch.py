"""Live progress for ``zattera deploy`` / ``deployments watch``, and a one-shot route snapshot fetch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.markup import escape
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from cli.client import control, err
from cli.render import enum_name
from shared import keys as K
from shared.applogs import AppLogLine
from shared.canary import describe as describe_canary
from shared.clock import RealClock
from shared.connection import Connection
from shared.deployments import desired_replicas, is_terminal
from shared.deploywatch import ReleaseOutput, release_job
from shared.live import LiveView
from shared.routeclient import RouteClient
from shared.routewire import cluster_text, same_cluster
from shared.state.feed import StateView
from shared.state.reader import StateReader

_LIVE = (pb.DEPLOYMENT_PHASE_DRAINING_OLD, pb.DEPLOYMENT_PHASE_SUCCEEDED)
SERVE_TIMEOUT = 60.0
"""How long ``zattera deploy`` waits, after promotion, for the proxies to route to the new release."""
SERVE_POLL = 0.25
"""Proxy reports arrive on their own schedule (every 2 s): re-check at least this often."""


def _phase(d: pb.Deployment) -> str:
    return enum_name(pb.DeploymentPhase, d.phase, "DEPLOYMENT_PHASE_").upper()


def _replicas(view: StateReader, d: pb.Deployment) -> str:
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
    async with control(follow=True) as c:
        feed = c.view.subscribe({K.DEPLOYMENT, K.ASSIGNMENT, K.BUILD, K.JOB})
        started = time.monotonic()
        last = ""
        log_task: asyncio.Task[None] | None = None
        release_output: ReleaseOutput | None = None
        live: LiveView | None = None
        try:
            while True:
                d = c.view.deployment(deployment_id)
                if d is None:
                    err.print(f"[red]error:[/] deployment {deployment_id!r} not found")
                    return 2
                line = f"{_phase(d)} {_replicas(c.view, d)}".strip()
                if d.phase == pb.DEPLOYMENT_PHASE_CANARY:  # the step, weights and live figures (issue 41)
                    if live is None:
                        live = LiveView(c.conn, RealClock(), watched=True)
                        await live.start()
                    figures = describe_canary(d, c.view.release(d.release_id), live.fresh_proxy_heartbeats())
                    line = f"{line} — {escape(figures)}"
                if line != last:
                    err.print(f"[{time.monotonic() - started:6.1f}s] {line}")
                    last = line
                # Seen at BUILDING or later: the stored log is replayed (not to team members: docs/teams.md).
                if d.build_id and log_task is None and not c.polled:
                    log_task = asyncio.create_task(_stream_build_log(c.conn, d.build_id))
                job = release_job(c.view, d)
                if job is not None and job.assignment_id and release_output is None:  # the release command
                    release_output = ReleaseOutput(c.conn, d.environment_id, job.assignment_id, _print_release_line)
                if d.phase == pb.DEPLOYMENT_PHASE_FAILED or (
                    is_terminal(d.phase) and d.phase != pb.DEPLOYMENT_PHASE_SUCCEEDED
                ):
                    await _build_log_printed(log_task)
                    if release_output is not None:
                        await release_output.finish()
                    err.print(f"[red]deployment {_phase(d).lower()}[/]: {d.error or 'no reason recorded'}")
                    return 1
                if d.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED or (d.phase in _LIVE and not until_done):
                    await _build_log_printed(log_task)
                    if release_output is not None:
                        await release_output.finish()
                        release_output = None
                    if c.polled:  # a team member does not see the proxies' routing (docs/teams.md)
                        err.print(f"[green]promoted[/]: {_phase(d).lower()} (routing is not shown to team members)")
                        return 0
                    return await until_served(c.conn, c.view, d, started)
                await feed.wait(timeout=5.0)
        finally:
            feed.close()
            if live is not None:
                await live.stop()
            if release_output is not None:
                release_output.cancel()
            if log_task is not None:
                log_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await log_task


@dataclass(frozen=True, slots=True)
class Serving:
    """Whether the proxies route an env's active release; if not, what that waits for."""

    live: bool
    detail: str
    routes_version: int = 0
    """The first route snapshot version that routes to the release (0: none yet)."""


def serving(
    env: pb.Environment, snapshot: cpb.RouteSnapshot | None, proxies: Sequence[cpb.ProxyHeartbeat], routes_version: int
) -> Serving:
    """Decide from the newest route snapshot and the proxies' fresh reports. ``routes_version``: the
    version already found to route to the release (0: look for it in ``snapshot``). A proxy serves it
    when it routes by that version or a later one *of the snapshot's cluster*: a proxy that kept another
    cluster's routes (a higher version of a data dir's earlier cluster) serves none of this one's. A proxy
    that reports no cluster predates clusters being named: its version alone is taken."""
    if not routes_version:
        if snapshot is None:
            return Serving(False, "the first route snapshot")
        routes = [r for r in snapshot.http_routes if r.environment_id == env.meta.id]
        if not routes:
            return Serving(True, "the environment has no HTTP route (no domain)")
        behind = [r for r in routes if r.route_generation < env.route_generation]
        if behind:
            return Serving(False, f"the route snapshot to switch {behind[0].hostname} to the new release")
        if desired_replicas(env) > 0 and not any(r.endpoints for r in routes):
            return Serving(False, "a healthy replica of the release in the routes")
        routes_version = snapshot.version
    if not proxies:
        return Serving(True, f"no proxy is reporting; route version {routes_version} is published", routes_version)
    cluster = snapshot.cluster if snapshot is not None else cpb.ClusterIdentity()
    foreign = sorted(
        f"{p.proxy_id} (serving {cluster_text(p.routes_cluster)})"
        for p in proxies
        if p.HasField("routes_cluster") and not same_cluster(p.routes_cluster, cluster)
    )
    if foreign:
        return Serving(
            False,
            f"proxies {', '.join(foreign)} to load this cluster's routes ({cluster_text(cluster)}, "
            f"version {routes_version})",
            routes_version,
        )
    lagging = sorted(f"{p.proxy_id} (at {p.routes_version})" for p in proxies if p.routes_version < routes_version)
    if lagging:
        return Serving(False, f"proxies {', '.join(lagging)} to load route version {routes_version}", routes_version)
    return Serving(True, f"served by {len(proxies)} proxy(ies) at route version {routes_version}", routes_version)


async def until_served(conn: Connection, view: StateView, d: pb.Deployment, started: float) -> int:
    """After promotion: "live" once every reporting proxy routes to the release; meanwhile say what it
    waits for; give up after :data:`SERVE_TIMEOUT` (exit 1: promoted, but not served everywhere)."""
    release = view.release(d.release_id)
    label = f"release v{release.version}" if release else f"release {d.release_id}"
    live = LiveView(conn, RealClock(), watched=True)
    await live.start()
    routes = RouteClient(None)  # held in memory: the CLI keeps no route cache
    await routes.start(conn)
    updates = routes.updates()
    found, said = 0, ""
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while True:
            env = view.env(d.environment_id)
            if env is None:
                err.print("[red]error:[/] the environment was deleted")
                return 1
            if routes.version == 0:
                await routes.fetch()
            state = serving(env, routes.current if routes.version else None, live.fresh_proxy_heartbeats(), found)
            found = state.routes_version
            if state.live:
                err.print(f"[green]live[/]: {label} serves traffic ({state.detail})")
                return 0
            if state.detail != said:
                err.print(f"[{time.monotonic() - started:6.1f}s] promoted; waiting for {state.detail}")
                said = state.detail
            if time.monotonic() > deadline:
                err.print(f"[yellow]not live yet[/]: {label} is active, still waiting for {state.detail}")
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(updates.get(), SERVE_POLL)
    finally:
        updates.close()
        await routes.stop()
        await live.stop()


BUILD_LOG_WAIT = 5.0
"""How long a deploy that is done waits for the rest of its build log (a build that ended before the
watch began is replayed from the stream; its end marker ends the wait at once)."""


async def _build_log_printed(log_task: asyncio.Task[None] | None) -> None:
    if log_task is not None and not log_task.done():
        await asyncio.wait({log_task}, timeout=BUILD_LOG_WAIT)


def _print_release_line(line: AppLogLine) -> None:
    err.print(f"  [dim]release>[/] {escape(line.line)}", highlight=False)


async def _stream_build_log(conn: object, build_id: str) -> None:
    from shared.buildlogs import follow_build_log

    async for line in follow_build_log(conn, build_id):  # type: ignore[arg-type]
        err.print(f"  [dim]build>[/] {escape(line)}", highlight=False)  # the log line itself stays literal


async def fetch_routes(timeout: float = 5.0) -> cpb.RouteSnapshot | None:
    async with control(view=False) as c:
        return await route_snapshot(c.conn, timeout)


async def route_snapshot(conn: Connection, timeout: float = 5.0) -> cpb.RouteSnapshot | None:
    """The current route snapshot, fetched as a proxy does (None: none published within ``timeout``)."""
    client = RouteClient(None)  # held in memory: the CLI keeps no route cache
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
