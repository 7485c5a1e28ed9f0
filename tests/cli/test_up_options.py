"""``zattera up --secure`` honours the same cluster options as the plain ``up``; each process gets a metrics port."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli.main
import cli.security_cmds
from cli.main import app
from cli.up import Cluster
from shared.embedded import free_port


@pytest.mark.parametrize("flags", [["--secure"], ["--tls"]])
def test_secure_up_passes_proxy_port_and_no_node_to_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    started: list[Cluster] = []

    def run_up(cluster: Cluster, *, hint: str = "") -> int:
        started.append(cluster)
        return 0

    monkeypatch.setattr(cli.security_cmds, "run_up", run_up)
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), *flags, "--proxy-port", "18099", "--no-node"])
    assert result.exit_code == 0, result.output
    (cluster,) = started
    assert cluster.proxy_port == 18099
    assert cluster.with_node is False
    assert cluster.creds, "services run with the control credential"


def test_up_gives_each_process_its_own_metrics_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Cluster] = []

    def run_up(cluster: Cluster, *, hint: str = "") -> int:
        started.append(cluster)
        return 0

    monkeypatch.setattr(cli.main, "run_up", run_up)
    base = free_port()
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--metrics-port", str(base)])
    assert result.exit_code == 0, result.output
    (cluster,) = started
    ports = {name: int(cluster.metrics_args(name)[1]) for name in ("scheduler", "orchestrator", "agent", "proxy")}
    assert len(set(ports.values())) == 4, ports
    assert cluster.metrics_args("scheduler") == ["--metrics-port", str(ports["scheduler"])]  # stable on restart
    assert Cluster(data_dir=tmp_path).metrics_args("scheduler") == []  # off unless asked (tests, embedders)
