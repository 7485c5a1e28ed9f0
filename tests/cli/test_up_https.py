"""``zattera up`` gives the proxy an HTTPS listener by default, and says when the engine cannot serve it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

import cli.security_cmds
import cli.up
import cli.up_cmds
from cli.main import app
from cli.up import https_text
from cli.up_cluster import Cluster


def started_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *flags: str, runs_up: ModuleType = cli.up_cmds
) -> tuple[int, str, list[Cluster]]:
    """``zattera up FLAGS`` with ``runs_up.run_up`` replaced: the exit code, the output, the cluster it got."""
    started: list[Cluster] = []

    def run_up(cluster: Cluster, *, hint: str = "") -> int:
        started.append(cluster)
        return 0

    monkeypatch.setattr(runs_up, "run_up", run_up)
    result = CliRunner().invoke(app, ["up", "--data-dir", str(tmp_path), *flags])
    return result.exit_code, result.output, started


@pytest.mark.parametrize(
    ("flags", "listen"),
    [
        ((), "0.0.0.0:8443"),
        (("--proxy-tls-listen", "127.0.0.1:9443"), "127.0.0.1:9443"),
        (("--proxy-tls-listen", ""), ""),
        (("--proxy-listen", "127.0.0.1:8080"), "127.0.0.1:8443"),  # kept on this machine, as HTTP is
        (("--proxy-listen", "127.0.0.1:8080", "--proxy-tls-listen", "0.0.0.0:9443"), "0.0.0.0:9443"),
    ],
)
def test_up_passes_the_tls_listener(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], listen: str
) -> None:
    monkeypatch.delenv("ZATTERA_PROXY_TLS_LISTEN", raising=False)
    code, output, started = started_cluster(monkeypatch, tmp_path, *flags)
    assert code == 0, output
    assert started[0].proxy_tls_listen == listen
    assert Cluster(data_dir=tmp_path).proxy_tls_listen == ""  # off unless asked (tests, embedders)


def test_secure_up_passes_the_tls_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ("--secure", "--no-node", "--proxy-tls-listen", "127.0.0.1:9443")
    code, output, started = started_cluster(monkeypatch, tmp_path, *flags, runs_up=cli.security_cmds)
    assert code == 0, output
    assert started[0].proxy_tls_listen == "127.0.0.1:9443"


def test_a_bad_tls_listener_is_refused_naming_the_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, output, started = started_cluster(monkeypatch, tmp_path, "--proxy-tls-listen", "nowhere")
    assert code == 2 and "--proxy-tls-listen" in output and not started


def test_https_line_names_the_engine_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "certs" / "local-ca.pem"
    monkeypatch.setenv("ZATTERA_PROXY_ENGINE", "python")
    assert "TLS needs the haproxy engine" in https_text("0.0.0.0:8443", ca)
    assert https_text("", ca).startswith("off")
    monkeypatch.setattr(cli.up, "choose_engine", lambda asked: "haproxy")
    assert https_text("0.0.0.0:8443", ca) == f"https://<app>-<env>.localhost:8443  (curl --cacert {ca} …)"
