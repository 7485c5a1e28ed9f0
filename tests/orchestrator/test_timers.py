"""The orchestrator's settings reach its phase timers: every ``ZATTERA_*`` orchestrator setting is a timer."""

from __future__ import annotations

from dataclasses import asdict

from services.orchestrator.model import Timers
from services.orchestrator.settings import DEFAULTS as OWN
from services.orchestrator.settings import OrchestratorSettings
from shared.settings import DEFAULTS as SHARED
from shared.settings import Settings


def test_timers_from_settings_carry_every_setting() -> None:
    own = OrchestratorSettings(
        health_deadline_extra=1.0,
        building_timeout=2.0,
        placing_timeout=3.0,
        starting_timeout=4.0,
        stopping_old_timeout=5.0,
        releasing_timeout=6.0,
        drain_quiet=7.0,
    )
    shared = Settings(drain_window=8.0, health_default_grace=9.0)
    assert asdict(Timers.from_settings(shared, own)) == {
        "drain_window": 8.0,
        "health_default_grace": 9.0,
        "health_deadline_extra": 1.0,
        "building_timeout": 2.0,
        "placing_timeout": 3.0,
        "starting_timeout": 4.0,
        "stopping_old_timeout": 5.0,
        "releasing_timeout": 6.0,
        "drain_quiet": 7.0,
    }


def test_default_timers_are_the_default_settings() -> None:
    assert Timers() == Timers.from_settings(SHARED, OWN)
