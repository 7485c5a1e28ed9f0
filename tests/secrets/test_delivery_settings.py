"""The delivery loops' settings as the service reads them, and the names their targets may have."""

from __future__ import annotations

from services.secrets.delivery import DeliverySettings
from services.secrets.drains import DrainSettings
from services.secrets.settings import SecretsSettings
from shared import drains, notify


def test_each_loop_reads_its_own_prefixed_settings() -> None:
    cfg = SecretsSettings(
        notify_timeout=5.0,
        notify_retry_first=0.5,
        notify_retry_most=30.0,
        notify_failing_after=2,
        drain_timeout=7.0,
        drain_retry_first=2.0,
        drain_retry_most=90.0,
        drain_failing_after=4,
    )
    assert DeliverySettings.of(cfg, "notify") == DeliverySettings(
        timeout=5.0, retry_first=0.5, retry_most=30.0, failing_after=2
    )
    assert DrainSettings.of(cfg, "drain") == DrainSettings(
        timeout=7.0, retry_first=2.0, retry_most=90.0, failing_after=4
    )


def test_channel_and_drain_names_are_dns_labels() -> None:
    assert notify.name_problem("ops-alerts") is None
    assert drains.name_problem("a" * 63) is None
    assert notify.name_problem("Ops") == "'Ops' is not a channel name (lowercase letters, digits and '-', at most 63)"
    assert drains.name_problem("-x") == "'-x' is not a drain name (lowercase letters, digits and '-', at most 63)"
    assert drains.name_problem("a" * 64) is not None
