"""Proxy settings (environment, prefix ``ZATTERA_PROXY_``), beside the shared ``ZATTERA_*`` ones.

Every limit and timer is a setting (the defaults are the guardrails) so tests and demos can shorten
it. The command line overrides the identity and listener ones. The listen address is ``ZATTERA_PROXY_LISTEN``
(``HOST:PORT``) or ``ZATTERA_PROXY_HOST`` / ``ZATTERA_PROXY_PORT``, default ``0.0.0.0:8080``: every interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.proxy.activator import HOLD_TIMEOUT, MAX_HELD_BODY_BYTES, MAX_HELD_PER_ENV
from services.proxy.launch import DEFAULT_HOST, DEFAULT_PORT, split_listen

ROUTES_CACHE_FILE = "routes.pb"


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_PROXY_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- listening and identity
    host: str = DEFAULT_HOST
    """Listen address (default: every interface)."""
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    """Listen port (0 = any free port)."""
    listen: str = ""
    """HOST:PORT; when set, replaces host and port."""
    proxy_id: str = ""
    """Key of this proxy's heartbeat; '' = the host name."""
    node_id: str = ""
    """Node this proxy runs on (P2C tie-break, Activate requests)."""
    cache_dir: Path | None = None
    """Route cache directory; unset = <data_dir>/proxy."""
    engine: Literal["", "python", "haproxy"] = ""
    """Data plane: haproxy (default when installed) or python; '' = pick."""

    # ---------------------------------------------------------------- held requests and upstreams
    heartbeat_interval: float = Field(default=2.0, gt=0)
    """Seconds between this proxy's heartbeats (demand samples for the scalers)."""
    hold_timeout: float = Field(default=HOLD_TIMEOUT, gt=0)
    """Longest wait for an endpoint (504)."""
    max_held_per_env: int = Field(default=MAX_HELD_PER_ENV, ge=0)
    """More held requests get 503."""
    max_held_body_bytes: int = Field(default=MAX_HELD_BODY_BYTES, ge=0)
    """Larger held bodies get 503."""
    activate_timeout: float = Field(default=10.0, gt=0)
    """One Activate request's timeout."""
    upstream_connect_timeout: float = Field(default=1.0, gt=0)
    """Connecting to an instance gives up after this, seconds: HAProxy then sends the request to another
    replica (``retry-on conn-failure``, ``redispatch``), the Python data plane answers 502. A replica on a
    machine that is gone answers nothing (no refusal): the wait is this long, not the client's patience."""
    upstream_keepalive: float = Field(default=30.0, gt=0)
    """Idle upstream connections closed after."""
    shutdown_grace: float = Field(default=5.0, ge=0)
    """In-flight requests drained on SIGTERM."""

    # ---------------------------------------------------------------- TLS (haproxy engine)
    tls_listen: str = ""
    """haproxy engine: HOST:PORT of the TLS listener (SNI, h2); '' = none; port 0 = free."""
    certs_dir: Path | None = None
    """haproxy engine: directory of <name>.pem (chain + key) the TLS listener serves."""
    certs_poll_interval: float = Field(default=1.0, gt=0)
    """How often certs_dir is read for changes."""
    header_timeout: float = Field(default=10.0, gt=0)
    """haproxy engine: a request head must arrive within this (slow clients: 408)."""
    latency_log: bool = True
    """haproxy engine: latency percentiles (per env, per canary release) from HAProxy's request log; off =
    HAProxy's stats averages (docs/deployments.md, "Latency under HAProxy")."""
    latency_log_sample: int = Field(default=1, ge=1, le=10_000)
    """haproxy engine: log one request in this many for the latency percentiles (1 = every request)."""
    latency_log_lines: float = Field(default=128.0, ge=0)
    """haproxy engine: a busy backend logs about this many requests a second, one in a power of two set
    from its rate (a canary's always every request); 0 = every request of every backend."""

    @model_validator(mode="after")
    def _listen(self) -> ProxySettings:
        if self.listen:
            self.host, self.port = split_listen(self.listen)
        return self

    @field_validator("tls_listen")
    @classmethod
    def _tls_listen(cls, value: str) -> str:
        if value:
            split_listen(value)
        return value
