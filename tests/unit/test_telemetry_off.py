"""Spans with no provider recording (no exporter set up): :func:`shared.telemetry.span` makes no span, and the
trace a request carries still reaches what is sent inside it."""

from __future__ import annotations

import pytest

from shared import telemetry

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def not_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_recording", False)


@pytest.mark.usefixtures("not_recording")
def test_the_trace_of_the_headers_is_carried_by_what_is_sent_inside_and_only_there() -> None:
    assert "traceparent" not in telemetry.inject()
    with telemetry.span("activator.activate", headers={"traceparent": TRACEPARENT}) as current:
        current.set_attribute("environment_id", "e1")  # a no-op, as on the API's no-op span
        assert telemetry.inject()["traceparent"] == TRACEPARENT
        with telemetry.span("state.write", key="env.e1"):
            assert telemetry.inject()["traceparent"] == TRACEPARENT
    assert "traceparent" not in telemetry.inject()


@pytest.mark.usefixtures("not_recording")
def test_the_context_is_restored_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError), telemetry.span("x", headers={"traceparent": TRACEPARENT}):
        raise RuntimeError("boom")
    assert "traceparent" not in telemetry.inject()
