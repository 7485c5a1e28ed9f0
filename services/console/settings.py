"""Console settings (environment, prefix ``ZATTERA_CONSOLE_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_CONSOLE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="address the web console listens on")
    port: int = Field(default=8090, ge=0, le=65535, description="its port (0 = a free one)")
    tls_cert: Path | None = Field(default=None, description="PEM certificate (chain): serve HTTPS")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    secure_cookies: bool = Field(
        default=False,
        description="mark cookies Secure even on plain HTTP requests (set it behind a TLS-terminating proxy)",
    )
    session_ttl: float = Field(default=12 * 3600.0, gt=0, description="a session ends this long after its login")
    login_failures: int = Field(default=5, ge=1, description="failed logins allowed per window, per address and name")
    login_window: float = Field(default=300.0, gt=0, description="the window of login_failures, seconds")

    def ssl_context(self) -> ssl.SSLContext | None:
        """HTTPS when both tls_cert and tls_key are set (cookies are then Secure); None = plain HTTP."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return server_ssl_context(self.tls_cert, self.tls_key)


def server_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
