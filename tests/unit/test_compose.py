"""compose.yaml's commands resolve to real entry points and Prometheus scrapes every process (without a Docker
engine; tests/e2e/test_compose_stack.py runs the stack for real)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml

from cli.control_plane import BUILDS

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_nats_with_jetstream():
    nats = compose()["services"]["nats"]
    config = nats["command"][nats["command"].index("-c") + 1]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    text = (ROOT / mounted[config]).read_text()
    assert "jetstream" in text and "max_payload: 8MB" in text


def test_every_service_runs_in_a_container():
    services = compose()["services"]
    folders = {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}
    modules = {svc["command"][2] for name, svc in services.items() if name not in NOT_ZATTERA}
    # the all-in-one control plane runs the loops of every service it composes; the agent and proxy run alone
    running = {m.removeprefix("services.") for m in modules}
    if "cli.control_plane" in modules:
        running |= set(BUILDS)
    assert folders <= running, f"no container runs {folders - running}"


NOT_ZATTERA = ("nats", "prometheus")


def test_every_container_command_resolves_to_an_entry_point():
    for name, svc in compose()["services"].items():
        if name in NOT_ZATTERA:
            continue
        command = svc["command"]
        assert command[:2] == ["python", "-m"], name
        module = command[2]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, timeout=60)
        assert result.returncode == 0, f"{name}: {result.stderr.decode()}"
        assert "--nats" in result.stdout.decode()
        assert "--metrics-port" in result.stdout.decode(), f"{name}: no metrics port"


def scraped_targets() -> dict[str, set[str]]:
    """deploy/prometheus.yml: each job's targets as host:port (static or DNS discovered names)."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs: dict[str, set[str]] = {}
    for job in config["scrape_configs"]:
        targets = jobs.setdefault(job["job_name"], set())
        for static in job.get("static_configs", []):
            targets.update(static["targets"])
        for dns in job.get("dns_sd_configs", []):
            targets.update(f"{name}:{dns['port']}" for name in dns["names"])
    return jobs


def test_prometheus_scrapes_every_process_on_its_metrics_port():
    services = compose()["services"]
    prometheus = services["prometheus"]
    assert any(v.startswith("./deploy/prometheus.yml:") for v in prometheus["volumes"])
    targets = set().union(*scraped_targets().values())
    for name, svc in services.items():
        if name in NOT_ZATTERA:
            continue
        port = svc["environment"]["ZATTERA_METRICS_PORT"]
        assert svc["environment"]["ZATTERA_METRICS_HOST"] == "0.0.0.0", f"{name}: metrics unreachable from prometheus"
        assert f"{name}:{port}" in targets, f"{name}: its metrics ({name}:{port}) are not scraped"
