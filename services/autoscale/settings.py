"""Autoscale settings: the scaling loops' timers (environment, prefix ``ZATTERA_``), beside the shared ones."""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AutoscaleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ZATTERA_", extra="ignore", use_attribute_docstrings=True)

    # ---------------------------------------------------------------- serverless concurrency scaling
    serverless_tick: float = Field(default=5.0, gt=0)
    """How often the serverless scaler evaluates demand, seconds."""
    serverless_scale_down_window: float = Field(default=30.0, ge=0)
    """Demand stays below the replica count this long (seconds) before a serverless scale-down."""

    # ---------------------------------------------------------------- scale to zero
    # Cooling too early costs users a cold start (seconds of latency on the next request); cooling late only
    # costs an idle replica, so the default leans long: 15 min, as zattera.toml examples write idle_timeout.
    scale_to_zero_idle_timeout: float = Field(default=900.0, gt=0)
    """The idle window of a scale_to_zero env that sets no idle_timeout, seconds."""


DEFAULTS: Final = AutoscaleSettings.model_construct()
