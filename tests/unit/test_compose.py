"""No Docker engine runs here: check that compose.yaml's commands resolve to real entry points."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_nats_with_jetstream():
    nats = compose()["services"]["nats"]
    assert "-js" in nats["command"]


def test_every_service_folder_has_a_container():
    services = compose()["services"]
    folders = {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}
    assert folders <= set(services), "a service has no container in compose.yaml"


def test_every_container_command_resolves_to_an_entry_point():
    for name, svc in compose()["services"].items():
        if name == "nats":
            continue
        command = svc["command"]
        assert command[:2] == ["python", "-m"], name
        module = command[2]
        assert importlib.util.find_spec(module + ".__main__") is not None, f"{name}: {module} has no __main__"
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, timeout=60)
        assert result.returncode == 0, f"{name}: {result.stderr.decode()}"
        assert "--nats" in result.stdout.decode()
