"""compose.yaml's two shapes (all-in-one, one container per service), its commands resolving to real entry
points, every container restarted, limited and health-checked, and Prometheus scraping every process
(without a Docker engine; tests/e2e/test_compose_stack.py runs both shapes for real)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cli.control_plane import BUILDS
from tests.leases import LOOPS_OF

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_runs_nats_with_jetstream():
    nats = compose()["services"]["nats"]
    config = nats["command"][nats["command"].index("-c") + 1]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    text = (ROOT / mounted[config]).read_text()
    assert "jetstream" in text and "max_payload: 8MB" in text


NOT_ZATTERA = ("nats", "prometheus")
SHAPES = ("all-in-one", "per-service")


def shape(name: str) -> dict[str, dict]:
    """The services ``docker-compose --profile <name> up`` starts."""
    return {n: svc for n, svc in compose()["services"].items() if name in svc.get("profiles", [name])}


@pytest.mark.parametrize("name", SHAPES)
def test_every_service_runs_in_a_container_in_both_shapes(name: str) -> None:
    services = shape(name)
    folders = {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}
    modules = {svc["command"][2] for n, svc in services.items() if n not in NOT_ZATTERA}
    # the all-in-one control plane runs the loops of every service it composes; the agent and proxy run alone
    running = {m.removeprefix("services.") for m in modules}
    if "cli.control_plane" in modules:
        running |= set(BUILDS)
    assert folders <= running, f"{name}: no container runs {folders - running}"
    assert ("control-plane" in services) == (name == "all-in-one")


def test_per_service_runs_each_service_alone_and_two_replicas_of_each_leader_loop_service() -> None:
    services = shape("per-service")
    for service in BUILDS:
        svc = services[service]
        assert svc["command"] == ["python", "-m", f"services.{service}"], service
        # join has no loop, but agents' views and the CLI's watches depend on it (a queue group)
        assert svc["deploy"]["replicas"] == (2 if LOOPS_OF[service] or service == "join" else 1), service
    # the console publishes its port: one replica
    assert {s for s in BUILDS if services[s]["deploy"]["replicas"] == 1} == {"console"}


def test_both_shapes_share_the_image_the_configuration_and_the_volumes_of_keys() -> None:
    services = compose()["services"]
    allinone = services["control-plane"]
    for service in BUILDS:
        svc = services[service]
        assert svc["image"] == allinone["image"] and svc["build"] == allinone["build"], service
        assert svc["environment"] == allinone["environment"], service
    assert set(allinone["volumes"]) == {"secrets-data:/data/secrets", "certs-data:/data/certs"}
    assert services["secrets"]["volumes"] == ["secrets-data:/data/secrets"]
    assert services["certs"]["volumes"] == ["certs-data:/data/certs"]


def test_every_container_is_restarted_limited_and_health_checked() -> None:
    for name, svc in compose()["services"].items():
        assert svc["restart"] == "unless-stopped", name
        limits = svc["deploy"]["resources"]["limits"]
        assert limits["memory"] and float(limits["cpus"]) > 0, name
        check = svc["healthcheck"]
        assert check["test"][0] == "CMD" and check["retries"] >= 1, name
        if name not in NOT_ZATTERA:
            health_file = svc["environment"]["ZATTERA_HEALTH_FILE"]
            assert check["test"][1:] == ["/bin/sh", "/app/shared/health.sh", health_file], name


def test_the_default_shape_is_the_all_in_one() -> None:
    """``docker-compose up`` without --profile: .env beside compose.yaml names the profile."""
    lines = (ROOT / ".env").read_text().splitlines()
    assert "COMPOSE_PROFILES=all-in-one" in lines


def test_every_container_command_resolves_to_an_entry_point():
    modules: dict[str, str] = {}
    for name, svc in compose()["services"].items():
        if name in NOT_ZATTERA:
            continue
        command = svc["command"]
        assert command[:2] == ["python", "-m"], name
        assert importlib.util.find_spec(command[2]) is not None, f"{name}: no module {command[2]}"
        modules.setdefault(command[2], name)
    # at once: each interpreter imports a whole service
    helps = {
        module: subprocess.Popen(
            [sys.executable, "-m", module, "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for module in modules
    }
    for module, proc in helps.items():
        out, err = proc.communicate(timeout=100)
        name = modules[module]
        assert proc.returncode == 0, f"{name}: {err.decode()}"
        assert "--nats" in out.decode()
        assert "--metrics-port" in out.decode(), f"{name}: no metrics port"


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
