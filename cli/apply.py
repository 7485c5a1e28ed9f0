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

The result is also the plan that ``zattera apps apply`` prints (and, with ``--dry-run``, only prints):
one :class:`PlanItem` per object with the fields that change (:func:`field_changes`, password hashes
hidden).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from cli.spec import AppSpec, Build, Env
from cli.spec_proto import middleware, service_spec
from cli.spec_values import to_duration
from shared import keys as K
from shared.actions import addon_declare as declare
from shared.actions.names import env_label, find_app, find_env, find_project
from shared.actions.names import env_path as env_path  # re-exported: the CLI's commands name envs this way
from shared.actions.names import resolve_env as resolve_env
from shared.actions.volumes import with_policy
from shared.appconfig import ConfigError, check_env_size, secret_sizes, with_vars
from shared.clock import stamp
from shared.records import new_meta
from shared.state.reader import StateReader
from shared.txn import Txn, Writer
from shared.volumes import find_volume

CREATE, UPDATE, DELETE, UNCHANGED, PENDING = "create", "update", "delete", "unchanged", "pending"
SENSITIVE_FIELDS = frozenset({"password_hash", "basic_auth_password_hash"})
"""Fields whose values a plan never prints (it says that they change, not what to)."""


@dataclass(frozen=True)
class FieldChange:
    field: str
    old: Any
    new: Any
    sensitive: bool = False
    """A value never shown (``old`` and ``new`` are then None): the plan only says that it changes."""


@dataclass
class PlanItem:
    """One object of the plan: what ``apps apply`` does (or, with ``--dry-run``, would do) to it."""

    action: str
    kind: str
    name: str
    """Qualified by names: ``demo``, ``demo/hello``, ``demo/hello/production``, a hostname, ``…/db:data``."""
    changes: list[FieldChange] = field(default_factory=list)
    note: str = ""


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
    items: list[PlanItem] = field(default_factory=list)

    def add(self, item: PlanItem, label: str) -> None:
        self.items.append(item)
        bucket = {CREATE: self.created, UPDATE: self.updated, DELETE: self.updated, PENDING: self.pending}
        bucket.get(item.action, self.unchanged).append(label)

    def counts(self) -> dict[str, int]:
        return {action: sum(i.action == action for i in self.items) for action in (CREATE, UPDATE, DELETE, UNCHANGED)}

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "items"} | {
            "plan": [asdict(item) for item in self.items],
            "summary": self.counts(),
        }


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            _flatten(inner, f"{path}.{key}" if path else str(key), out)
    elif isinstance(value, list) and any(isinstance(v, dict) for v in value):
        for index, inner in enumerate(value):
            _flatten(inner, f"{path}.{index}", out)
    elif value != {}:
        out[path] = value


def _fields(msg: Message | None) -> dict[str, Any]:
    """Set fields of ``msg`` as dotted paths (``service.replicas.min``), without the generated ``meta``."""
    if msg is None:
        return {}
    flat: dict[str, Any] = {}
    _flatten(MessageToDict(msg, preserving_proto_field_name=True), "", flat)
    # meta (id, times) and the *_id references are generated or follow from the names: a plan shows neither
    return {
        path: value
        for path, value in flat.items()
        if not path.startswith("meta.") and not path.rsplit(".", 1)[-1].endswith("_id")
    }


def field_changes(old: Message | None, new: Message | None) -> list[FieldChange]:
    """Every field that differs between ``old`` and ``new`` (None = absent), sensitive values hidden."""
    before, after = _fields(old), _fields(new)
    changes = []
    for path in sorted(before.keys() | after.keys()):
        if before.get(path) != after.get(path):
            if path.rsplit(".", 1)[-1] in SENSITIVE_FIELDS:
                changes.append(FieldChange(path, None, None, sensitive=True))
            else:
                changes.append(FieldChange(path, before.get(path), after.get(path)))
    return changes


def _stamp(meta: pb.Meta, now: float, *, new: bool) -> None:
    if new:
        new_meta(meta, now)
    else:
        stamp(meta.updated_at, now)


def _copy(msg: Message) -> Message:
    fresh = type(msg)()
    fresh.CopyFrom(msg)
    return fresh


def plan(view: StateReader, writer: Writer, spec: AppSpec, now: float | None = None) -> tuple[Txn, ApplyResult]:
    now = time.time() if now is None else now
    txn = writer.txn("apply")
    result = ApplyResult()

    def record(kind: str, name: str, qualified: str, old: Message | None, new: Message) -> None:
        label = f"{kind} {name}"
        if old is None:
            result.add(PlanItem(CREATE, kind, qualified, field_changes(None, new)), label)
            txn.create(new)
        elif _without_times(old) != _without_times(new):
            result.add(PlanItem(UPDATE, kind, qualified, field_changes(old, new)), label)
            txn.put(new)
        else:
            result.add(PlanItem(UNCHANGED, kind, qualified), label)

    project = find_project(view, spec.project)
    new_project = pb.Project(name=spec.project) if project is None else _copy(project)
    assert isinstance(new_project, pb.Project)
    _stamp(new_project.meta, now, new=project is None)
    record("project", spec.project, spec.project, project, new_project)
    result.project_id = new_project.meta.id

    app = find_app(view, new_project.meta.id, spec.app) if project else None
    new_app = pb.App(project_id=new_project.meta.id, name=spec.app) if app is None else _copy(app)
    assert isinstance(new_app, pb.App)
    new_app.build.platforms[:] = spec.build.platforms
    set_dockerfile_build(new_app.build, spec.build)
    _stamp(new_app.meta, now, new=app is None)
    record("app", spec.app, f"{spec.project}/{spec.app}", app, new_app)
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
        _keep_cron_starts(new_env.service, env, now)
        _plan_config(view, new_env, env, env_spec, f"env.{env_name}.vars")
        if env_spec.idle_timeout:
            new_env.idle_timeout.CopyFrom(to_duration(env_spec.idle_timeout))
        else:
            new_env.ClearField("idle_timeout")
        env_middleware = middleware(env_spec)
        if env_middleware is None:
            new_env.ClearField("middleware")
        else:
            new_env.middleware.CopyFrom(env_middleware)
        new_env.ClearField("logs")
        if env_spec.logs.max_bytes:
            new_env.logs.max_bytes = int(env_spec.logs.max_bytes)
        if env_spec.logs.max_age:
            new_env.logs.max_age.CopyFrom(to_duration(env_spec.logs.max_age))
        if env_spec.git_branch:  # absent: left as `zattera git map` set it
            new_env.git_branch = env_spec.git_branch
        if env is None and env_spec.scale_to_zero:
            new_env.effective_replicas = max(env_spec.replicas.min, 1)
        _stamp(new_env.meta, now, new=env is None)
        path = f"{spec.project}/{spec.app}/{env_name}"
        record("env", env_name, path, env, new_env)
        result.env_ids[env_name] = new_env.meta.id
        _plan_domains(view, txn, result, new_env, path, env_spec.domains, now)
        for vol in env_spec.volumes:
            change = vol.policy_change()
            if not change:
                continue
            label = f"volume {env_name}/{vol.volume_name} snapshot policy"
            qualified = f"{path}:{vol.volume_name}"
            volume = find_volume(view, new_env.project_id, new_env.meta.id, vol.volume_name)
            if volume is None:
                note = "the volume does not exist yet: apply again after the first deploy"
                result.add(PlanItem(PENDING, "volume policy", qualified, note=note), label)
                continue
            updated = with_policy(volume, change, now)
            if updated is None:
                result.add(PlanItem(UNCHANGED, "volume policy", qualified), label)
            else:
                txn.put(updated)
                changes = field_changes(volume.snapshot_policy, updated.snapshot_policy)
                result.add(PlanItem(UPDATE, "volume policy", qualified, changes), label)
    return txn, result


def _keep_cron_starts(service: pb.ServiceSpec, env: pb.Environment | None, now: float) -> None:
    """A cron entry's first slot comes after ``since``: kept while its schedule stays, else now (a new or
    rescheduled entry does not run the slots it was not there for)."""
    before = {c.name: c for c in env.service.cron} if env is not None else {}
    for entry in service.cron:
        old = before.get(entry.name)
        if old is not None and old.schedule == entry.schedule and old.HasField("since"):
            entry.since.CopyFrom(old.since)
        else:
            stamp(entry.since, now)


def _plan_config(
    view: StateReader, new_env: pb.Environment, env: pb.Environment | None, env_spec: Env, field: str
) -> None:
    """Variables, secrets and the config version are the env's own (``zattera config``/``secrets``): kept, except
    that a file with a ``vars`` table makes the variables exactly that table (staged for the next deploy)."""
    if env is not None:
        new_env.service.vars.update(env.service.vars)
        for name, ref in env.service.secrets.items():
            new_env.service.secrets[name].CopyFrom(ref)
        new_env.service.config_version = env.service.config_version
    if "vars" not in env_spec.model_fields_set:
        return
    clash = sorted(set(env_spec.vars) & set(new_env.service.secrets))
    if clash:
        raise ConfigError(f"{field}.{clash[0]}", "is a secret of this environment; `zattera secrets unset` it first")
    sizes = secret_sizes(new_env.service, view.secrets(new_env.meta.id)) if env is not None else {}
    check_env_size(env_spec.vars, sizes, field=field)
    with_vars(new_env.service, env_spec.vars)


def _plan_domains(
    view: StateReader, txn: Txn, result: ApplyResult, env: pb.Environment, env_path: str, hosts: list[str], now: float
) -> None:
    existing = {d.hostname: d for d in view.domains(env.meta.id)}
    routed_to = f"routed to {env_path}"
    for host in hosts:
        if host in existing:
            result.add(PlanItem(UNCHANGED, "domain", host, note=routed_to), f"domain {host}")
            continue
        for other in view.domains():
            if other.hostname == host and other.environment_id != env.meta.id:
                where = env_label(view, other.environment_id)
                raise ValueError(f"env.{env.name}.domains: {host} is already routed to {where}")
        domain = pb.Domain(project_id=env.project_id, app_id=env.app_id, environment_id=env.meta.id, hostname=host)
        _stamp(domain.meta, now, new=True)
        txn.create(domain)
        result.add(PlanItem(CREATE, "domain", host, note=routed_to), f"domain {host}")
    for host, domain in existing.items():
        if host not in hosts:
            txn.delete(K.domain(domain.meta.id))
            result.add(PlanItem(DELETE, "domain", host, note=f"no longer {routed_to}"), f"domain {host} removed")


def _without_times(msg: Message) -> bytes:
    copy = _copy(msg)
    copy.meta.ClearField("updated_at")  # type: ignore[attr-defined]
    return copy.SerializeToString(deterministic=True)


def set_dockerfile_build(config: pb.BuildConfig, build: Build) -> None:
    """``[build] dockerfile`` makes the app's builds Dockerfile builds (docs/containers.md)."""
    config.dockerfile = build.dockerfile
    config.context_dir = build.context_dir
    config.build_args.clear()
    config.build_args.update(build.build_args)
    if build.dockerfile:
        config.type = pb.BUILD_TYPE_DOCKERFILE
    elif config.type == pb.BUILD_TYPE_DOCKERFILE:
        config.type = pb.BUILD_TYPE_UNSPECIFIED


def declared_addons(spec: AppSpec) -> list[declare.DeclaredAddon]:
    """The file's ``[addons.NAME]`` tables as :mod:`shared.actions.addon_declare` takes them."""
    return [
        declare.DeclaredAddon(
            name,
            a.type,
            a.version,
            tuple(a.attach),
            archive_timeout=a.archive_timeout,
            backup_interval=a.backup_interval,
        )
        for name, a in sorted(spec.addons.items())
    ]


_STEP_ACTIONS = {declare.CREATE: CREATE, declare.ATTACH: CREATE, declare.DETACH: DELETE, declare.UNCHANGED: UNCHANGED}


def add_addon_steps(result: ApplyResult, steps: list[declare.AddonStep]) -> None:
    """The databases' steps as plan lines: ``database NAME`` (created or kept), ``attachment NAME → ENV``."""
    for step in steps:
        action = _STEP_ACTIONS[step.action]
        if step.env:
            item = PlanItem(action, "attachment", f"{step.database} → {step.env}", note=step.note)
            result.add(item, f"attachment {step.database} → {step.env}")
        else:
            result.add(PlanItem(action, "database", step.database, note=step.note), f"database {step.database}")
