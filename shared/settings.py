"""Settings from the environment (prefix ``ZATTERA_``), shared by every service and the CLI.

Timers live here too so tests and demos can shorten them without code changes. Fields are grouped by
concern; the docstring under each field is its description (``use_attribute_docstrings``), as in Kopf's
``configuration.py``. Each service's own settings (``services/<name>/settings.py``) are shaped the same.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.natssettings import DEFAULT_NATS_URL


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- NATS connection (shared/natssettings.py too)
    nats_url: str = DEFAULT_NATS_URL
    """The NATS server(s) to connect to, comma-separated for a cluster."""
    nats_server_bin: str = ""
    """Path of nats-server (what ``zattera up`` and the tests start); '' = the bundled one."""
    nats_creds: str = ""
    """NATS credentials file of this process; '' = no auth."""
    nats_tls_ca: str = ""
    """CA file the NATS server certificate must chain to; '' = plain connections."""

    # ---------------------------------------------------------------- the cluster
    domain: str = ""
    """The cluster's app domain for implicit routes; '' = none."""
    data_dir: Path = Path(".zattera")
    """Where this machine keeps its state (nats-server's store, agents' instances, caches)."""
    replicas: int = Field(default=0, ge=0, le=5)
    """Stream replicas of a cluster's first init; 0 = from its size (docs/cluster.md)."""
    tombstone_ttl: float = Field(default=900.0, gt=0)
    """How long delete markers stay in the state stream, seconds."""
    live_ttl: float = Field(default=60.0, gt=0)
    """How long a live sample (heartbeat, proxy demand) is kept in zattera-live, seconds."""
    max_batch: int = Field(default=1000, ge=2, le=1000)
    """Messages per atomic batch (one fenced write)."""

    # ---------------------------------------------------------------- leadership and liveness
    lease_ttl: float = Field(default=3.0, gt=0)
    """A leader lease expires this long after its last renewal, seconds."""
    lease_renew: float = Field(default=1.0, gt=0)
    """How often a leader renews its lease, seconds."""
    node_heartbeat_deadline: float = Field(default=30.0, gt=0)
    """A node without a heartbeat this long (seconds) is DOWN."""
    liveness_grace: float = Field(default=45.0, ge=0)
    """A new liveness leader marks nothing DOWN this long (seconds): the heartbeats have to reach it first."""

    # ---------------------------------------------------------------- loops and scaling
    loop_tick: float = Field(default=15.0, gt=0)
    """Safety-net re-evaluation of every leader loop (changes wake them at once), seconds."""
    coalesce_window: float = Field(default=0.005, ge=0)
    """A delay that merges bursts of changes into one evaluation, seconds."""
    serverless_tick: float = Field(default=5.0, gt=0)
    """How often the serverless scaler evaluates demand, seconds."""
    serverless_scale_down_window: float = Field(default=30.0, ge=0)
    """Serverless: demand stays below the replica count this long (seconds) before a scale-down."""
    scale_to_zero_idle_timeout: float = Field(default=900.0, gt=0)
    """The idle window of a scale_to_zero env that sets no idle_timeout, seconds."""

    # ---------------------------------------------------------------- deployment orchestrator (seconds)
    drain_window: float = Field(default=600.0, gt=0)
    """How long blue is kept warm after promotion."""
    health_default_grace: float = Field(default=60.0, gt=0)
    """The health grace of a release that sets none."""
    health_deadline_extra: float = Field(default=60.0, ge=0)
    """The health deadline is 2 x grace + this."""
    building_timeout: float = Field(default=1800.0, gt=0)
    """A deployment BUILDING longer than this fails."""
    placing_timeout: float = Field(default=600.0, gt=0)
    """A deployment PLACING longer than this fails."""
    starting_timeout: float = Field(default=600.0, gt=0)
    """A deployment STARTING longer than this fails."""
    stopping_old_timeout: float = Field(default=300.0, gt=0)
    """A deployment STOPPING_OLD longer than this fails."""

    # ---------------------------------------------------------------- instance logs (docs/logs.md)
    # Each environment's stream limits, unless its [env.<name>.logs] sets them.
    logs_max_bytes: int = Field(default=128 * 1024 * 1024, ge=1024 * 1024)
    """Log bytes kept per env."""
    logs_max_age: float = Field(default=7 * 24 * 3600.0, gt=0)
    """How long a log line is kept, seconds."""

    # ---------------------------------------------------------------- volume snapshots
    restore_timeout: float = Field(default=3600.0, gt=0)
    """A RESTORING volume without progress this long (seconds) is given up by the reaper."""

    # ---------------------------------------------------------------- metrics (docs/observability.md)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """The port each process serves Prometheus /metrics on; 0 = off."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics endpoint listens on."""

    # ---------------------------------------------------------------- process health (shared/health.py)
    health_file: str = ""
    """A file the process touches every 5 s while it runs connected to NATS, removed when it stops (a
    container's health check asks that it was touched since the last check: ``sh shared/health.sh FILE``);
    '' = none."""


@lru_cache(maxsize=1)
def settings() -> Settings:
    return Settings()
