"""Settings from the environment (prefix ``ZATTERA_``) that more than one service, or the CLI, reads.

Timers are settings so tests and demos can shorten them without code changes. Fields are grouped by
concern; the docstring under each field is its description (``use_attribute_docstrings``), as in Kopf's
``configuration.py``. A service's own settings and timers are in ``services/<name>/settings.py``, shaped
the same. Nothing else reads the environment for configuration but the light readers of what a plain CLI
read needs (:mod:`shared.natssettings`) and OpenTelemetry's own ``OTEL_*`` variables; a default is written
once, in its field or in :mod:`shared.defaults` (code that needs it as a parameter default reads
:data:`DEFAULTS`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Final

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.defaults import LEASE_PROBE, LEASE_RENEW, LEASE_TTL, LIVE_TTL, MAX_BATCH, TOMBSTONE_TTL
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
    tombstone_ttl: float = Field(default=TOMBSTONE_TTL, gt=0)
    """How long delete markers stay in the state stream, seconds."""
    live_ttl: float = Field(default=LIVE_TTL, gt=0)
    """How long a live sample (heartbeat, proxy demand) is kept in zattera-live, seconds."""
    audit_max_age: float = Field(default=90 * 24 * 3600.0, gt=0)
    """How long the audit log keeps an entry, seconds (docs/audit.md); applied by the cluster's first init."""
    max_batch: int = Field(default=MAX_BATCH, ge=2, le=MAX_BATCH)
    """Messages per atomic batch (one fenced write)."""

    # ---------------------------------------------------------------- leadership and liveness
    lease_ttl: float = Field(default=LEASE_TTL, gt=0)
    """A leader lease expires this long after its last renewal, seconds."""
    lease_renew: float = Field(default=LEASE_RENEW, gt=0)
    """How often a leader renews its lease, seconds."""
    lease_probe: float = Field(default=LEASE_PROBE, gt=0)
    """How often a standby looks at a lease whose holder answers probes (a holder gone from NATS is replaced
    within about this), seconds."""

    # ---------------------------------------------------------------- every leader loop
    loop_tick: float = Field(default=15.0, gt=0)
    """Safety-net re-evaluation of every leader loop (changes wake them at once), seconds."""
    coalesce_window: float = Field(default=0.005, ge=0)
    """A delay that merges bursts of changes into one evaluation, seconds."""

    # ---------------------------------------------------------------- deployments
    drain_window: float = Field(default=600.0, gt=0)
    """How long blue is kept warm after promotion, seconds (the orchestrator; the proxy's old workers)."""
    health_default_grace: float = Field(default=60.0, gt=0)
    """The health grace of a release that sets none, seconds (the agent's checks, the orchestrator's deadline)."""

    # ---------------------------------------------------------------- instance logs (docs/logs.md)
    # Each environment's stream limits, unless its [env.<name>.logs] sets them.
    logs_max_bytes: int = Field(default=128 * 1024 * 1024, ge=1024 * 1024)
    """Log bytes kept per env."""
    logs_max_age: float = Field(default=7 * 24 * 3600.0, gt=0)
    """How long a log line is kept, seconds."""

    # ---------------------------------------------------------------- volume snapshots
    restore_timeout: float = Field(default=3600.0, gt=0)
    """A RESTORING volume without progress this long (seconds) is given up by the reaper."""
    snapshot_key: SecretStr = SecretStr("")
    """Hex of the optional 32-byte AES-256-GCM key snapshots are sealed with; '' = not sealed."""

    # ---------------------------------------------------------------- tracing (docs/observability.md)
    trace_file: Path = Path("zattera-traces.jsonl")
    """Where the ``file`` exporter appends its spans (JSON lines)."""

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


DEFAULTS: Final = Settings.model_construct()
"""Every field's default, without reading the environment: what a parameter's default names."""
