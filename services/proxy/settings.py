"""Proxy settings (environment, prefix ``ZATTERA_PROXY_``), beside the shared ``ZATTERA_*`` ones.

The reference's guardrails are the defaults; every timer is a setting so tests and demos can shorten
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
    model_config = SettingsConfigDict(env_prefix="ZATTERA_PROXY_", extra="ignore")

    host: str = Field(default=DEFAULT_HOST, description="listen address (default: every interface)")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="listen port (0 = any free port)")
    listen: str = Field(default="", description="HOST:PORT; when set, replaces host and port")
    proxy_id: str = Field(default="", description="key of this proxy's heartbeat; '' = the host name")
    node_id: str = Field(default="", description="node this proxy runs on (P2C tie-break, Activate requests)")
    cache_dir: Path | None = Field(default=None, description="route cache directory; unset = <data_dir>/proxy")
    engine: Literal["", "python", "haproxy"] = Field(
        default="", description="data plane: haproxy (default when installed) or python; '' = pick"
    )

    heartbeat_interval: float = Field(default=2.0, gt=0)
    hold_timeout: float = Field(default=HOLD_TIMEOUT, gt=0, description="longest wait for an endpoint (504)")
    max_held_per_env: int = Field(default=MAX_HELD_PER_ENV, ge=0, description="more held requests get 503")
    max_held_body_bytes: int = Field(default=MAX_HELD_BODY_BYTES, ge=0, description="larger held bodies get 503")
    activate_timeout: float = Field(default=10.0, gt=0, description="one Activate request's timeout")
    upstream_connect_timeout: float = Field(default=5.0, gt=0)
    upstream_keepalive: float = Field(default=30.0, gt=0, description="idle upstream connections closed after")
    shutdown_grace: float = Field(default=5.0, ge=0, description="in-flight requests drained on SIGTERM")
    tls_listen: str = Field(
        default="", description="haproxy engine: HOST:PORT of the TLS listener (SNI, h2); '' = none; port 0 = free"
    )
    certs_dir: Path | None = Field(
        default=None, description="haproxy engine: directory of <name>.pem (chain + key) the TLS listener serves"
    )
    certs_poll_interval: float = Field(default=1.0, gt=0, description="how often certs_dir is read for changes")
    header_timeout: float = Field(
        default=10.0, gt=0, description="haproxy engine: a request head must arrive within this (slow clients: 408)"
    )

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
