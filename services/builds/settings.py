"""Builds service settings (environment, prefix ``ZATTERA_BUILDS_``), beside the shared ``ZATTERA_*`` ones."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.natsio import DAY
from shared.registry import BLOB_GRACE


class BuildsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_BUILDS_", extra="ignore")

    source_url_base: str = Field(default="", description="prefix of the tarball digest; '' = zattera-sources")
    registry_addr: str = Field(default="", description="registry host of image refs; '' = the object store")
    local_load: bool = Field(default=False, description="dev: builders load images locally, refs are tags")
    builder_lost_timeout: float = Field(default=240.0, gt=0, description="no builder event for this long fails")
    builder_concurrency: int = Field(default=2, ge=1, description="RUNNING builds per builder node")
    checkpoint_interval: float = Field(default=15.0, gt=0, description="how often last_event_at is made durable")
    retention_interval: float = Field(default=3600.0, gt=0)
    keep_releases: int = Field(default=10, ge=1, description="newest releases kept per environment")
    source_max_age: float = Field(default=DAY, gt=0, description="source tarballs older than this are deleted")
    blob_grace: float = Field(default=BLOB_GRACE, gt=0, description="image blobs this recent are never collected")
