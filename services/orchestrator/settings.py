"""Orchestrator settings: how long each phase of a deployment may take (environment, prefix ``ZATTERA_``),
beside the shared ones (the drain window is shared: the proxy keeps its old workers that long; the default
health grace too: the agent's checks and the orchestrator's deadline count the same grace)."""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class OrchestratorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- health gating (seconds)
    health_deadline_extra: float = Field(default=60.0, ge=0)
    """The health deadline is 2 x grace + this."""

    # ---------------------------------------------------------------- phase timeouts (seconds)
    building_timeout: float = Field(default=1800.0, gt=0)
    """A deployment BUILDING longer than this fails."""
    placing_timeout: float = Field(default=600.0, gt=0)
    """A deployment PLACING longer than this fails."""
    starting_timeout: float = Field(default=600.0, gt=0)
    """A deployment STARTING longer than this fails."""
    stopping_old_timeout: float = Field(default=300.0, gt=0)
    """A deployment STOPPING_OLD longer than this fails."""
    releasing_timeout: float = Field(default=1800.0, gt=0)
    """A deployment RELEASING (its release command placed, run, or waiting for another deploy's) longer
    than this fails, and its release command is canceled."""

    # ---------------------------------------------------------------- drain (seconds)
    drain_quiet: float = Field(default=4.0, ge=0)
    """An old release is stopped before the drain window ends once every live proxy, in a sample taken at
    least this long after the promotion and routing by it, has nothing in flight to it (0: any such sample;
    as long as the drain window or longer: never early, the old release stays warm for the whole window)."""


DEFAULTS: Final = OrchestratorSettings.model_construct()
