"""Deleting a project, an app or an environment (``zattera projects|apps|envs delete``): what goes, decided
on the view, written as ONE fenced batch.

The batch deletes the scope's records (project, apps, environments) and their domains, flips every
desired-RUN replica of the scope to STOP and ends every deployment under way (a promoted one SUCCEEDED,
any other FAILED "environment deleted"). Each key expects the revision the decision read, so a
concurrent deploy (which re-writes its environment), promotion, scaling write or domain edit refuses the
whole batch and the deletion is decided again on fresh state; nothing is ever half-deleted.

What follows from the environment being gone, in the services that own it: routes lose its hostnames at
once (the route builder reads environments); the scheduler reaps the STOPped replicas (and stops any a
racing writer created: orphans) once their agents report them stopped; the VIP loop frees its VIP;
retention prunes its releases, their images and its finished deployments and builds once no replica uses
them.

Volumes and their snapshots are kept unless asked (``volumes=True``): a volume outlives its app so that
a mistaken delete loses no data (the records stay; ``zattera volumes list`` shows them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.context import ActionContext, commit
from shared.actions.names import env_path, resolve_app, resolve_env, resolve_project
from shared.actions.refusals import NotFound
from shared.clock import stamp
from shared.deployments import is_terminal
from shared.events import ENV_DELETED, PATH_FIELD, make_event
from shared.retry import Attempt
from shared.state.reader import StateReader
from shared.txn import Txn, Writer

ENVIRONMENT_DELETED = "environment deleted"


class Scope(StrEnum):
    PROJECT = "project"
    APP = "app"
    ENV = "env"


@dataclass(frozen=True, slots=True)
class Delete:
    scope: Scope
    ref: str
    """An id, or the names: ``project``, ``project/app``, ``project/app/env``."""
    volumes: bool = False
    """Also delete the volumes and their snapshots (kept by default)."""


@dataclass(frozen=True, slots=True)
class Deleted:
    what: str
    """What was deleted, for messages: ``env demo/hello/production``."""
    counts: dict[str, int]
    """:meth:`Deletion.summary`: projects, apps, environments, domains, replicas_stopped, …"""


@dataclass
class Deletion:
    """Everything one delete removes (and the volumes it keeps)."""

    what: str
    """What the operator named, for messages: ``env demo/hello/production``."""
    projects: list[pb.Project] = field(default_factory=list)
    apps: list[pb.App] = field(default_factory=list)
    envs: list[pb.Environment] = field(default_factory=list)
    domains: list[pb.Domain] = field(default_factory=list)
    stops: list[pb.Assignment] = field(default_factory=list)
    ended: list[pb.Deployment] = field(default_factory=list)
    """Deployments under way, ended in the same write (a draining one SUCCEEDED, others FAILED)."""
    volumes: list[pb.Volume] = field(default_factory=list)
    snapshots: list[pb.VolumeSnapshot] = field(default_factory=list)
    kept_volumes: list[pb.Volume] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    """env id → ``project/app/env`` as the view names it when the deletion is decided (its event keeps it)."""

    @property
    def empty(self) -> bool:
        return not (self.projects or self.apps or self.envs or self.domains or self.stops or self.volumes)

    def summary(self) -> dict[str, int]:
        return {
            "projects": len(self.projects),
            "apps": len(self.apps),
            "environments": len(self.envs),
            "domains": len(self.domains),
            "replicas_stopped": len(self.stops),
            "deployments_ended": len(self.ended),
            "volumes_deleted": len(self.volumes),
            "snapshots_deleted": len(self.snapshots),
            "volumes_kept": len(self.kept_volumes),
        }


def plan_deletion(
    view: StateReader,
    what: str,
    *,
    projects: Sequence[pb.Project] = (),
    apps: Sequence[pb.App] = (),
    envs: Sequence[pb.Environment] = (),
    volumes: bool = False,
    now: float,
) -> Deletion:
    """The deletion of the given projects, apps and envs and of everything under them (a project's apps,
    an app's envs), as the view shows them now."""
    plan = Deletion(what, projects=list(projects))
    project_ids = {p.meta.id for p in projects}
    plan.apps = sorted(
        {a.meta.id: a for a in [*apps, *(a for a in view.all(K.APP) if a.project_id in project_ids)]}.values(),
        key=lambda a: a.meta.id,
    )
    app_ids = {a.meta.id for a in plan.apps}
    plan.envs = sorted(
        {e.meta.id: e for e in [*envs, *(e for e in view.envs() if e.app_id in app_ids)]}.values(),
        key=lambda e: e.meta.id,
    )
    env_ids = {e.meta.id for e in plan.envs}
    for e in plan.envs:
        project, app = view.project(e.project_id), view.app(e.app_id)
        plan.paths[e.meta.id] = f"{project.name if project else '?'}/{app.name if app else '?'}/{e.name}"
    for env_id in sorted(env_ids):
        plan.domains.extend(view.domains(env_id))
        plan.stops.extend(_stopped(a, now) for a in view.assignments(env_id) if a.desired == pb.ASSIGNMENT_DESIRED_RUN)
        plan.ended.extend(_ended(d, now) for d in view.deployments(env_id) if not is_terminal(d.phase))
        (plan.volumes if volumes else plan.kept_volumes).extend(view.volumes(env_id))
    # Domains and volumes of the project itself (not tied to an env of it) go with a project.
    plan.domains.extend(d for d in view.domains() if d.project_id in project_ids and d.environment_id not in env_ids)
    if volumes:
        volume_ids = {v.meta.id for v in plan.volumes}
        plan.snapshots = [s for s in view.snapshots() if s.volume_id in volume_ids]
    return plan


def _stopped(a: pb.Assignment, now: float) -> pb.Assignment:
    copy = pb.Assignment()
    copy.CopyFrom(a)
    copy.ClearField("observed")
    copy.desired = pb.ASSIGNMENT_DESIRED_STOP
    stamp(copy.meta.updated_at, now)
    return copy


def _ended(d: pb.Deployment, now: float) -> pb.Deployment:
    """A deployment of a deleted env, ended: a promoted one has done its job (its blue stops with the env),
    any other fails. Ending it in the deletion's write also fences it against the orchestrator's next step."""
    copy = pb.Deployment()
    copy.CopyFrom(d)
    if d.phase == pb.DEPLOYMENT_PHASE_DRAINING_OLD:
        copy.phase = pb.DEPLOYMENT_PHASE_SUCCEEDED
    else:
        copy.phase = pb.DEPLOYMENT_PHASE_FAILED
        copy.error = ENVIRONMENT_DELETED
    stamp(copy.meta.updated_at, now)
    return copy


def deletion_txn(writer: Writer, plan: Deletion) -> Txn:
    """The plan as one batch, every key expecting the revision the plan was decided on."""
    txn = writer.txn(f"delete {plan.what}")
    for msg in [*plan.stops, *plan.ended]:
        txn.put(msg)
    keys = [K.domain(d.meta.id) for d in plan.domains]
    keys += [K.snapshot(s.meta.id) for s in plan.snapshots]
    keys += [K.volume(v.meta.id) for v in plan.volumes]
    keys += [K.env(e.meta.id) for e in plan.envs]
    keys += [K.app(a.meta.id) for a in plan.apps]
    keys += [K.project(p.meta.id) for p in plan.projects]
    for key in keys:
        txn.delete(key)
    return txn


def deletion_events(plan: Deletion, actor: str) -> list[pb.Event]:
    """One event per deleted record (project, app, env), naming what was removed and what was kept."""
    kept = f"; {len(plan.kept_volumes)} volume(s) kept" if plan.kept_volumes else ""
    events = [
        make_event("project.deleted", f"project {p.name} deleted{kept}", project_id=p.meta.id, fields={"actor": actor})
        for p in plan.projects
    ]
    events += [
        make_event(
            "app.deleted",
            f"app {a.name} deleted",
            project_id=a.project_id,
            app_id=a.meta.id,
            fields={"actor": actor},
        )
        for a in plan.apps
    ]
    for e in plan.envs:
        env_kept = [v for v in plan.kept_volumes if v.environment_id == e.meta.id]
        message = f"environment {e.name} deleted: {sum(1 for a in plan.stops if a.environment_id == e.meta.id)}"
        message += " replica(s) stopped"
        if env_kept:
            message += f", {len(env_kept)} volume(s) kept"
        events.append(
            make_event(
                ENV_DELETED,
                message,
                project_id=e.project_id,
                app_id=e.app_id,
                environment_id=e.meta.id,
                fields={"actor": actor, PATH_FIELD: plan.paths.get(e.meta.id, e.name)},
            )
        )
    return events


def plan_delete(view: StateReader, request: Delete, now: float) -> Deletion | None:
    """What ``request`` would delete, as the view shows it now (None: what it names does not exist). The
    CLI shows it before asking for a confirmation; :func:`delete` decides it again as it commits."""
    volumes = request.volumes
    if request.scope is Scope.ENV:
        env = resolve_env(view, request.ref)
        if env is None:
            return None
        return plan_deletion(view, f"env {env_path(view, env)}", envs=[env], volumes=volumes, now=now)
    if request.scope is Scope.APP:
        app = resolve_app(view, request.ref)
        if app is None:
            return None
        project = view.project(app.project_id)
        label = f"app {project.name if project else '?'}/{app.name}"
        return plan_deletion(view, label, apps=[app], volumes=volumes, now=now)
    found = resolve_project(view, request.ref)
    if found is None:
        return None
    return plan_deletion(view, f"project {found.name}", projects=[found], volumes=volumes, now=now)


async def delete(ctx: ActionContext, request: Delete) -> Deleted:
    """Delete as one fenced batch (decided again after a conflict), then announce it."""
    what = f"{request.scope} {request.ref!r}"

    def attempt() -> Attempt[Deletion]:
        plan = plan_delete(ctx.view, request, ctx.clock.now())
        if plan is None:
            raise NotFound(f"{what}: not found")
        return Attempt(deletion_txn(ctx.writer, plan), plan)

    plan = await commit(ctx, attempt, contended=what, kept_changing=f"{what} kept changing while deleting; try again")
    await ctx.events.publish(*deletion_events(plan, ctx.actor))
    return Deleted(plan.what, plan.summary())
