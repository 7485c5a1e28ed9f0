"""``zattera up --secure`` honours the same cluster options as the plain ``up``; each process gets a metrics port."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

import cli.machine_cmds
import cli.main
import cli.security_cmds
import cli.up_cmds
from cli.layout import DataLayout
from cli.main import app
from cli.supervised import Supervised
from cli.up_cluster import ALL_IN_ONE_SERVICES, SERVICES, Cluster
from shared.embedded import free_port


def started_clusters(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[Cluster]:
    """The clusters ``module``'s ``run_up`` is given (nothing is started)."""
    started: list[Cluster] = []

    def run_up(cluster: Cluster, *, hint: str = "") -> int:
        started.append(cluster)
        return 0

    monkeypatch.setattr(module, "run_up", run_up)
    return started


@pytest.mark.parametrize("flags", [["--secure"], ["--tls"]])
def test_secure_up_passes_proxy_port_and_no_node_to_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    started = started_clusters(monkeypatch, cli.security_cmds)
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), *flags, "--proxy-port", "18099", "--no-node"])
    assert result.exit_code == 0, result.output
    (cluster,) = started
    assert cluster.proxy_port == 18099
    assert cluster.with_node is False
    assert cluster.creds, "services run with the control credential"


def test_up_gives_each_process_its_own_metrics_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = started_clusters(monkeypatch, cli.up_cmds)
    base = free_port()
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--metrics-port", str(base)])
    assert result.exit_code == 0, result.output
    (cluster,) = started
    ports = {name: int(cluster.metrics_args(name)[1]) for name in ("scheduler", "orchestrator", "agent", "proxy")}
    assert len(set(ports.values())) == 4, ports
    assert cluster.metrics_args("scheduler") == ["--metrics-port", str(ports["scheduler"])]  # stable on restart
    assert Cluster(data_dir=tmp_path).metrics_args("scheduler") == []  # off unless asked (tests, embedders)


def test_up_runs_the_control_plane_in_one_process_unless_separate(tmp_path: Path) -> None:
    assert Cluster(data_dir=tmp_path).control_plane() == [("control-plane", "cli.control_plane")]
    separate = Cluster(data_dir=tmp_path, all_in_one=False).control_plane()
    assert [module for _, module in separate] == [f"services.{name}" for name in SERVICES]
    assert Cluster(data_dir=tmp_path, services=[]).control_plane() == []  # NATS only (chaos tests)


@pytest.mark.parametrize("flag", ["--all-in-one", "--separate"])
def test_up_flag_chooses_the_control_plane_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    started: list[Cluster] = []
    monkeypatch.setattr(cli.up_cmds, "run_up", lambda cluster, hint="": started.append(cluster) or 0)
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), flag])
    assert result.exit_code == 0, result.output
    assert started[0].all_in_one is (flag == "--all-in-one")


def test_the_supervisor_gets_the_cluster_it_was_asked_for(tmp_path: Path) -> None:
    """``run_up`` execs a lean supervisor and hands it the cluster as JSON: nothing asked for is lost."""
    join = Supervised("join", ["python", "-m", "services.join"], tmp_path / "logs" / "join.log", {"A": "1"})
    asked = Cluster(
        data_dir=tmp_path,
        port=4333,
        extra=[join],
        creds="/x/control.creds",
        node_creds={"agent": "/x/agent.creds"},
        all_in_one=False,
        metrics_port=9500,
        nats_extra_config="authorization {}",
    )
    given = Cluster.from_config(json.loads(json.dumps(asked.config())))
    assert given.config() == asked.config()
    assert given.extra == [join] and given.data_dir == tmp_path


def test_up_and_the_all_in_one_process_agree_on_the_services() -> None:
    from cli.control_plane import BUILDS

    assert set(BUILDS) == ALL_IN_ONE_SERVICES  # extra processes of these names are not started twice


def test_a_data_dir_holding_an_open_cluster_is_not_started_secure_and_the_refusal_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from shared.connection import connect
    from shared.embedded import EmbeddedNats
    from shared.provisioning import provision

    async def init(url: str) -> None:
        conn = await connect(url, name="t")
        try:
            await provision(conn.js)
        finally:
            await conn.close()

    server = EmbeddedNats(data_dir=DataLayout(tmp_path).control / "nats").start()  # as `zattera up` keeps it
    try:
        asyncio.run(init(server.url))
    finally:
        server.stop()
    started: list[Cluster] = []
    monkeypatch.setattr(cli.security_cmds, "run_up", lambda cluster, hint="": started.append(cluster) or 0)
    monkeypatch.setattr(cli.up_cmds, "run_up", lambda cluster, hint="": started.append(cluster) or 0)
    for flag in ("--secure", "--tls"):
        result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), flag, "--no-node"])
        assert result.exit_code == 1
        assert "holds an open cluster" in result.output and "zattera up --secure --data-dir DIR" in result.output
    assert started == [] and not DataLayout(tmp_path).security.exists()
    assert CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--no-node"]).exit_code == 0
    assert len(started) == 1


def test_a_data_dir_holding_a_secured_cluster_is_not_started_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Cluster] = []
    monkeypatch.setattr(cli.security_cmds, "run_up", lambda cluster, hint="": started.append(cluster) or 0)
    monkeypatch.setattr(cli.up_cmds, "run_up", lambda cluster, hint="": started.append(cluster) or 0)
    assert CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--secure", "--no-node"]).exit_code == 0
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), "--no-node"])
    assert result.exit_code == 1 and "start it with `zattera up --secure`" in result.output
    assert len(started) == 1


def test_the_banner_is_not_wrapped_when_not_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    creds = "/srv/" + "a-rather-long-data-directory/" * 4 + "security/creds/operator.creds"
    line = f"  CLI:       export ZATTERA_NATS_CREDS={creds} ZATTERA_NATS_TLS_CA=/srv/security/tls/ca.pem"
    Cluster(data_dir=tmp_path).console.print(line)
    assert line in capsys.readouterr().err.splitlines()  # one line, to copy and paste whole


def test_a_machine_of_a_cluster_of_machines_honours_the_proxy_and_metrics_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = started_clusters(monkeypatch, cli.machine_cmds)
    flags = ["--proxy-listen", "127.0.0.1:18098", "--proxy-tls-listen", "", "--metrics-port", "0", "--no-node"]
    machine = ["--secure", "--tls", "--name", "m1", "--advertise", "10.231.0.11"]
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), *machine, *flags])
    assert result.exit_code == 0, result.output
    (cluster,) = started
    assert (cluster.proxy_host, cluster.proxy_port, cluster.proxy_tls_listen) == ("127.0.0.1", 18098, "")
    assert cluster.metrics_args("agent") == []
    assert cluster.machine["seats"]["host"] == "10.231.0.11"


def test_a_worker_machine_provisions_nothing(tmp_path: Path) -> None:
    """A worker runs no control plane and holds no credential that may create or migrate streams: its ``up``
    leaves that to the servers (a provisioning attempt with its node credential would stop it)."""
    from cli.up_provision import provision_in_child

    worker = Cluster(data_dir=tmp_path, services=[], machine={"servers": [f"nats://127.0.0.1:{free_port()}"]})
    assert worker.control_plane() == []
    provision_in_child(worker)  # nothing to reach, nothing asked (an attempt would raise SystemExit)
