"""The tables an env of a ``zattera.toml`` holds (:mod:`cli.spec`): replicas, resources, ports, health check,
autoscaling, volumes, cron entries, rate limit, middleware, logs, network and canary, each validated on its own."""

from __future__ import annotations

import ipaddress
import itertools
import re
from typing import Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from cli.spec_values import NAME, Flag, Model, Name, parse_duration, parse_size
from shared.actions.volumes import PolicyChange
from shared.canary import (
    CANARY_DEFAULT_MAX_ERROR_RATIO,
    CANARY_DEFAULT_MAX_LATENCY_RATIO,
    CANARY_DEFAULT_MIN_REQUESTS,
    CANARY_DEFAULT_PAUSE,
    CANARY_DEFAULT_STEPS,
)
from shared.jobs import DEFAULT_DEADLINE, MAX_RETRIES, CommandError, check_command
from shared.schedule import validate_schedule

_BCRYPT_HASH = re.compile(r"^\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}$")


class Replicas(Model):
    min: int = Field(default=1, ge=0, le=1000)
    max: int = Field(default=0, ge=0, le=1000, description="0 = no autoscaling ceiling beyond min")

    @model_validator(mode="after")
    def _max_not_below_min(self) -> Replicas:
        if self.max and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class Resources(Model):
    cpu_millis: int = Field(default=0, ge=0, le=1_000_000)
    memory_mb: int = Field(default=0, ge=0, le=10_000_000)


class Port(Model):
    name: Name = "http"
    container_port: int = Field(default=0, ge=0, le=65535)
    protocol: Literal["http", "tcp", "udp"] = "http"
    public_l4_port: int = Field(default=0, ge=0, le=65535)


class HealthCheck(Model):
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


class Autoscale(Model):
    target_cpu_percent: int = Field(default=0, ge=0, le=100)
    target_memory_percent: int = Field(default=0, ge=0, le=100)
    target_rps_per_replica: int = Field(default=0, ge=0)


class Volume(Model):
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


class CronEntry(Model):
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


class RateLimit(Model):
    requests_per_second: int = Field(ge=1)
    burst: int = Field(default=0, ge=0)


class BasicAuthUser(Model):
    username: str = Field(min_length=1, max_length=256, pattern=r"^[^:\s]+$", description="no ':' nor spaces")
    password_hash: str = Field(description="bcrypt hash ($2b$...), e.g. from `htpasswd -nbB user password`")

    @field_validator("password_hash")
    @classmethod
    def _bcrypt(cls, value: str) -> str:
        if not _BCRYPT_HASH.match(value):
            raise ValueError("must be a bcrypt hash ($2a$/$2b$/$2y$, 60 characters), never a plain password")
        return value


class Middleware(Model):
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


class Logs(Model):
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


class Network(Model):
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


class Canary(Model):
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
