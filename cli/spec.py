"""``zattera.toml``: the app spec an operator applies, validated with pydantic.

Example::

    project = "demo"
    app = "hello"

    [build]                       # how a builder turns the source into an image (optional)
    command = "pip install -r requirements.txt"
    platforms = ["linux/amd64"]

    [run]
    command = "python app.py"     # start command; the process gets PORT

    [env.production]
    replicas = { min = 2, max = 4 }   # or replicas = 2: a fixed count
    resources = { cpu_millis = 250, memory_mb = 128 }
    ports = [{ name = "http", container_port = 8080 }]
    healthcheck = { type = "http", path = "/healthz", interval = "2s", grace_period = "5s" }
    autoscale = { target_cpu_percent = 70 }
    domains = ["hello.example.com"]
    rate_limit = { requests_per_second = 50, burst = 100 }
    [env.production.middleware]   # what the proxy enforces on every route of the env
    ip_allowlist = ["10.0.0.0/8"]
    basic_auth = [{ username = "ops", password_hash = "$2b$12$..." }]
    max_body = "10MB"
    sticky_sessions = true
    redirect_https = true

    [env.production.vars]         # plain environment variables (secrets: `zattera secrets set`)
    LOG_LEVEL = "info"

    release_command = "python manage.py migrate"   # once per deploy, before the release serves (docs/git.md)
    git_branch = "main"           # `git push` of this branch deploys here (docs/git.md)

    [[env.production.cron]]       # a scheduled command (docs/jobs.md)
    name = "nightly-report"
    schedule = "CRON_TZ=Europe/Rome 30 2 * * *"   # or @daily, @every 10m
    command = "python manage.py nightly_report"
    concurrency = "forbid"        # forbid | replace | allow
    max_retries = 2
    deadline = "30m"

    [env.db]
    stateful = true               # one instance pinned to its volumes' node
    [[env.db.volumes]]
    volume_name = "data"
    mount_path = "/data"
    snapshot_schedule = "0 3 * * *"   # cron (UTC; CRON_TZ=..., @daily, @every 6h); "" = manual only
    snapshot_keep_last = 14           # COMPLETE snapshots kept (0 = 7)
    snapshot_pre_hook = "sqlite3 /data/app.db 'PRAGMA wal_checkpoint'"

A volume's ``snapshot_*`` keys become its ``Volume.snapshot_policy`` when ``zattera apps apply`` finds
the volume (the first deploy creates it: apply again afterwards). A key present in the file sets that
field; an absent key leaves it as it is (e.g. as ``zattera volumes policy`` set it).

Every error names the field it is about (``env.production.replicas.max: ...``). Every key is documented
in docs/zattera-toml.md.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from cli.spec_tables import (
    Autoscale,
    Canary,
    CronEntry,
    HealthCheck,
    Logs,
    Middleware,
    Network,
    Port,
    RateLimit,
    Replicas,
    Resources,
    Volume,
)
from cli.spec_values import NAME, Flag, Model, Name, parse_duration
from shared.addons import spec as addon_spec
from shared.appconfig import ConfigError, check_env_size, check_var
from shared.errors import ZatteraError
from shared.gitsource import branch_problem
from shared.jobs import CommandError, check_command

_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9*]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")


class SpecError(ZatteraError, ValueError):
    """Invalid app spec; the message names every bad field."""


class Env(Model):
    replicas: Replicas = Replicas()
    resources: Resources = Resources()
    ports: list[Port] = Field(default_factory=lambda: [Port()])
    healthcheck: HealthCheck | None = None
    min_healthy_time: float | None = Field(
        default=None, le=600, description="no declared check: run this long before counting as healthy"
    )
    autoscale: Autoscale | None = None
    scale_to_zero: Flag = False
    idle_timeout: float = 0.0
    max_concurrency: int = Field(default=0, ge=0, le=100_000)
    stateful: Flag = False
    volumes: list[Volume] = Field(default_factory=list)
    placement_constraints: dict[str, str] = Field(default_factory=dict)
    rate_limit: RateLimit | None = None
    stop_grace: float = 10.0
    command: str = ""
    domains: list[str] = Field(default_factory=list)
    middleware: Middleware | None = None
    vars: dict[str, str] = Field(default_factory=dict, description="plain environment variables (not secrets)")
    logs: Logs = Logs()
    network: Network = Network()
    cron: list[CronEntry] = Field(default_factory=list)
    release_command: str = Field(default="", description="run once per deploy before the new release serves")
    git_branch: str = Field(default="", description="pushes of this branch to the app's git remote deploy here")

    read_only_root: Flag = Field(default=False, description="docker runtime: a read-only root filesystem")
    strategy: Literal["red-green", "canary"] = Field(default="red-green", description="how a deploy shifts traffic")
    canary: Canary | None = None

    _durations = field_validator("idle_timeout", "stop_grace", "min_healthy_time", mode="before")(parse_duration)

    @field_validator("cron")
    @classmethod
    def _unique_cron_names(cls, value: list[CronEntry]) -> list[CronEntry]:
        names = [entry.name for entry in value]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"cron entry names must be unique ({duplicate!r} is used twice)")
        return value

    @field_validator("release_command")
    @classmethod
    def _release_command(cls, value: str) -> str:
        if not value:
            return value
        try:
            return check_command(value)
        except CommandError as exc:
            raise ValueError(exc.problem) from None

    @field_validator("git_branch")
    @classmethod
    def _git_branch(cls, value: str) -> str:
        if value and (problem := branch_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("vars")
    @classmethod
    def _posix_vars(cls, value: dict[str, str]) -> dict[str, str]:
        try:
            for name, text in value.items():
                check_var(name, text)
            check_env_size(value, {})
        except ConfigError as exc:
            raise ValueError(exc.problem) from None
        return value

    @field_validator("replicas", mode="before")
    @classmethod
    def _replicas_shorthand(cls, value: object) -> object:
        """``replicas = 2`` is ``replicas = { min = 2 }``: a fixed count."""
        if isinstance(value, int) and not isinstance(value, bool):
            return {"min": value}
        if not isinstance(value, dict | Replicas):
            raise ValueError("must be a number (replicas = 2) or a table (replicas = { min = 2, max = 4 })")
        return value

    @field_validator("domains")
    @classmethod
    def _hostnames(cls, value: list[str]) -> list[str]:
        for host in value:
            if not _HOSTNAME.match(host.lower()):
                raise ValueError(f"{host!r} is not a valid hostname")
        return [h.lower() for h in value]

    @model_validator(mode="after")
    def _coherent(self) -> Env:
        if self.scale_to_zero and self.stateful:
            raise ValueError("scale_to_zero and stateful are mutually exclusive")
        if self.stateful and not self.volumes:
            raise ValueError("a stateful service needs at least one volume")
        if self.volumes and not self.stateful:
            raise ValueError("volumes require stateful = true")
        names = [p.name for p in self.ports]
        if len(names) != len(set(names)):
            raise ValueError("port names must be unique")
        if self.canary is not None and self.strategy != "canary":
            raise ValueError('canary: needs strategy = "canary"')
        if self.strategy == "canary" and self.stateful:
            raise ValueError('strategy: "canary" needs two releases side by side; a stateful env has one instance')
        return self


class Build(Model):
    install: str = ""  # replaces the detected install step (shared/buildplan.py); read by the builder
    command: str = ""
    platforms: list[str] = Field(default_factory=list)
    dockerfile: str = Field(default="", description="build with this Dockerfile on a builder's Docker daemon")
    context_dir: str = Field(default="", description="the Docker build context inside the source ('' = its root)")
    build_args: dict[str, str] = Field(default_factory=dict, description="Docker --build-arg values (not secret)")


class Run(Model):
    command: str = ""


class Addon(Model):
    """``[addons.NAME]``: a managed database of the project (docs/addons.md), created by ``zattera apps apply``
    when missing and attached to the envs ``attach`` names (:mod:`shared.actions.addon_declare`)."""

    type: str = Field(description="postgres or redis")
    version: str = Field(default="", description="the server version ('' = the newest installed)")
    attach: list[str] = Field(default_factory=list, description="envs of this file (or project/app/env) given its URL")
    archive_timeout: int = Field(default=addon_spec.ARCHIVE_TIMEOUT, ge=1, le=3600)
    backup_interval: int = Field(default=addon_spec.BACKUP_INTERVAL, ge=60, le=30 * 86400)

    @field_validator("type")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in addon_spec.ENGINES:
            raise ValueError(f"unknown engine {value!r}: one of {', '.join(sorted(addon_spec.ENGINES))}")
        return value

    @field_validator("version")
    @classmethod
    def _available(cls, value: str, info: ValidationInfo) -> str:
        engine = info.data.get("type", "")
        if engine not in addon_spec.ENGINES:
            return value
        try:
            return addon_spec.check_engine(engine, value)
        except addon_spec.AddonInputError as exc:
            raise ValueError(exc.problem) from None

    @field_validator("attach")
    @classmethod
    def _once(cls, value: list[str]) -> list[str]:
        if len(value) != len(set(value)):
            raise ValueError("an env is named twice")
        return value


class AppSpec(Model):
    project: Name
    app: Name
    build: Build = Build()
    run: Run = Run()
    env: dict[Name, Env] = Field(min_length=1)
    addons: dict[str, Addon] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _addons(self) -> AppSpec:
        for name, declared in self.addons.items():
            try:
                addon_spec.check_name(name)
            except addon_spec.AddonInputError as exc:
                raise ValueError(f"addons.{name}: {exc.problem}") from None
            if name == self.app:
                raise ValueError(f"addons.{name}: is this file's app: a database is an app of its own")
            for target in declared.attach:
                parts = target.split("/")
                if len(parts) == 1 and target not in self.env:
                    raise ValueError(
                        f"addons.{name}.attach: {target!r} is not an env of this file"
                        f" ({', '.join(sorted(self.env))}); or name one as project/app/env"
                    )
                if len(parts) not in (1, 2, 3) or not all(parts):
                    raise ValueError(
                        f"addons.{name}.attach: {target!r}: an env of this file, app/env or project/app/env"
                    )
                if len(parts) == 3 and parts[0] != self.project:
                    raise ValueError(f"addons.{name}.attach: {target!r} is not in project {self.project}")
        return self


def load(path: Path) -> AppSpec:
    """Read and validate a zattera.toml; raises SpecError naming each bad field."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    return validate(raw, source=str(path))


def validate(raw: dict[str, object], source: str = "zattera.toml") -> AppSpec:
    try:
        return AppSpec.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "(top level)"
            message = error["msg"].removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown key (docs/zattera-toml.md lists every key)"
                if error["loc"][-1] == "secrets":
                    message = (
                        "secrets are never in zattera.toml (it is read as plain text and often committed): "
                        "`zattera secrets set --env E NAME` seals each one (docs/secrets.md)"
                    )
            if error["type"] == "bool_type":
                message = f"must be true or false (a TOML boolean), not {error['input']!r}"
            if error["type"] == "string_pattern_mismatch" and error["ctx"].get("pattern") == NAME:
                message = f"{error['input']!r} must be lowercase letters, digits and dashes (at most 63)"
            lines.append(f"{source}: {where}: {message}" if error["loc"] else f"{source}: {message}")
        raise SpecError("\n".join(lines)) from None
