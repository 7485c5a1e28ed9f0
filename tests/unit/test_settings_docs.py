"""Every setting says what it is: a docstring under each field (its description), as Kopf's settings do."""

from __future__ import annotations

import pytest
from pydantic_settings import BaseSettings

from services.agent.settings import AgentSettings
from services.autoscale.settings import AutoscaleSettings
from services.builds.settings import BuildsSettings
from services.certs.settings import CertsSettings
from services.console.settings import ConsoleSettings
from services.join.settings import MachineSettings
from services.orchestrator.settings import OrchestratorSettings
from services.proxy.settings import ProxySettings
from services.scheduler.settings import SchedulerSettings
from services.secrets.settings import SecretsSettings
from shared.settings import DEFAULTS, Settings

ALL = [
    Settings,
    AgentSettings,
    AutoscaleSettings,
    BuildsSettings,
    CertsSettings,
    ConsoleSettings,
    MachineSettings,
    OrchestratorSettings,
    ProxySettings,
    SchedulerSettings,
    SecretsSettings,
]


@pytest.mark.parametrize("model", ALL, ids=lambda m: m.__name__)
def test_every_setting_has_a_docstring(model: type[BaseSettings]) -> None:
    assert model.model_config.get("use_attribute_docstrings"), f"{model.__name__}: docstrings are not descriptions"
    undocumented = [name for name, info in model.model_fields.items() if not (info.description or "").strip()]
    assert not undocumented, f"{model.__name__}: settings without a docstring: {undocumented}"


def test_the_environment_names_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZATTERA_LOOP_TICK", "2.5")
    monkeypatch.setenv("ZATTERA_DRAIN_WINDOW", "9")
    monkeypatch.setenv("ZATTERA_PLACING_TIMEOUT", "11")
    monkeypatch.setenv("ZATTERA_NODE_HEARTBEAT_DEADLINE", "4")
    monkeypatch.setenv("ZATTERA_SERVERLESS_TICK", "1")
    monkeypatch.setenv("ZATTERA_SNAPSHOT_KEY", "ab" * 32)
    monkeypatch.setenv("ZATTERA_AGENT_RESTART_BACKOFF_MAX", "7")
    monkeypatch.setenv("ZATTERA_PROXY_HOLD_TIMEOUT", "3")
    shared = Settings()
    assert (shared.loop_tick, shared.drain_window) == (2.5, 9.0)
    assert shared.snapshot_key.get_secret_value() == "ab" * 32 and "abab" not in repr(shared)
    assert OrchestratorSettings().placing_timeout == 11.0
    assert SchedulerSettings().node_heartbeat_deadline == 4.0
    assert AutoscaleSettings().serverless_tick == 1.0
    assert AgentSettings().restart_backoff_max == 7.0
    assert ProxySettings().hold_timeout == 3.0


def test_the_defaults_are_read_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZATTERA_LOOP_TICK", "2.5")
    assert DEFAULTS.loop_tick == Settings.model_fields["loop_tick"].default == 15.0


@pytest.mark.parametrize(
    "environ",
    [{}, {"ZATTERA_NATS_URL": "nats://a:1,nats://b:2", "ZATTERA_NATS_CREDS": "/c.creds", "zattera_nats_tls_ca": "/ca"}],
)
def test_the_connection_settings_read_alone_are_the_settings_ones(monkeypatch: pytest.MonkeyPatch, environ) -> None:
    """``shared.natssettings`` (what the CLI reads, without pydantic-settings) agrees with ``Settings``."""
    from shared.natssettings import NatsSettings

    for name in ("ZATTERA_NATS_URL", "ZATTERA_NATS_CREDS", "ZATTERA_NATS_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    full, alone = Settings(), NatsSettings.from_environ()
    assert (alone.nats_url, alone.nats_creds, alone.nats_tls_ca) == (full.nats_url, full.nats_creds, full.nats_tls_ca)
