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

import ipaddress
import itertools
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from google.protobuf.duration_pb2 import Duration
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shared.actions.volumes import PolicyChange
from shared.addons import spec as addon_spec
from shared.appconfig import ConfigError, check_env_size, check_var
from shared.canary import (
    CANARY_DEFAULT_MAX_ERROR_RATIO,
    CANARY_DEFAULT_MAX_LATENCY_RATIO,
    CANARY_DEFAULT_MIN_REQUESTS,
    CANARY_DEFAULT_PAUSE,
    CANARY_DEFAULT_STEPS,
)
from shared.errors import ZatteraError
from shared.gitsource import branch_problem
from shared.jobs import DEFAULT_DEADLINE, MAX_RETRIES, CommandError, check_command
from shared.schedule import validate_schedule

NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9*]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")


Name = Annotated[str, Field(pattern=NAME, description="lowercase letters, digits and dashes")]


Flag = Annotated[bool, Strict()]


"""A TOML boolean: ``true`` or ``false``, never a string or a number that reads like one ("yes", 1)."""


class SpecError(ZatteraError, ValueError):
    """Invalid app spec; the message names every bad field."""


def parse_duration(value: str | int | float) -> float:
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("must not be negative")
        return float(value)
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a duration like '500ms', '10s', '5m' or '1h'")
    return float(match.group(1)) * _UNITS[match.group(2)]


def to_duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Replicas(_Model):
    min: int = Field(default=1, ge=0, le=1000)
    max: int = Field(default=0, ge=0, le=1000, description="0 = no autoscaling ceiling beyond min")

    @model_validator(mode="after")
    def _max_not_below_min(self) -> Replicas:
        if self.max and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class Resources(_Model):
    cpu_millis: int = Field(default=0, ge=0, le=1_000_000)
    memory_mb: int = Field(default=0, ge=0, le=10_000_000)


class Port(_Model):
    name: Name = "http"
    container_port: int = Field(default=0, ge=0, le=65535)
    protocol: Literal["http", "tcp", "udp"] = "http"
    public_l4_port: int = Field(default=0, ge=0, le=65535)


class HealthCheck(_Model):
    type: Literal["http", "tcp", "exec", "auto"] = "auto"
    path: str = "/"
    port: int = Field(default=0, ge=0, le=65535)
    command: str = ""
    interval: float = 10.0
    timeout: float = 5.0
    grace_period: float = 60.0
    unhealthy_threshold: int = Field(default=3, ge=1, le=100)

    _durations = field_validator("interval", "timeout", "grace_period", mode="before")(parse_duration)

    @model_validator(mode="after")
    def _exec_needs_command(self) -> HealthCheck:
        if self.type == "exec" and not self.command:
            raise ValueError("command is required for an exec health check")
        if not self.path.startswith("/"):
            raise ValueError("path must start with '/'")
        return self


class Autoscale(_Model):
    target_cpu_percent: int = Field(default=0, ge=0, le=100)
    target_memory_percent: int = Field(default=0, ge=0, le=100)
    target_rps_per_replica: int = Field(default=0, ge=0)


class Volume(_Model):
    volume_name: Name
    mount_path: str = Field(pattern=r"^/")
    snapshot_schedule: str = Field(default="", description='5-field cron (UTC), CRON_TZ=, @daily…; "" = manual')
    snapshot_keep_last: int = Field(default=0, ge=0, le=1000, description="COMPLETE snapshots kept; 0 = 7")
    snapshot_pre_hook: str = Field(default="", description="shell command run in the instance before a snapshot")

    _schedule = field_validator("snapshot_schedule")(validate_schedule)

    def policy_change(self) -> PolicyChange:
        """The snapshot policy fields this file sets (the keys present in it)."""
        given = self.model_fields_set
        return PolicyChange(
            schedule=self.snapshot_schedule if "snapshot_schedule" in given else None,
            keep_last=self.snapshot_keep_last if "snapshot_keep_last" in given else None,
            pre_hook=self.snapshot_pre_hook if "snapshot_pre_hook" in given else None,
        )


class CronEntry(_Model):
    """``[[env.<name>.cron]]``: a command run on a schedule (docs/jobs.md)."""

    name: Name
    schedule: str = Field(description="5-field cron (UTC), CRON_TZ=Zone prefix, @daily…, @every 10m")
    command: str
    resources: Resources | None = None
    concurrency: Literal["forbid", "replace", "allow"] = "forbid"
    max_retries: int = Field(default=0, ge=0, le=MAX_RETRIES)
    deadline: float = Field(default=DEFAULT_DEADLINE, gt=0, description="how late a slot may still start")

    _durations = field_validator("deadline", mode="before")(parse_duration)

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return validate_schedule(value)

    @field_validator("command")
    @classmethod
    def _command(cls, value: str) -> str:
        try:
            return check_command(value)
        except CommandError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("concurrency", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class RateLimit(_Model):
    requests_per_second: int = Field(ge=1)
    burst: int = Field(default=0, ge=0)


_BCRYPT_HASH = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")


_SIZE = re.compile(r"^\s*(\d+)\s*(b|kb|kib|mb|mib|gb|gib)?\s*$", re.IGNORECASE)


_SIZE_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3}


def parse_size(value: str | int) -> int:
    """Bytes from ``1048576``, ``"512KiB"``, ``"10MB"`` or ``"1GiB"``."""
    if isinstance(value, bool):
        raise ValueError("must be a size like 1048576, '512KiB' or '10MB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a size like 1048576, '512KiB' or '10MB'")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "b").lower()]


class BasicAuthUser(_Model):
    username: str = Field(min_length=1, max_length=256, pattern=r"^[^:\s]+$", description="no ':' nor spaces")
    password_hash: str = Field(description="bcrypt hash ($2b$...), e.g. from `htpasswd -nbB user password`")

    @field_validator("password_hash")
    @classmethod
    def _bcrypt(cls, value: str) -> str:
        if not _BCRYPT_HASH.match(value):
            raise ValueError("must be a bcrypt hash ($2a$/$2b$/$2y$, 60 characters), never a plain password")
        return value


class Middleware(_Model):
    """What the proxy enforces on every HTTP route of the env (docs/zattera-toml.md, "middleware")."""

    ip_allowlist: list[str] = Field(default_factory=list, description="CIDRs or addresses; empty = everyone")
    basic_auth: list[BasicAuthUser] = Field(default_factory=list, description="users let in; empty = no auth")
    max_body: int = Field(default=0, ge=0, description="request body cap in bytes (or '10MB'); 0 = none")
    sticky_sessions: Flag = False
    redirect_https: Flag = False

    _size = field_validator("max_body", mode="before")(parse_size)

    @field_validator("ip_allowlist")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address or CIDR") from None
        return [entry.strip() for entry in value]

    @field_validator("basic_auth")
    @classmethod
    def _unique_users(cls, value: list[BasicAuthUser]) -> list[BasicAuthUser]:
        names = [user.username for user in value]
        if len(names) != len(set(names)):
            raise ValueError("usernames must be unique")
        return value


class Logs(_Model):
    """``[env.<name>.logs]``: this env's log retention; absent keys = the cluster defaults (docs/logs.md)."""

    max_bytes: ByteSize = Field(default=ByteSize(0), description="e.g. 64MiB; at least 1MiB")
    max_age: float = Field(default=0.0, description="e.g. 72h")

    _durations = field_validator("max_age", mode="before")(parse_duration)

    @field_validator("max_bytes")
    @classmethod
    def _at_least_a_mebibyte(cls, value: ByteSize) -> ByteSize:
        if value and value < 1024 * 1024:
            raise ValueError(f"{value} bytes is below the 1MiB minimum")
        return value


class Network(_Model):
    """``[env.<name>.network]``: the envs of other projects this env may reach (docs/networking.md)."""

    allow: list[str] = Field(default_factory=list, description='"project/app/env" names; own project always')

    @field_validator("allow")
    @classmethod
    def _env_paths(cls, value: list[str]) -> list[str]:
        for entry in value:
            parts = entry.split("/")
            if len(parts) != 3 or not all(re.fullmatch(NAME, part) for part in parts):
                raise ValueError(f"{entry!r} is not project/app/env (lowercase letters, digits and dashes)")
        return list(dict.fromkeys(value))


class Canary(_Model):
    """``[env.<name>.canary]``: the steps and analysis bounds of ``strategy = "canary"`` (docs/deployments.md)."""

    steps: list[int] = Field(default_factory=lambda: list(CANARY_DEFAULT_STEPS), min_length=1, max_length=20)
    pause: float = CANARY_DEFAULT_PAUSE
    max_error_ratio: float = Field(default=CANARY_DEFAULT_MAX_ERROR_RATIO, ge=0, le=1)
    max_latency_ratio: float = Field(default=CANARY_DEFAULT_MAX_LATENCY_RATIO, ge=1, le=100)
    min_requests: int = Field(default=CANARY_DEFAULT_MIN_REQUESTS, ge=1, le=10_000_000)

    _durations = field_validator("pause", mode="before")(parse_duration)

    @field_validator("steps")
    @classmethod
    def _rising_to_100(cls, value: list[int]) -> list[int]:
        if any(not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= 100 for step in value):
            raise ValueError("each step is a percentage from 1 to 100")
        if any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"steps must rise ({value})")
        if value[-1] != 100:
            raise ValueError(f"the last step must be 100 ({value})")
        return value


class Env(_Model):
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


class Build(_Model):
    install: str = ""  # replaces the detected install step (shared/buildplan.py); read by the builder
    command: str = ""
    platforms: list[str] = Field(default_factory=list)
    dockerfile: str = Field(default="", description="build with this Dockerfile on a builder's Docker daemon")
    context_dir: str = Field(default="", description="the Docker build context inside the source ('' = its root)")
    build_args: dict[str, str] = Field(default_factory=dict, description="Docker --build-arg values (not secret)")


class Run(_Model):
    command: str = ""


class Addon(_Model):
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


class AppSpec(_Model):
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
