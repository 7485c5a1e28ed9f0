"""What each console page shows, read from the state view: plain dicts for the templates and the JSON API.

Pure functions of the view (and the route snapshot for URLs); they never write. No secret value is ever
read here: an environment's secrets appear as names, versions and dates only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import jobs as J
from shared import keys as K
from shared.canary import describe as describe_canary
from shared.certs import certificate_text, domain_rows
from shared.deployments import desired_replicas, is_terminal
from shared.state.reader import StateReader
from shared.urls import Listeners
from shared.urls import urls_by_env as shared_urls_by_env

UP_STATES = frozenset({pb.INSTANCE_STATE_RUNNING, pb.INSTANCE_STATE_HEALTHY, pb.INSTANCE_STATE_UNHEALTHY})


def enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        return str(enum.Name(value)).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def when(ts: Timestamp) -> str:
    if not ts.seconds and not ts.nanos:
        return ""
    return datetime.fromtimestamp(ts.seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def env_path(view: StateReader, env: pb.Environment) -> str:
    project = view.project(env.project_id)
    app = view.app(env.app_id)
    return f"{project.name if project else '?'}/{app.name if app else '?'}/{env.name or env.meta.id}"


def routed_envs(routes: cpb.RouteSnapshot | None) -> dict[str, str]:
    """hostname → env id of the routes (the implicit hostnames' env: no Domain record names it)."""
    return {r.hostname: r.environment_id for r in (routes.http_routes if routes else [])}


def certificates_by_env(view: StateReader, routes: cpb.RouteSnapshot | None) -> dict[str, list[dict[str, str]]]:
    """Each env's hostnames with their certificate's state, worded as ``zattera domains list`` words it."""
    found: dict[str, list[dict[str, str]]] = {}
    for row in domain_rows(view, time.time(), lambda env_id: env_id, routed_envs(routes)):
        if row.environment_id:
            entry = {"hostname": row.hostname, "state": row.state, "text": certificate_text(row)}
            found.setdefault(row.environment_id, []).append(entry)
    return found


def urls_by_env(
    view: StateReader, routes: cpb.RouteSnapshot | None, listeners: Listeners = Listeners()
) -> dict[str, list[str]]:
    """Each env's URLs, the ones that work (ports, HTTPS once a certificate is usable: :mod:`shared.urls`)."""
    certificates = {c.hostname: c for c in view.all(K.CERT) if isinstance(c, pb.Certificate)}
    return shared_urls_by_env(routes, listeners, certificates, time.time())


PHASE_ORDER = (
    pb.DEPLOYMENT_PHASE_PENDING,
    pb.DEPLOYMENT_PHASE_BUILDING,
    pb.DEPLOYMENT_PHASE_RELEASING,  # the release command (docs/git.md): counted only when the release has one
    pb.DEPLOYMENT_PHASE_PLACING,
    pb.DEPLOYMENT_PHASE_STOPPING_OLD,  # stateful deploys only: the old instance stops before the new starts
    pb.DEPLOYMENT_PHASE_STARTING,
    pb.DEPLOYMENT_PHASE_HEALTHCHECKING,
    pb.DEPLOYMENT_PHASE_CANARY,  # canary deploys only (docs/deployments.md)
    pb.DEPLOYMENT_PHASE_PROMOTING,
    pb.DEPLOYMENT_PHASE_DRAINING_OLD,
    pb.DEPLOYMENT_PHASE_SUCCEEDED,
)
"""The way a deployment goes; its progress is the position of its phase along it."""


def _deployment(view: StateReader, d: pb.Deployment) -> dict[str, Any]:
    release = view.release(d.release_id)
    releasing = release is not None and bool(release.service.release_command) and not d.is_rollback
    canary = release is not None and release.service.HasField("canary")
    order = [
        p
        for p in PHASE_ORDER
        if (releasing or p != pb.DEPLOYMENT_PHASE_RELEASING) and (canary or p != pb.DEPLOYMENT_PHASE_CANARY)
    ]
    return {
        "step": order.index(d.phase) + 1 if d.phase in order else 0,
        "steps": len(order),
        "id": d.meta.id,
        "release": f"v{release.version}" if release else "?",
        "phase": enum_name(pb.DeploymentPhase, d.phase, "DEPLOYMENT_PHASE_"),
        "done": is_terminal(d.phase),
        "rollback": d.is_rollback,
        "created_at": when(d.meta.created_at),
        "error": d.error,
    }


def env_summary(
    view: StateReader, env: pb.Environment, urls: list[str], certificates: list[dict[str, str]]
) -> dict[str, Any]:
    """One overview row: where it answers (and its certificates), what runs, warm or cold, the last deploy."""
    env_id = env.meta.id
    release = view.release(env.active_release_id) if env.active_release_id else None
    runs = [a for a in view.assignments(env_id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN and not a.job_id]
    active = [a for a in runs if a.release_id == env.active_release_id]
    desired = desired_replicas(env)
    deployments = view.deployments(env_id)
    last = max(deployments, key=lambda d: (d.meta.created_at.ToNanoseconds(), d.meta.id), default=None)
    return {
        "id": env_id,
        "path": env_path(view, env),
        "urls": urls,
        "certificates": certificates,
        "active_release": f"v{release.version}" if release else "",
        "desired": desired,
        "running": sum(1 for a in active if a.observed.state in UP_STATES),
        "healthy": sum(1 for a in active if a.observed.state == pb.INSTANCE_STATE_HEALTHY),
        "state": "not deployed" if not env.active_release_id else ("cold" if desired == 0 else "warm"),
        "last_deploy": _deployment(view, last) if last is not None else None,
    }


def overview(
    view: StateReader, routes: cpb.RouteSnapshot | None, only: Iterable[str] = (), listeners: Listeners = Listeners()
) -> list[dict[str, Any]]:
    """Every env's row; with ``only``, the rows of those env ids (a live update of a few rows)."""
    urls = urls_by_env(view, routes, listeners)
    certificates = certificates_by_env(view, routes)
    envs = [e for e in (view.env(env_id) for env_id in only) if e is not None] if only else view.envs()
    rows = [env_summary(view, env, urls.get(env.meta.id, []), certificates.get(env.meta.id, [])) for env in envs]
    return sorted(rows, key=lambda row: row["path"])


def changed_envs(
    view: StateReader, changes: Iterable[tuple[str, str]], routed: Mapping[str, str] | None = None
) -> list[str] | None:
    """The env ids a batch of view changes touches; None when one of them is not an env's (a project or
    app renamed, an object already gone): the whole page must be fetched again. A certificate is its
    hostname's env's (its Domain's, else ``routed``: hostname → env id); one of no env touches none."""
    found: set[str] = set()
    for kind, ident in changes:
        if kind == K.ENV:
            found.add(ident)
            continue
        message = view.get(kind, ident)
        if isinstance(message, pb.Certificate):
            owners = {d.environment_id for d in view.domains() if d.hostname == message.hostname}
            found.update(owners or ({routed[message.hostname]} if routed and message.hostname in routed else set()))
            continue
        env_id = getattr(message, "environment_id", "") if message is not None else ""
        if not env_id:
            return None
        found.add(env_id)
    return sorted(found)


def _job_run(job: pb.Job) -> dict[str, Any]:
    return {
        "id": job.meta.id,
        "status": J.status_name(job.status) + (" (cancel requested)" if job.cancel_requested else ""),
        "exit_code": J.exit_text(job),
        "duration": J.duration(job),
        "started_at": when(job.started_at) or "-",
        "slot_at": when(job.slot_at),
        "command": job.command,
        "attempt": job.attempt,
        "message": job.message,
        "can_cancel": J.is_active(job) and not job.cancel_requested,
    }


CRON_RUNS_SHOWN = 5
ONE_OFF_RUNS_SHOWN = 20


def env_jobs(view: StateReader, env: pb.Environment) -> dict[str, Any]:
    """The env's cron entries with their last runs, and its one-off (``zattera run``) runs, newest first. An
    entry removed from the spec keeps showing while runs of it are kept."""
    runs = J.newest_first(view.jobs(env.meta.id))
    entries = {c.name: {"name": c.name, "schedule": c.schedule, "command": c.command} for c in env.service.cron}
    for job in runs:
        if job.cron_name and job.cron_name not in entries:
            entries[job.cron_name] = {"name": job.cron_name, "schedule": "(removed)", "command": job.command}
    return {
        "cron": [
            {**entry, "runs": [_job_run(j) for j in runs if j.cron_name == name][:CRON_RUNS_SHOWN]}
            for name, entry in sorted(entries.items())
        ],
        "one_off": [_job_run(j) for j in runs if not j.cron_name][:ONE_OFF_RUNS_SHOWN],
    }


def env_detail(
    view: StateReader, env: pb.Environment, urls: list[str], certificates: list[dict[str, str]]
) -> dict[str, Any]:
    env_id = env.meta.id
    releases = sorted(view.releases(env_id), key=lambda r: r.version, reverse=True)
    active = view.release(env.active_release_id) if env.active_release_id else None
    spec = env.service
    return {
        "summary": env_summary(view, env, urls, certificates),
        "jobs": env_jobs(view, env),
        "releases": [
            {
                "id": r.meta.id,
                "version": r.version,
                "image": r.image_ref or "(building)",
                "config_version": r.service.config_version,
                "commit": r.source.git_sha[:12],
                "commit_ref": r.source.git_branch,
                "author": r.source.git_author,
                "message": (r.source.git_message.strip().splitlines() or [""])[0][:120],
                "created_at": when(r.meta.created_at),
                "active": r.meta.id == env.active_release_id,
                "can_roll_back_to": bool(r.image_ref) and active is not None and r.version < active.version,
            }
            for r in releases
        ],
        "deployments": [_deployment(view, d) for d in reversed(view.deployments(env_id))][:20],
        "replicas": [
            {
                "id": a.meta.id,
                "node": a.node_id,
                "release": f"v{r.version}" if (r := view.release(a.release_id)) else "?",
                "desired": enum_name(pb.AssignmentDesired, a.desired, "ASSIGNMENT_DESIRED_"),
                "state": enum_name(pb.InstanceState, a.observed.state, "INSTANCE_STATE_"),
                "restarts": a.observed.restarts,
            }
            for a in view.assignments(env_id)
        ],
        "scaling": {
            "effective": env.effective_replicas,
            "desired": desired_replicas(env),
            "min": spec.replicas.min,
            "max": spec.replicas.max,
            "scale_to_zero": spec.scale_to_zero,
            "autoscale": spec.HasField("autoscale"),
        },
        "vars": sorted(spec.vars.items()),
        "secrets": [
            {"name": name, "version": ref.version, "updated_at": when(ref.updated_at)}
            for name, ref in sorted(spec.secrets.items())
        ],
        "config_version": spec.config_version,
    }


def nodes(view: StateReader) -> list[dict[str, Any]]:
    rows = []
    for n in view.nodes():
        cpu, mem = view.reserved(n.meta.id)
        rows.append(
            {
                "id": n.meta.id,
                "name": n.name or n.meta.id,
                "status": enum_name(pb.NodeStatus, n.status, "NODE_STATUS_"),
                "schedulable": n.schedulable,
                "platform": n.os_arch,
                "cpu": f"{cpu} / {n.capacity.cpu_millis or '∞'} m",
                "memory": f"{mem} / {n.capacity.memory_mb or '∞'} MB",
                "replicas": len(view.assignments_by_node(n.meta.id)),
                "labels": ", ".join(f"{k}={v}" for k, v in sorted(n.labels.items())),
                "can_cordon": n.schedulable and n.status == pb.NODE_STATUS_ALIVE,
                "can_uncordon": not n.schedulable and n.status != pb.NODE_STATUS_DOWN,
                "can_drain": n.status not in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED),
            }
        )
    return rows


def _env_label(view: StateReader, env_id: str) -> str:
    env = view.env(env_id)
    return env_path(view, env) if env is not None else env_id


def builds(view: StateReader, limit: int = 100) -> list[dict[str, Any]]:
    return [
        {
            "id": b.meta.id,
            "env": _env_label(view, b.environment_id),
            "status": enum_name(pb.BuildStatus, b.status, "BUILD_STATUS_"),
            "node": b.node_id,
            "image": b.image_ref,
            "created_at": when(b.meta.created_at),
            "error": b.error,
        }
        for b in list(reversed(view.builds()))[:limit]
    ]


def volumes(view: StateReader) -> list[dict[str, Any]]:
    snapshots: dict[str, list[pb.VolumeSnapshot]] = {}
    for s in view.snapshots():
        snapshots.setdefault(s.volume_id, []).append(s)
    rows = []
    for v in view.volumes():
        records = sorted(snapshots.get(v.meta.id, []), key=lambda s: s.meta.created_at.ToNanoseconds(), reverse=True)
        rows.append(
            {
                "id": v.meta.id,
                "name": v.name,
                "env": _env_label(view, v.environment_id),
                "node": v.node_id,
                "status": enum_name(pb.VolumeStatus, v.status, "VOLUME_STATUS_"),
                "schedule": v.snapshot_policy.schedule or "manual",
                "snapshots": [
                    {
                        "id": s.meta.id,
                        "status": enum_name(pb.SnapshotStatus, s.status, "SNAPSHOT_STATUS_"),
                        "created_at": when(s.meta.created_at),
                        "size": s.logical_size_bytes,
                        "error": s.error,
                    }
                    for s in records
                ],
            }
        )
    return rows


def event_line(view: StateReader, event: pb.Event) -> dict[str, str]:
    scope = _env_label(view, event.environment_id) if event.environment_id else ""
    if not scope and event.node_id:
        scope = f"node {event.node_id}"
    return {
        "at": when(event.meta.created_at),
        "kind": event.kind,
        "severity": event.severity or "info",
        "scope": scope,
        "message": event.message,
    }


def kinds_of_page(page: str) -> Iterable[str]:
    """The view kinds whose changes refresh a page."""
    return {
        "overview": (
            *(K.ENV, K.RELEASE, K.DEPLOYMENT, K.ASSIGNMENT, K.OBSERVED, K.PROJECT, K.APP, K.DOMAIN, K.CERT),
            K.BACKUP_RUN,
        ),
        "env": (K.ENV, K.RELEASE, K.DEPLOYMENT, K.ASSIGNMENT, K.OBSERVED, K.DOMAIN, K.CERT, K.JOB),
        "nodes": (K.NODE, K.ASSIGNMENT),
        "builds": (K.BUILD,),
        "volumes": (K.VOLUME, K.SNAPSHOT),
        "addons": (K.ENV, K.ASSIGNMENT, K.OBSERVED, K.VOLUME),
    }.get(page, ())


def page_revision(view: StateReader, page: str) -> int:
    """The newest revision of what ``page`` shows (writes of other kinds, lease renewals, do not move it)."""
    return max((view.kind_revision(kind) for kind in kinds_of_page(page)), default=0)


def env_canary(view: StateReader, env_id: str, heartbeats: list[cpb.ProxyHeartbeat]) -> dict[str, str]:
    """The env's running canary, as ``zattera deploy watch`` shows it (step, weights, live figures against
    the bounds); {} when none (issue 41)."""
    for d in view.deployments(env_id):
        line = describe_canary(d, view.release(d.release_id), heartbeats)
        if line:
            return {"deployment_id": d.meta.id, "line": line, "requested": d.canary.requested}
    return {}
