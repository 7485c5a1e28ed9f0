"""Settings from the environment (prefix ``ZATTERA_``), shared by every service and the CLI.

Timers live here too so tests and demos can shorten them without code changes.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_", extra="ignore")

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="comma-separated for a cluster")
    domain: str = Field(default="", description="cluster app domain for implicit routes; empty = none")
    data_dir: Path = Field(default=Path(".zattera"))
    replicas: int = Field(
        default=0, ge=0, le=5, description="replicas of a cluster's first init; 0 = from its size (docs/cluster.md)"
    )
    nats_server_bin: str = Field(default="", description="path of nats-server; empty = the bundled one")
    nats_creds: str = Field(default="", description="NATS credentials file of this process; empty = no auth")
    nats_tls_ca: str = Field(default="", description="CA file the NATS server certificate must chain to")

    lease_ttl: float = Field(default=3.0, gt=0)
    lease_renew: float = Field(default=1.0, gt=0)
    tombstone_ttl: float = Field(default=900.0, gt=0, description="how long delete markers stay")
    live_ttl: float = Field(default=60.0, gt=0)
    loop_tick: float = Field(default=15.0, gt=0)
    serverless_tick: float = Field(default=5.0, gt=0)
    serverless_scale_down_window: float = Field(
        default=30.0, ge=0, description="serverless: demand stays below the replica count this long before scale-down"
    )
    scale_to_zero_idle_timeout: float = Field(
        default=900.0, gt=0, description="idle window of a scale_to_zero env that sets no idle_timeout"
    )
    coalesce_window: float = Field(default=0.005, ge=0, description="delay that merges bursts of changes")
    max_batch: int = Field(default=1000, ge=2, le=1000, description="messages per atomic batch")
    node_heartbeat_deadline: float = Field(default=30.0, gt=0, description="no heartbeat this long: node DOWN")
    liveness_grace: float = Field(default=45.0, ge=0, description="a new liveness leader marks nothing DOWN this long")

    # Deployment orchestrator timers (seconds).
    drain_window: float = Field(default=600.0, gt=0, description="blue kept warm after promotion")
    health_default_grace: float = Field(default=60.0, gt=0, description="grace when the release sets none")
    health_deadline_extra: float = Field(default=60.0, ge=0, description="health deadline = 2 x grace + this")
    building_timeout: float = Field(default=1800.0, gt=0)
    placing_timeout: float = Field(default=600.0, gt=0)
    starting_timeout: float = Field(default=600.0, gt=0)
    stopping_old_timeout: float = Field(default=300.0, gt=0)

    # Instance logs: each environment's stream limits unless its [env.<name>.logs] sets them (docs/logs.md).
    logs_max_bytes: int = Field(default=128 * 1024 * 1024, ge=1024 * 1024, description="log bytes kept per env")
    logs_max_age: float = Field(default=7 * 24 * 3600.0, gt=0, description="seconds a log line is kept")

    # Volume snapshots (seconds).
    restore_timeout: float = Field(
        default=3600.0, gt=0, description="a RESTORING volume without progress this long is given up by the reaper"
    )

    # Metrics (docs/observability.md): each process serves Prometheus metrics on this port; 0 = off.
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus /metrics port; 0 = off")
    metrics_host: str = Field(default="127.0.0.1", description="address the metrics endpoint listens on")


@lru_cache(maxsize=1)
def settings() -> Settings:
    return Settings()
