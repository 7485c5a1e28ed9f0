"""Builds service settings (environment, prefix ``ZATTERA_BUILDS_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.registry import BLOB_GRACE
from shared.streams import DAY


class BuildsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_BUILDS_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- sources and images
    source_url_base: str = ""
    """Prefix of the tarball digest; '' = zattera-sources."""
    registry_addr: str = ""
    """Registry host of image refs; '' = the object store."""
    local_load: bool = False
    """dev: builders load images locally, refs are tags."""

    # ---------------------------------------------------------------- builders
    builder_lost_timeout: float = Field(default=240.0, gt=0)
    """A build with no event from its builder this long (seconds) fails."""
    builder_concurrency: int = Field(default=2, ge=1)
    """RUNNING builds per builder node."""
    checkpoint_interval: float = Field(default=15.0, gt=0)
    """How often last_event_at is made durable, seconds."""

    # ---------------------------------------------------------------- retention
    retention_interval: float = Field(default=3600.0, gt=0)
    """How often old releases, sources and image blobs are collected, seconds."""
    keep_releases: int = Field(default=10, ge=1)
    """Newest releases kept per environment."""
    source_max_age: float = Field(default=DAY, gt=0)
    """Source tarballs older than this (seconds) are deleted."""
    blob_grace: float = Field(default=BLOB_GRACE, gt=0)
    """Image blobs this recent (seconds) are never collected."""


DEFAULTS: Final = BuildsSettings.model_construct()
