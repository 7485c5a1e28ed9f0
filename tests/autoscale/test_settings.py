"""The scaling windows are the autoscale service's settings (``ZATTERA_*``, services/autoscale/settings.py),
and the service builds its loops with them (services/autoscale/__main__.py): the serverless scale-down
window and the idle window of a ``scale_to_zero`` env that sets no ``idle_timeout``. On real NATS with a fake clock."""

from __future__ import annotations

import pytest

from services.autoscale.__main__ import scaling_loops
from services.autoscale.autoscaler import Autoscaler
from services.autoscale.common import ScalingLoop
from services.autoscale.scaletozero import ScaleToZero
from services.autoscale.serverless import Serverless
from services.autoscale.settings import DEFAULTS, AutoscaleSettings
from shared.loop import LoopDeps
from shared.settings import Settings
from tests.autoscale.conftest import Harness
from tests.autoscale.helpers import base_objects, node_beat, running, scaled_env, traffic

WINDOW_ENV = "ZATTERA_SERVERLESS_SCALE_DOWN_WINDOW"
IDLE_ENV = "ZATTERA_SCALE_TO_ZERO_IDLE_TIMEOUT"


def loops_from(h: Harness, cfg: AutoscaleSettings) -> tuple[Autoscaler, ScaleToZero, Serverless]:
    return scaling_loops(Settings(), cfg, h.live, LoopDeps(h.conn, h.view, h.clock, coalesce=0.0))


async def lead(h: Harness, loop: ScalingLoop) -> None:
    """Give the loop a writer fenced by a lease held for the test, as a new term would."""
    loop.writer = loop.fenced_writer(await h.leadership(loop.name))
    loop.on_term_start()


async def report(h: Harness, loop: ScalingLoop, *, inflight: int = 0) -> None:
    """A proxy sample for env1 now, then one evaluation."""
    await h.beat(node_beat(h.clock.now(), proxy={"env1": traffic(inflight=inflight)}))
    await loop.pass_once()


def test_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WINDOW_ENV, raising=False)
    monkeypatch.delenv(IDLE_ENV, raising=False)
    cfg = AutoscaleSettings()
    assert cfg.serverless_scale_down_window == DEFAULTS.serverless_scale_down_window == 30.0
    assert cfg.scale_to_zero_idle_timeout == DEFAULTS.scale_to_zero_idle_timeout == 900.0


def test_the_environment_sets_both_windows_of_the_loops(monkeypatch: pytest.MonkeyPatch, h: Harness) -> None:
    monkeypatch.setenv(WINDOW_ENV, "12")
    monkeypatch.setenv(IDLE_ENV, "120")
    _, scaletozero, serverless = loops_from(h, AutoscaleSettings())
    assert serverless.window == 12.0
    assert scaletozero.default_idle_timeout == 120.0


async def test_serverless_scales_down_after_the_configured_window(h: Harness) -> None:
    _, _, loop = loops_from(h, AutoscaleSettings(serverless_scale_down_window=10.0))
    await lead(h, loop)
    await h.seed(*base_objects(scaled_env(max_concurrency=10, min_replicas=1, max_replicas=10, effective=5)))
    await report(h, loop, inflight=10)  # asks for 1: the window starts
    await h.clock.advance(9.0)
    await report(h, loop, inflight=10)
    assert h.env().effective_replicas == 5
    await h.clock.advance(1.0)
    await report(h, loop, inflight=10)
    assert h.env().effective_replicas == 1  # the built-in 30 s would still hold 5


async def test_scale_to_zero_without_idle_timeout_cools_after_the_configured_default(h: Harness) -> None:
    _, loop, _ = loops_from(h, AutoscaleSettings(scale_to_zero_idle_timeout=60.0))
    await lead(h, loop)
    env = scaled_env(scale_to_zero=True, effective=1, idle_timeout=None)
    await h.seed(*base_objects(env, running(1)))
    await report(h, loop)  # first sight grants a full window
    await h.clock.advance(59.0)
    await report(h, loop)
    assert h.env().effective_replicas == 1
    await h.clock.advance(2.0)
    await report(h, loop)
    assert h.env().effective_replicas == 0  # the built-in 15 min would still hold 1


async def test_an_env_idle_timeout_still_wins_over_the_default(h: Harness) -> None:
    _, loop, _ = loops_from(h, AutoscaleSettings(scale_to_zero_idle_timeout=60.0))
    await lead(h, loop)
    await h.seed(*base_objects(scaled_env(scale_to_zero=True, effective=1, idle_timeout=300.0), running(1)))
    await report(h, loop)
    await h.clock.advance(120.0)
    await report(h, loop)
    assert h.env().effective_replicas == 1
