"""Upgrading a cluster the previous release made, as an operator does: ``zattera up`` of the previous
release (tests/upgrade/previous.py) deploys a stateful app with a secret, a domain and a volume, takes a
snapshot and is stopped; ``zattera up`` of this tree on the same data dir upgrades the cluster (the
migrations it prints) and then, with this version's CLI: the old release serves with its secret and data,
its logs read back, a new release builds and deploys, a rollback runs the release the old builder made, and
the old snapshot restores. Then ``zattera up`` run again while it runs (``git pull && make up``) rolls every
process onto the code installed, the app's instance untouched. Nothing is left running.

Default timers, as shipped. ~2-3 minutes (two clusters started, three deploys, a restore).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.migrations.registry import SCHEMA
from shared.version import VERSION
from tests.e2e.cluster import ROOT, kill_tree_under, leftovers
from tests.e2e.upcmd import Release, Up, listen_port
from tests.upgrade.previous import extract
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENV = "upg/keeper/prod"
HOST = "keeper.localhost"
SECRET = "upgrade-s3cret-value"

APP = """
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

VERSION = os.environ.get("KEEPER_VERSION", "{version}")
DATA = os.path.join(os.environ["ZATTERA_VOLUME_DATA"], "value.txt")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/healthz":
            return self.answer(b"ok")
        if self.path.startswith("/write"):
            value = parse_qs(urlparse(self.path).query)["v"][0]
            with open(DATA, "w") as f:
                f.write(value)
            print(f"keeper {{VERSION}} wrote {{value}}", flush=True)
        stored = open(DATA).read() if os.path.exists(DATA) else ""
        token = os.environ.get("API_TOKEN", "")
        body = {{"version": VERSION, "data": stored, "secret": token == "{secret}"}}
        self.answer(json.dumps(body).encode())

    def answer(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        return


server = ThreadingHTTPServer((os.environ.get("ZATTERA_BIND_ADDR", "127.0.0.1"), int(os.environ["PORT"])), Handler)
print(f"keeper {{VERSION}} started", flush=True)
server.serve_forever()
"""

TOML = f'''
project = "upg"
app = "keeper"

[run]
command = "python3 app.py"

[env.prod]
stateful = true
replicas = 1
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{HOST}"]
[[env.prod.volumes]]
volume_name = "data"
mount_path = "/data"
'''


def app_source(dest: Path, version: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "app.py").write_text(APP.format(version=version, secret=SECRET))
    (dest / "zattera.toml").write_text(TOML)
    return dest


async def ask(port: int, path: str = "/") -> dict[str, object] | None:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{port}{path}", headers={"Host": HOST}) as response,
        ):
            if response.status != 200:
                return None
            answer: dict[str, object] = json.loads(await response.text())
            return answer
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


async def serves(port: int, **expected: object) -> None:
    """Wait until the app answers with ``expected`` (its version, data, secret)."""

    async def matches() -> bool:
        answer = await ask(port)
        return answer is not None and all(answer.get(k) == v for k, v in expected.items())

    await eventually(matches, 120, f"{HOST} answers {expected}")


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_tree_under(tmp_path, also_matching=str(tmp_path / "data"))


def up(work: Path, release: Release, nats_port: int, proxy_port: int) -> Up:
    return Up(
        work / "data",
        nats_port,
        proxy_port,
        release=release,
        options=("--proxy-listen", f"127.0.0.1:{proxy_port}", "--metrics-port", "0"),
    )


def release_ids(running: Up) -> dict[str, str]:
    """version (v1, v2…) → release id."""
    listed = json.loads(running.cli("releases", "--env", ENV, "--json").stdout)
    return {f"v{r['version']}": r["meta"]["id"] for r in listed}


async def test_a_cluster_made_by_the_previous_release_upgrades_and_keeps_everything(work: Path) -> None:
    previous = extract(work / "previous")
    nats_port, proxy_port = listen_port(), listen_port()
    source = app_source(work / "app", "v1")

    old = up(work, previous, nats_port, proxy_port)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in old.text(), 120, "the previous release is up")
        old.cli("apps", "apply", str(source / "zattera.toml"))
        old.cli("secrets", "set", "API_TOKEN", "--env", ENV, "--no-deploy", stdin=SECRET)
        deployed = old.cli("deploy", str(source), "--env", ENV, timeout=300)
        assert "live: release" in deployed.stderr, deployed.stderr
        await serves(proxy_port, version="v1", secret=True)
        assert await ask(proxy_port, "/write?v=in-the-snapshot")
        volumes = json.loads(old.cli("volumes", "list", "--json").stdout)
        volume = volumes[0]["meta"]["id"]
        old.cli("volumes", "snapshot", volume, timeout=120)
        snapshots = json.loads(old.cli("volumes", "snapshots", volume, "--json").stdout)
        assert len(snapshots) == 1 and snapshots[0]["status"] == "SNAPSHOT_STATUS_COMPLETE", snapshots
        snapshot = snapshots[0]["meta"]["id"]
        assert await ask(proxy_port, "/write?v=after-the-snapshot")
        url = old.url
        assert old.ctrl_c() == 0, old.text()
        assert leftovers(work / "data", also_matching=url) == []
    except BaseException:
        print(old.text())
        raise
    finally:
        old.kill()

    new = up(work, Release(), nats_port, proxy_port)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in new.text(), 120, "this release is up on the old data")
        assert f"cluster at schema {SCHEMA} (Zattera {VERSION})" in new.text(), new.text()
        status = json.loads(new.cli("cluster", "status", "--json").stdout)
        assert (status["config"]["schema"], status["config"]["version"]) == (SCHEMA, VERSION)
        assert len(status["config"]["migrations"]) == SCHEMA
        assert status["mismatches"] == []

        # The release the old builder made runs again, with its secret and the volume's data.
        await serves(proxy_port, version="v1", secret=True, data="after-the-snapshot")
        nodes = json.loads(new.cli("nodes", "list", "--json").stdout)
        assert [n["binary_version"] for n in nodes] == [VERSION]
        logs = new.cli("logs", "--env", ENV, "-n", "200").stdout
        assert "keeper v1 wrote in-the-snapshot" in logs, logs  # shipped by the previous release's agent

        # A new build and deploy, then back to the release built before the upgrade.
        app_source(work / "app", "v2")
        deployed = new.cli("deploy", str(source), "--env", ENV, timeout=300)
        assert "live: release" in deployed.stderr, deployed.stderr
        await serves(proxy_port, version="v2", secret=True, data="after-the-snapshot")
        new.cli("rollback", "--env", ENV, "--to", release_ids(new)["v1"], timeout=300)
        await serves(proxy_port, version="v1", secret=True)

        # The snapshot the previous release took restores (the volume unmounted meanwhile).
        new.cli("scale", "--env", ENV, "0")
        await eventually(lambda: json.loads(new.cli("ps", "--env", ENV, "--json").stdout) == [], 120, "stopped")

        def restored() -> bool:  # refused until the volume's mount lease has lapsed
            return new.cli("volumes", "restore", volume, snapshot, timeout=120, check=False).returncode == 0

        await eventually(restored, 120, "the snapshot restores")
        new.cli("scale", "--env", ENV, "1")
        await serves(proxy_port, version="v1", data="in-the-snapshot", secret=True)
        assert SECRET not in new.text() + logs

        # `git pull && make up` while it runs: the running processes roll onto the code, the app stays.
        await rolls_in_place(new, work / "data")

        url = new.url
        assert new.ctrl_c() == 0, new.text()
        assert leftovers(work / "data", also_matching=url) == []
    except BaseException:
        print(new.text())
        for log in sorted((work / "data" / "logs").glob("*.log")):
            print(f"==> {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        raise
    finally:
        new.kill()


def instances(running: Up) -> set[str]:
    """The env's running instances (``proc-<pid>-<start>``: one run of a replica)."""
    return {a["observed"].get("container_id", "") for a in json.loads(running.cli("ps", "--env", ENV, "--json").stdout)}


def up_again(running: Up) -> subprocess.CompletedProcess[str]:
    """``zattera up`` run a second time on the running cluster's data dir (as ``make up`` does)."""
    return subprocess.run(
        [*running.release.argv, "up", "--data-dir", str(running.data_dir)],
        cwd=running.release.cwd,
        env={k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


async def rolls_in_place(running: Up, data_dir: Path) -> None:
    """Nothing restarts when the code is unchanged; after a change (a file's time moved, as a pull does),
    every process is restarted on it, one at a time, and the app's instances are the same ones."""
    before = instances(running)
    assert len(before) == 1 and "" not in before, before
    unchanged = up_again(running)
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
    assert "already running the code installed now: nothing restarted" in unchanged.stdout
    touched = ROOT / "cli" / "__init__.py"
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        rolled = up_again(running)
    finally:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    lines = rolled.stdout.splitlines()
    for name in ("control-plane", "agent", "proxy"):
        assert any(f"{name} runs the new code" in line for line in lines), rolled.stdout
    assert lines[-1].strip().startswith("done: every process runs the code installed now"), rolled.stdout
    assert "upgrade: done:" in running.text()  # the supervisor's own terminal says so too
    assert (data_dir / "up.pid").read_text().strip() == str(running.proc.pid)
    await eventually(lambda: instances(running) == before, 60, "the same instances, adopted by the new agent")
