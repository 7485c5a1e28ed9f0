"""Agent settings (environment, prefix ``ZATTERA_AGENT_``), beside the shared ``ZATTERA_*`` ones.

Every timer is a setting so tests and demos can shorten it; the command line overrides the identity ones.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_NODE_ID = re.compile(r"^[A-Za-z0-9_-]+$")


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_AGENT_", extra="ignore")

    node_id: str = Field(default="", description="node id; '' = the host name (dots become dashes)")
    labels: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="operator labels asserted at registration (k=v,k2=v2 in the environment)"
    )
    builder: bool = Field(default=False, description="serve source builds on zattera.agent.<node>.build")
    roles: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["worker"], description="worker and/or control (comma-separated in the environment)"
    )
    mesh_ip: str = Field(default="", description="address other nodes reach this node's instances at")
    join_token: str = Field(
        default="", description="single-use token exchanged for this node's NATS credential on first start"
    )

    heartbeat_interval: float = Field(default=5.0, gt=0)
    reconcile_tick: float = Field(default=5.0, gt=0, description="safety-net re-evaluation of every assignment")
    report_retry: float = Field(default=0.5, gt=0, description="delay before re-trying a refused observed write")

    max_start_attempts: int = Field(default=3, ge=1, description="failed starts before an assignment is FAILED")
    restart_backoff: float = Field(default=1.0, gt=0, description="first restart delay; doubles per failed start")
    restart_backoff_max: float = Field(default=30.0, gt=0)
    stable_after: float = Field(default=10.0, gt=0, description="a run this long resets the failed-start count")
    default_stop_grace: float = Field(default=10.0, gt=0, description="SIGTERM -> SIGKILL when the spec sets none")
    startup_probe_interval: float = Field(
        default=0.2, gt=0, description="health probe cadence until the first success (then the spec's interval)"
    )
    adopted_poll_interval: float = Field(default=1.0, gt=0, description="exit polling of processes adopted on start")
    stop_on_exit: bool = Field(default=False, description="stop instances when the agent stops (else they are adopted)")

    log_poll_interval: float = Field(default=0.05, gt=0, description="how often instance output files are read")
    log_max_backlog: int = Field(
        default=8 * 1024 * 1024, ge=4096, description="unshipped bytes per output file before old lines are dropped"
    )
    log_batch_bytes: int = Field(default=512 * 1024, ge=1024, le=640 * 1024, description="bytes of lines per message")
    log_batch_lines: int = Field(default=8192, ge=2, le=10_000, description="lines per message")
    log_stderr_tail: int = Field(default=20, ge=0, description="last stderr lines kept for crash reports")
    log_drain_timeout: float = Field(default=5.0, gt=0, description="shipping the last lines of an exited instance")

    private_network: bool = Field(
        default=True, description="node forwarder and resolver for VIPs and *.internal names (docs/networking.md)"
    )
    dns_port: int = Field(default=53, ge=0, le=65535, description="port of the per-env *.internal resolvers (0 = none)")
    runtime: str = Field(
        default="", description="process or docker; '' = docker when a Docker daemon answers, else process"
    )
    docker_host: str = Field(default="", description="Docker daemon address; '' = $DOCKER_HOST or the standard socket")
    docker_base_image: str = Field(
        default="zattera/base:latest", description="what registry images without a root filesystem run on"
    )
    pids_limit: int = Field(default=512, ge=0, description="docker runtime: processes per instance (0 = unlimited)")
    docker_network: Literal["host", "bridge", "auto"] = Field(
        default="host",
        description="docker runtime: host network, or the daemon's bridge network 'zattera' with published ports "
        "('auto': bridge when the daemon makes one and the mesh address is not loopback)",
    )

    build_keepalive: float = Field(default=60.0, gt=0, description="a silent build step logs a line this often")

    @field_validator("node_id")
    @classmethod
    def _valid_node_id(cls, value: str) -> str:
        if value and not _NODE_ID.match(value):
            raise ValueError("node id may contain only letters, digits, '-' and '_'")
        return value

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str) -> str:
        if value and value not in ("process", "docker"):
            raise ValueError(f"unknown runtime {value!r}: use process or docker")
        return value

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_from_text(cls, value: object) -> object:
        return parse_labels(value) if isinstance(value, str) else value

    @field_validator("roles", mode="before")
    @classmethod
    def _roles_from_text(cls, value: object) -> object:
        return [r.strip() for r in value.split(",") if r.strip()] if isinstance(value, str) else value

    @field_validator("roles")
    @classmethod
    def _valid_roles(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - {"worker", "control"})
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(unknown)}: use worker and/or control")
        return value


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` → mapping; a bad item raises ValueError naming it."""
    labels: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad label {item!r}: expected key=value")
        labels[key.strip()] = value.strip()
    return labels
