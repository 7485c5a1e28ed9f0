"""Apply a validated zattera.toml: create or update the project, app, environments and domains.

Objects are found by name (project), by (project, name) (app) and by (app, name) (environment), so
applying the same file twice changes nothing. Everything is ONE fenced write: each key expects the
revision it was read at, so a concurrent edit makes the apply fail cleanly instead of clobbering it.
Environment fields owned by the control plane (active release, effective replicas, route generation)
are kept.

A volume's ``snapshot_*`` keys are written onto its ``Volume.snapshot_policy`` when the volume exists
(the first deploy of a stateful env creates it, and the wire contract has no place to carry a policy
from the env to the volume): in the same write, through :func:`with_policy`, the code behind
``zattera volumes policy``. Volumes not created yet are reported as pending.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from cli.spec import AppSpec, PolicyChange, service_spec, to_duration
from shared import keys as K
from shared.ids import new_id
from shared.txn import Txn, Writer
from shared.view import StateView
from shared.volumes import find_volume


@dataclass
class ApplyResult:
    project_id: str = ""
    app_id: str = ""
    env_ids: dict[str, str] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    """Volumes whose snapshot policy waits for the volume to exist (apply again after the first deploy)."""


def _stamp(meta: pb.Meta, now: float, *, new: bool) -> None:
    if new:
        meta.id = new_id()
        meta.created_at.FromNanoseconds(int(now * 1e9))
    meta.updated_at.FromNanoseconds(int(now * 1e9))


def _copy(msg: Message) -> Message:
    fresh = type(msg)()
    fresh.CopyFrom(msg)
    return fresh


def find_project(view: StateView, name: str) -> pb.Project | None:
    return next((p for p in view.all(K.PROJECT) if p.name == name), None)


def find_app(view: StateView, project_id: str, name: str) -> pb.App | None:
    return next((a for a in view.all(K.APP) if a.project_id == project_id and a.name == name), None)


def find_env(view: StateView, app_id: str, name: str) -> pb.Environment | None:
    return next((e for e in view.envs() if e.app_id == app_id and e.name == name), None)


def resolve_env(view: StateView, ref: str) -> pb.Environment | None:
    """An environment by id or by ``project/app/env`` names."""
    env = view.env(ref)
    if env is not None:
        return env
    parts = ref.split("/")
    if len(parts) != 3:
        return None
    project = find_project(view, parts[0])
    app = find_app(view, project.meta.id, parts[1]) if project else None
    return find_env(view, app.meta.id, parts[2]) if app else None


def with_policy(volume: pb.Volume, change: PolicyChange, now: float) -> pb.Volume | None:
    """``volume`` with ``change`` applied to its snapshot policy (``updated_at`` stamped), or None when it
    would change nothing. Shared by ``zattera apps apply`` and ``zattera volumes policy``."""
    policy = pb.SnapshotPolicy()
    policy.CopyFrom(volume.snapshot_policy)
    if change.schedule is not None:
        policy.schedule = change.schedule
    if change.keep_last is not None:
        policy.keep_last = change.keep_last
    if change.pre_hook is not None:
        policy.pre_hook = change.pre_hook
    if policy == volume.snapshot_policy:
        return None
    updated = pb.Volume()
    updated.CopyFrom(volume)
    updated.snapshot_policy.CopyFrom(policy)
    updated.meta.updated_at.FromNanoseconds(int(now * 1e9))
    return updated


def env_path(view: StateView, env: pb.Environment) -> str:
    project = view.project(env.project_id)
    app = view.app(env.app_id)
    return f"{project.name if project else '?'}/{app.name if app else '?'}/{env.name}"


def plan(view: StateView, writer: Writer, spec: AppSpec, now: float | None = None) -> tuple[Txn, ApplyResult]:
    now = time.time() if now is None else now
    txn = writer.txn("apply")
    result = ApplyResult()

    def record(kind: str, name: str, old: Message | None, new: Message) -> None:
        label = f"{kind} {name}"
        if old is None:
            result.created.append(label)
            txn.create(new)
        elif _without_times(old) != _without_times(new):
            result.updated.append(label)
            txn.put(new)
        else:
            result.unchanged.append(label)

    project = find_project(view, spec.project)
    new_project = pb.Project(name=spec.project) if project is None else _copy(project)
    assert isinstance(new_project, pb.Project)
    _stamp(new_project.meta, now, new=project is None)
    record("project", spec.project, project, new_project)
    result.project_id = new_project.meta.id

    app = find_app(view, new_project.meta.id, spec.app) if project else None
    new_app = pb.App(project_id=new_project.meta.id, name=spec.app) if app is None else _copy(app)
    assert isinstance(new_app, pb.App)
    new_app.build.platforms[:] = spec.build.platforms
    _stamp(new_app.meta, now, new=app is None)
    record("app", spec.app, app, new_app)
    result.app_id = new_app.meta.id

    for env_name, env_spec in sorted(spec.env.items()):
        env = find_env(view, new_app.meta.id, env_name) if app else None
        new_env = (
            pb.Environment(
                app_id=new_app.meta.id, project_id=new_project.meta.id, name=env_name, type=pb.ENVIRONMENT_TYPE_STANDARD
            )
            if env is None
            else _copy(env)
        )
        assert isinstance(new_env, pb.Environment)
        new_env.service.CopyFrom(service_spec(spec, env_spec))
        if env_spec.idle_timeout:
            new_env.idle_timeout.CopyFrom(to_duration(env_spec.idle_timeout))
        else:
            new_env.ClearField("idle_timeout")
        new_env.ClearField("logs")
        if env_spec.logs.max_bytes:
            new_env.logs.max_bytes = int(env_spec.logs.max_bytes)
        if env_spec.logs.max_age:
            new_env.logs.max_age.CopyFrom(to_duration(env_spec.logs.max_age))
        if env is None and env_spec.scale_to_zero:
            new_env.effective_replicas = max(env_spec.replicas.min, 1)
        _stamp(new_env.meta, now, new=env is None)
        record("env", env_name, env, new_env)
        result.env_ids[env_name] = new_env.meta.id
        _plan_domains(view, txn, result, new_env, env_spec.domains, now)
        for vol in env_spec.volumes:
            change = vol.policy_change()
            if not change:
                continue
            label = f"volume {env_name}/{vol.volume_name} snapshot policy"
            volume = find_volume(view, new_env.project_id, new_env.meta.id, vol.volume_name)
            if volume is None:
                result.pending.append(label)
                continue
            updated = with_policy(volume, change, now)
            if updated is None:
                result.unchanged.append(label)
            else:
                txn.put(updated)
                result.updated.append(label)
    return txn, result


def _plan_domains(
    view: StateView, txn: Txn, result: ApplyResult, env: pb.Environment, hosts: list[str], now: float
) -> None:
    existing = {d.hostname: d for d in view.domains(env.meta.id)}
    for host in hosts:
        if host in existing:
            result.unchanged.append(f"domain {host}")
            continue
        for other in view.domains():
            if other.hostname == host and other.environment_id != env.meta.id:
                raise ValueError(f"domains: {host} is already routed to another environment")
        domain = pb.Domain(project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, hostname=host)
        _stamp(domain.meta, now, new=True)
        txn.create(domain)
        result.created.append(f"domain {host}")
    for host, domain in existing.items():
        if host not in hosts:
            txn.delete(K.domain(domain.meta.id))
            result.updated.append(f"domain {host} removed")


def _without_times(msg: Message) -> bytes:
    copy = _copy(msg)
    copy.meta.ClearField("updated_at")  # type: ignore[attr-defined]
    return copy.SerializeToString(deterministic=True)
