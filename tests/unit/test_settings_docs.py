"""Every setting says what it is: a docstring under each field (its description), as Kopf's settings do."""

from __future__ import annotations

import pytest
from pydantic_settings import BaseSettings

from services.agent.settings import AgentSettings
from services.builds.settings import BuildsSettings
from services.certs.settings import CertsSettings
from services.console.settings import ConsoleSettings
from services.proxy.settings import ProxySettings
from services.secrets.settings import SecretsSettings
from shared.settings import Settings

ALL = [Settings, AgentSettings, BuildsSettings, CertsSettings, ConsoleSettings, ProxySettings, SecretsSettings]


@pytest.mark.parametrize("model", ALL, ids=lambda m: m.__name__)
def test_every_setting_has_a_docstring(model: type[BaseSettings]) -> None:
    assert model.model_config.get("use_attribute_docstrings"), f"{model.__name__}: docstrings are not descriptions"
    undocumented = [name for name, info in model.model_fields.items() if not (info.description or "").strip()]
    assert not undocumented, f"{model.__name__}: settings without a docstring: {undocumented}"


def test_the_environment_names_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZATTERA_LOOP_TICK", "2.5")
    monkeypatch.setenv("ZATTERA_AGENT_RESTART_BACKOFF_MAX", "7")
    monkeypatch.setenv("ZATTERA_PROXY_HOLD_TIMEOUT", "3")
    assert Settings().loop_tick == 2.5
    assert AgentSettings().restart_backoff_max == 7.0
    assert ProxySettings().hold_timeout == 3.0
