"""What the process runtime's fallback tells an operator: the cost (no container limits) and, when Docker is
installed here but its daemon is not running at the standard socket, how to get containers."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.agent.runtime_choice import PROCESS_FALLBACK, choose_launcher, daemon_hint
from services.agent.settings import AgentSettings


def _path_with_dockerd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, installed: bool) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if installed:
        dockerd = bin_dir / "dockerd"
        dockerd.write_text("#!/bin/sh\nexit 1\n")
        dockerd.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


@pytest.mark.parametrize(
    ("installed", "host", "hinted"),
    [
        (True, "", True),  # the standard socket, dockerd installed: say how to start it
        (False, "", False),  # not installed: nothing to start
        (True, "unix:///elsewhere/docker.sock", False),  # a configured address: the operator chose it
        (True, "tcp://127.0.0.1:2375", False),
    ],
)
def test_the_hint_names_the_daemon_to_start_only_when_docker_is_installed_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool, host: str, hinted: bool
) -> None:
    _path_with_dockerd(tmp_path, monkeypatch, installed=installed)
    hint = daemon_hint(host)
    assert ("systemctl start docker" in hint) is hinted
    assert hint == "" or hint.startswith(" (Docker is installed but its daemon is not running")


async def test_the_fallback_says_what_it_costs_and_not_that_apps_are_unisolated(tmp_path: Path) -> None:
    missing = f"unix://{tmp_path}/no.sock"
    choice = await choose_launcher(AgentSettings(node_id="x", runtime="", docker_host=missing))
    await choice.launcher.close()
    assert choice.launcher.name == "process"
    assert choice.reason == f"no Docker daemon answers at {missing}: {PROCESS_FALLBACK}"
    assert "isolation" not in choice.reason  # how apps are isolated is the sandbox's line, not the runtime's
