"""Console settings (environment, prefix ``ZATTERA_CONSOLE_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_CONSOLE_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- listening
    host: str = "127.0.0.1"
    """Address the web console listens on."""
    port: int = Field(default=8090, ge=0, le=65535)
    """Its port (0 = a free one)."""
    tls_cert: Path | None = None
    """PEM certificate (chain): serve HTTPS."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    secure_cookies: bool = False
    """Mark cookies Secure even on plain HTTP requests (set it behind a TLS-terminating proxy)."""

    # ---------------------------------------------------------------- sessions and logins
    session_ttl: float = Field(default=12 * 3600.0, gt=0)
    """A session ends this long (seconds) after its login."""
    login_failures: int = Field(default=5, ge=1)
    """Failed logins allowed per window, per address and name."""
    login_window: float = Field(default=300.0, gt=0)
    """The window of login_failures, seconds."""

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
