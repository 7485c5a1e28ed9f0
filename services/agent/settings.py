"""Agent settings (environment, prefix ``ZATTERA_AGENT_``), beside the shared ``ZATTERA_*`` ones.

Every timer is a setting so tests and demos can shorten it; the command line overrides the identity ones.
Fields are grouped by concern, each with its docstring (its description), as in ``shared/settings.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_NODE_ID = re.compile(r"^[A-Za-z0-9_-]+$")


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_AGENT_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- identity: what registration asserts
    node_id: str = ""
    """The node id; '' = the host name (dots become dashes)."""
    labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    """Operator labels asserted at registration (k=v,k2=v2 in the environment)."""
    builder: bool = False
    """Serve source builds on zattera.agent.<node>.build."""
    roles: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["worker"])
    """worker and/or control (comma-separated in the environment)."""
    mesh_ip: str = ""
    """The address other nodes reach this node's instances at (instances listen there)."""
    public_endpoint: str = ""
    """The machine's address other machines reach (its WireGuard endpoint, UDP 51820): with ``mesh_ip``, the
    agent keeps the encrypted mesh (services/agent/mesh.py)."""
    join_token: str = ""
    """A single-use token exchanged for this node's NATS credential on first start."""

    # ---------------------------------------------------------------- reporting to the control plane
    heartbeat_interval: float = Field(default=5.0, gt=0)
    """Seconds between heartbeats into zattera-live (node liveness and per-instance samples)."""
    reconcile_tick: float = Field(default=5.0, gt=0)
    """Safety-net re-evaluation of every assignment, seconds (changes wake it at once)."""
    report_retry: float = Field(default=0.5, gt=0)
    """Delay before re-trying a refused observed write, seconds."""

    # ---------------------------------------------------------------- restarts (restart_policy.py)
    max_start_attempts: int = Field(default=3, ge=1)
    """Failed starts of one config before its assignment is parked FAILED."""
    restart_backoff: float = Field(default=1.0, gt=0)
    """The first restart delay, seconds; it doubles with each failed start."""
    restart_backoff_max: float = Field(default=30.0, gt=0)
    """The longest restart delay, seconds."""
    stable_after: float = Field(default=10.0, gt=0)
    """A run this long (seconds) resets the failed-start count."""

    # ---------------------------------------------------------------- instance lifecycle
    default_stop_grace: float = Field(default=10.0, gt=0)
    """SIGTERM -> SIGKILL, seconds, when the service spec sets no stop_grace."""
    min_healthy_time: float = Field(default=3.0, ge=0)
    """How long an instance without a declared health check must run before it counts as HEALTHY, seconds,
    when its env sets no min_healthy_time (0 = at once); a process that exits sooner is a failed start."""
    startup_probe_interval: float = Field(default=0.2, gt=0)
    """Health probe cadence until the first success (then the spec's interval), seconds."""
    adopted_poll_interval: float = Field(default=1.0, gt=0)
    """Exit polling of processes adopted on start (not our children: no exit notification), seconds."""
    stop_on_exit: bool = False
    """Stop the instances when the agent stops (else the next agent run adopts them)."""

    # ---------------------------------------------------------------- instance logs (logs.py)
    log_poll_interval: float = Field(default=0.05, gt=0)
    """How often instance output files are read, seconds."""
    log_max_backlog: int = Field(default=8 * 1024 * 1024, ge=4096)
    """Unshipped bytes per output file before the oldest lines are dropped."""
    log_batch_bytes: int = Field(default=512 * 1024, ge=1024, le=640 * 1024)
    """Bytes of lines per log message."""
    log_batch_lines: int = Field(default=8192, ge=2, le=10_000)
    """Lines per log message."""
    log_stderr_tail: int = Field(default=20, ge=0)
    """Last stderr lines kept for crash reports (observed.last_exit)."""
    log_drain_timeout: float = Field(default=5.0, gt=0)
    """How long shipping the last lines of an exited instance may take, seconds."""

    # ---------------------------------------------------------------- private networking (docs/networking.md)
    private_network: bool = True
    """Run the node forwarder and resolver for VIPs and *.internal names."""
    dns_port: int = Field(default=53, ge=0, le=65535)
    """Port of the per-env *.internal resolvers (0 = none)."""
    private_network_kernel: bool = True
    """Carry private-network connections with iptables DNAT rules where the agent can (root, iptables);
    false = always the user-space forwarder."""

    # ---------------------------------------------------------------- container runtime (docs/containers.md)
    runtime: str = ""
    """process or docker; '' = docker when a Docker daemon answers (with the base image), else process."""
    docker_host: str = Field(default="", validation_alias=AliasChoices("ZATTERA_AGENT_DOCKER_HOST", "DOCKER_HOST"))
    """The Docker daemon address (``ZATTERA_AGENT_DOCKER_HOST``, else ``DOCKER_HOST``); '' = the standard socket."""
    docker_base_image: str = "zattera/base:latest"
    """What registry images without a root filesystem of their own run on."""
    pids_limit: int = Field(default=512, ge=0)
    """Docker runtime: processes per instance (0 = unlimited)."""
    docker_network: Literal["host", "bridge", "auto"] = "host"
    """Docker runtime: host network, or the daemon's bridge network 'zattera' with published ports ('auto':
    bridge when the daemon makes one and the mesh address is not loopback)."""

    # ---------------------------------------------------------------- isolation (sandbox.py, SECURITY.md "Apps")
    sandbox: Literal["auto", "on", "off"] = "auto"
    """Process runtime: run instances, jobs and build steps in a bubblewrap sandbox as their environment's
    user ('auto': when this machine can; 'on': refuse to start otherwise; 'off': never)."""
    allow_unisolated: bool = False
    """On a secured cluster, run apps even where they cannot be isolated (they could read this node's
    credential and other apps' files and environment)."""
    sandbox_uid_base: int = Field(default=0x70000000, ge=1000, le=0xFFFF0000)
    """First uid of the range the environments' users are taken from."""
    sandbox_uid_count: int = Field(default=65536, ge=1, le=1 << 24)
    """Size of that range."""
    sandbox_read_only: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """More directories shown read-only in every sandbox (comma-separated), e.g. another language runtime's
    installation; /usr, /etc and the agent's Python always are."""
    sandbox_hidden: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Directories covered (empty) in every sandbox besides the agent's data directory, should they lie in a
    shown one (comma-separated): ``zattera up`` names its whole data directory."""
    sandbox_bwrap: str = "bwrap"
    """The bubblewrap program."""
    sandbox_fence: bool = True
    """Fence the environments' users off this machine's control-plane listeners with iptables rules
    (firewall.py): the NATS servers, every port the ``sandbox_fence_pids`` process trees listen on."""
    sandbox_fence_pids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """Processes whose trees' listening ports apps may not connect to (comma-separated; the agent's own tree
    always): ``zattera up`` names itself."""
    sandbox_fence_allow: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """Ports apps may connect to all the same (comma-separated): the proxy's public ones."""
    sandbox_fence_ports: Annotated[list[int], NoDecode] = Field(default_factory=list)
    """Ports fenced from the start, before anything listens there (comma-separated): ``zattera up`` names the
    console's and the services' metrics ports, so that a build step run while the console is still starting
    cannot reach it in the moment before the fence's refresh sees the console listen."""

    # ---------------------------------------------------------------- builds (builder.py)
    build_keepalive: float = Field(default=60.0, gt=0)
    """A build step that prints nothing logs a line this often, seconds."""

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

    @field_validator("sandbox_fence_pids", "sandbox_fence_allow", "sandbox_fence_ports", mode="before")
    @classmethod
    def _numbers_from_text(cls, value: object) -> object:
        if isinstance(value, str):
            return [int(v) for v in value.split(",") if v.strip()]
        return value

    @field_validator("sandbox_read_only", "sandbox_hidden", mode="before")
    @classmethod
    def _paths_from_text(cls, value: object) -> object:
        return [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value

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
