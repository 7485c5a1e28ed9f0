"""A log drain on a real ``zattera up``: the operator adds an HTTP NDJSON drain with ``--events`` for the
example's environment, deploys it, and the receiver (on loopback, started here) gets the app's own first line
and the deploy's events, shipped by the secrets service's ``drains`` loop under its lease; ``drains list`` and
``status`` say how it goes and never show the token."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE
from tests.e2e.upcmd import Up
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ENV = "demo/hello/production"
TOKEN = "e2e-drain-token-never-shown-5b1e"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "zattera-data"
    yield directory
    from tests.e2e.cluster import kill_tree_under

    kill_tree_under(directory, also_matching=str(directory))


async def test_a_drain_ships_the_apps_lines_and_its_events_from_zattera_up(data_dir: Path) -> None:
    got: list[dict[str, object]] = []

    async def ingest(request: web.Request) -> web.Response:
        if request.query.get("token") != TOKEN:
            return web.Response(status=401)
        got.extend(json.loads(line) for line in (await request.text()).splitlines())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/ingest", ingest)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    up = Up(data_dir, free_port(), free_port())
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 90, "zattera up is up")
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        url = f"http://127.0.0.1:{port}/ingest?token={TOKEN}"
        tries: list[subprocess.CompletedProcess[str]] = []

        def add() -> bool:  # refused (Unavailable) until the secrets service has published the cluster key
            tries.append(up.cli("drains", "add", "web", "--env", ENV, "--events", "--url", url, check=False))
            return tries[-1].returncode == 0

        await eventually(add, 60, "the drain added")
        added = tries[-1]
        assert f"drain web added: logs and platform events of env {ENV} to http://127.0.0.1:{port}/…" in added.stderr
        up.cli("deploy", str(EXAMPLE), "--env", ENV)

        def hello_line() -> bool:
            return any(d["type"] == "log" and "hello v1 listening on" in str(d["line"]) for d in got)

        await eventually(hello_line, 60, "the app's first line at the receiver")
        await eventually(lambda: any(d["type"] == "event" and d["kind"] == "deploy.succeeded" for d in got), 60)
        line = next(d for d in got if d["type"] == "log")
        assert line["env"] == ENV and line["stream"] == "stdout" and line["instance"], line

        async def listed_ok() -> bool:
            [drain] = json.loads(up.cli("drains", "list", "--json").stdout)
            return bool(drain["delivered_lines"]) and not drain["failing"] and drain["dropped_messages"] == 0

        await eventually(listed_ok, 30, "drains list shows the deliveries")
        status = up.cli("status")
        assert "drains: web (env demo/hello/production → http://127.0.0.1:" in status.stdout, status.stdout
        for result in (*tries, status, up.cli("drains", "list")):
            assert TOKEN not in result.stdout + result.stderr
        assert TOKEN not in "\n".join(p.read_text(errors="replace") for p in (data_dir / "logs").glob("*.log"))
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        raise
    finally:
        up.kill()
        await runner.cleanup()
