"""Console settings (environment, prefix ``ZATTERA_CONSOLE_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_CONSOLE_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="address the web console listens on")
    port: int = Field(default=8090, ge=0, le=65535, description="its port (0 = a free one)")
    secure_cookies: bool = Field(
        default=False,
        description="mark cookies Secure even on plain HTTP requests (set it behind a TLS-terminating proxy)",
    )
    session_ttl: float = Field(default=12 * 3600.0, gt=0, description="a session ends this long after its login")
    login_failures: int = Field(default=5, ge=1, description="failed logins allowed per window, per address and name")
    login_window: float = Field(default=300.0, gt=0, description="the window of login_failures, seconds")
