"""Secrets service settings (environment, prefix ``ZATTERA_SECRETS_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class SecretsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_SECRETS_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- the cluster key
    key: SecretStr = SecretStr("")
    """The cluster key's private half, 64 hex digits; seeds the key file when there is none."""
    key_file: Path | None = None
    """The keyring file; default <ZATTERA_DATA_DIR>/secrets/cluster.key."""
    open_wait: float = Field(default=3.0, gt=0)
    """How long a request waits for the view to show its node key or assignment, seconds."""

    # ---------------------------------------------------------------- garbage collection
    gc_grace: float = Field(default=600.0, gt=0)
    """An unused secret version is deleted once it is at least this old, seconds."""

    # ---------------------------------------------------------------- notifications (docs/notifications.md)
    notify_timeout: float = Field(default=10.0, gt=0)
    """Seconds one delivery to a notification channel may take."""
    notify_retry_first: float = Field(default=1.0, gt=0)
    """Seconds before a failed delivery is tried again (doubling with each failure)."""
    notify_retry_most: float = Field(default=60.0, gt=0)
    """The longest pause between two attempts of a delivery, seconds."""
    notify_failing_after: int = Field(default=3, ge=1)
    """Failed attempts in a row after which a channel is FAILING (event ``notify.failing``)."""

    # ---------------------------------------------------------------- log drains (docs/logs.md "Drains")
    drain_timeout: float = Field(default=10.0, gt=0)
    """Seconds one delivery to a log drain may take."""
    drain_retry_first: float = Field(default=1.0, gt=0)
    """Seconds before a failed drain delivery is tried again (doubling with each failure)."""
    drain_retry_most: float = Field(default=60.0, gt=0)
    """The longest pause between two attempts of a drain delivery, seconds."""
    drain_failing_after: int = Field(default=3, ge=1)
    """Failed attempts in a row after which a drain is FAILING (event ``drain.failing``)."""

    def keyring_path(self, data_dir: Path) -> Path:
        return self.key_file or data_dir / "secrets" / "cluster.key"


DEFAULTS: Final = SecretsSettings.model_construct()
