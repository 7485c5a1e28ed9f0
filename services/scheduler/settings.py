"""Scheduler settings: node liveness (environment, prefix ``ZATTERA_``), beside the shared ones."""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- node liveness (seconds)
    node_heartbeat_deadline: float = Field(default=30.0, gt=0)
    """A node without a heartbeat this long is DOWN."""
    liveness_grace: float = Field(default=45.0, ge=0)
    """A new liveness leader marks nothing DOWN this long: the heartbeats have to reach it first."""


DEFAULTS: Final = SchedulerSettings.model_construct()
