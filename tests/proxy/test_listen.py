"""The proxy's listen address is a setting: ``--listen`` / ``ZATTERA_PROXY_LISTEN`` (HOST:PORT), default
every interface on 8080; ``zattera up --proxy-listen`` passes it on and prints it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from typer.testing import CliRunner

import cli.main
import cli.up_cmds
from cli.up import proxy_listen_text
from cli.up_cluster import Cluster
from services.proxy.settings import ProxySettings, split_listen
from shared.embedded import free_port
from tests.proxy.harness import proxy_module
from tests.waiting import eventually


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8081", ("127.0.0.1", 8081)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        (":9000", ("0.0.0.0", 9000)),
        ("[::1]:8080", ("::1", 8080)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_split_listen(text: str, expected: tuple[str, int]) -> None:
    assert split_listen(text) == expected


@pytest.mark.parametrize("text", ["8080", "host:", "host:port", "127.0.0.1:70000"])
def test_a_bad_listen_address_says_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        split_listen(text)


def test_default_is_every_interface_and_the_environment_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (ProxySettings().host, ProxySettings().port) == ("0.0.0.0", 8080)
    monkeypatch.setenv("ZATTERA_PROXY_LISTEN", "127.0.0.2:8181")
    assert (ProxySettings().host, ProxySettings().port) == ("127.0.0.2", 8181)


async def test_process_listens_where_told_and_refuses_a_bad_address(nats_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "proxy.log"
    with log.open("wb") as sink:
        flags = ("--nats", nats_url, "--listen", f"127.0.0.1:{port}", "--cache-dir", str(tmp_path / "cache"))
        process = await proxy_module("--engine", "python", *flags, output=sink)
        try:
            await eventually(lambda: f"listening on 127.0.0.1:{port}" in log.read_text(), 15, "the listen log line")
            async with aiohttp.ClientSession() as client, client.get(f"http://127.0.0.1:{port}/") as response:
                assert response.status == 404  # served: no route for that host
        finally:
            process.terminate()  # right after start, NATS maybe still connecting: it must still stop
            try:
                code = await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()
                raise
        assert code == 0, log.read_text()

    bad = await proxy_module("--listen", "everywhere", output=asyncio.subprocess.PIPE)
    _, stderr = await bad.communicate()
    assert bad.returncode == 2
    assert "listen: 'everywhere' is not HOST:PORT" in stderr.decode()
    assert "Traceback" not in stderr.decode()


def test_up_passes_the_proxy_listen_address_and_prints_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Cluster] = []

    def run_up(cluster: Cluster, *, hint: str = "") -> int:
        started.append(cluster)
        return 0

    monkeypatch.setattr(cli.up_cmds, "run_up", run_up)
    runner = CliRunner()
    result = runner.invoke(cli.main.app, ["up", "--data-dir", str(tmp_path), "--proxy-listen", "127.0.0.1:18099"])
    assert result.exit_code == 0, result.output
    assert (started[0].proxy_host, started[0].proxy_port) == ("127.0.0.1", 18099)
    default = runner.invoke(cli.main.app, ["up", "--data-dir", str(tmp_path), "--proxy-port", "18098"])
    assert default.exit_code == 0, default.output
    assert (started[1].proxy_host, started[1].proxy_port) == ("0.0.0.0", 18098)
    bad = runner.invoke(cli.main.app, ["up", "--data-dir", str(tmp_path), "--proxy-listen", "nowhere"])
    assert bad.exit_code == 2 and "--proxy-listen" in bad.output
    assert proxy_listen_text("0.0.0.0", 8080).startswith("0.0.0.0:8080 (every interface;")
    assert proxy_listen_text("127.0.0.1", 8080) == "127.0.0.1:8080"
