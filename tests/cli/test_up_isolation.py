"""``zattera up --secure`` on a machine that cannot sandbox apps stops before starting anything, naming the
reason and the override; with ``--allow-unisolated-apps`` it starts, and its agent is told (SECURITY.md,
"Apps"). An open cluster starts either way (its agent says how apps run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import cli.security_cmds
from tests.cli.test_up_https import started_cluster


@pytest.fixture
def cannot_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZATTERA_AGENT_SANDBOX_BWRAP", "/nonexistent/bwrap")
    monkeypatch.setenv("ZATTERA_AGENT_ALLOW_UNISOLATED", "0")  # restored (removed) after the test


def test_a_secured_up_that_cannot_sandbox_stops_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cannot_sandbox: None
) -> None:
    code, output, started = started_cluster(monkeypatch, tmp_path, "--secure", runs_up=cli.security_cmds)
    assert code == 2 and not started, output
    assert "bubblewrap is not installed" in output and "--allow-unisolated-apps" in output
    assert not (tmp_path / "control" / "security").exists()  # nothing prepared


def test_the_override_starts_it_and_tells_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cannot_sandbox: None
) -> None:
    flags = ("--secure", "--allow-unisolated-apps")
    code, output, started = started_cluster(monkeypatch, tmp_path, *flags, runs_up=cli.security_cmds)
    assert code == 0 and started, output
    assert os.environ["ZATTERA_AGENT_ALLOW_UNISOLATED"] == "1"  # the supervisor's children inherit it
    assert started[0].child_env()["ZATTERA_AGENT_ALLOW_UNISOLATED"] == "1"


def test_an_open_cluster_starts_on_such_a_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cannot_sandbox: None
) -> None:
    code, output, started = started_cluster(monkeypatch, tmp_path)
    assert code == 0 and started, output
