"""A hostile app gets nothing of the platform: the real ``zattera up`` (open, then ``--secure``) on the process
runtime, a victim app with a secret (``examples/hello``) and the spy (``tests/apps/spy``) deployed from
source as a user does. The spy runs once as a build step and once as the app; each time it tries every file
under the data directory (the control plane's keys and credentials, the node's own credential), every
other process's environment, NATS and the console without a credential (the apps' firewall refuses even
the connection, open or secured) and the Docker sockets, and reports what it got.

Then the data directory is walked as the spy's user, outside any sandbox: not one file may be readable
even by a path (the directory is the agent's and the control plane's alone).

Two clusters, one per mode (~1-2 min each on a busy machine).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.agent.firewall import chain_name
from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, ROOT, kill_tree_under
from tests.e2e.test_up import logs_of
from tests.e2e.upcmd import Up
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

SPY_APP = ROOT / "tests" / "apps" / "spy"
SPY_ENV = "spies/spy/production"
VICTIM_ENV = "demo/hello/production"
DOCKER_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")


def talk_nats(address: str) -> str:
    """The spy's own NATS attempt, made outside any sandbox."""
    spec = importlib.util.spec_from_file_location("spy", SPY_APP / "spy.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.talk_nats(address))


@dataclass
class Spied:
    secure: bool
    up: Up
    data: Path
    nats: int
    proxy: int
    secret: str
    report: dict[str, Any]
    """What the running spy got."""
    build: dict[str, Any]
    """What the spy got as a build step."""


async def fetch(port: int, path: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers={"Host": "spy.localhost"}) as response,
    ):
        assert response.status == 200, await response.text()
        return dict(json.loads(await response.text()))


@pytest.fixture(scope="module", params=["open", "secure"])
def spied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spied]:
    secure = request.param == "secure"
    root = tmp_path_factory.mktemp(f"isolation-{request.param}")
    data, nats, proxy = root / "data", free_port(), free_port()
    args = ["--proxy-listen", f"127.0.0.1:{proxy}", "--proxy-tls-listen", "", "--metrics-port", "0"]
    env = {"ZATTERA_AGENT_RUNTIME": "process", "ZATTERA_CONSOLE_PORT": str(free_port())}
    up = Up(data, nats, proxy, options=(*args, *(["--secure"] if secure else [])), env=env)
    try:
        asyncio.run(eventually(lambda: "Press Ctrl-C to stop." in up.text(), 90, "zattera up is up"))
        asyncio.run(eventually(lambda: serving(up), 90, "the local node registered, the relay answering"))
        secret = f"victim-secret-{secrets.token_hex(8)}"
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        up.cli("secrets", "set", "--env", VICTIM_ENV, "HELLO_TOKEN", "--no-deploy", stdin=secret)
        up.cli("deploy", str(EXAMPLE), "--env", VICTIM_ENV, timeout=240)

        spy = root / "spy"
        shutil.copytree(SPY_APP, spy)
        targets = [str(data), str(data / "agent" / "node.creds")]
        # NATS, the console and the proxy: the spy speaks NATS to each (only the proxy may answer at all).
        tcp = [f"127.0.0.1:{nats}", f"127.0.0.1:{env['ZATTERA_CONSOLE_PORT']}", f"127.0.0.1:{proxy}"]
        (spy / "spy.env").write_text(
            f"SPY_PATHS={':'.join(targets)}\nSPY_NATS={','.join(tcp)}\nSPY_SOCKETS={','.join(DOCKER_SOCKETS)}\n"
        )
        up.cli("apps", "apply", str(spy / "zattera.toml"))
        up.cli("deploy", str(spy), "--env", SPY_ENV, timeout=240)
        report = asyncio.run(fetch(proxy, "/"))
        build = asyncio.run(fetch(proxy, "/build"))
        yield Spied(secure, up, data, nats, proxy, secret, report, build)
        assert up.ctrl_c() == 0, up.text()
        chain = chain_name(str((data / "agent").resolve()))
        saved = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True)
        assert chain not in saved.stdout  # the agent removed its firewall chain when it stopped
    except BaseException:
        print(up.text())
        print(logs_of(data))
        raise
    finally:
        up.kill()
        kill_tree_under(data, also_matching=str(data))


def serving(up: Up) -> bool:
    """The local node is registered and a write goes through (on a secured cluster the join service relays
    the operator's writes: it may start after ``zattera up`` printed its summary)."""
    try:
        nodes = json.loads(up.cli("nodes", "list", "--json").stdout)
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
    except AssertionError:
        return False
    return bool(nodes)


def reports(spied: Spied) -> list[tuple[str, dict[str, Any]]]:
    return [("app", spied.report), ("build step", spied.build)]


def test_zattera_up_says_apps_are_sandboxed_and_nodes_list_shows_it(spied: Spied) -> None:
    assert "apps: sandboxed (bubblewrap namespaces" in spied.up.text()  # the agent's runtime note
    nodes = json.loads(spied.up.cli("nodes", "list", "--json").stdout)
    assert [(n.get("isolation"), n.get("isolationProblem", "")) for n in nodes] == [("sandbox", "")]


def test_the_spy_runs_as_its_own_unprivileged_user_without_any_capability(spied: Spied) -> None:
    uids = set()
    for what, report in reports(spied):
        me = report["identity"]
        assert me["uid"] >= 0x70000000 and me["gid"] == me["uid"] and me["groups"] == [], what
        status = me["status"]
        for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert status[caps] == "0000000000000000", (what, caps, status)
        assert status["NoNewPrivs"] == "1", what
        uids.add(me["uid"])
    assert len(uids) == 2  # the app's builds have a user of their own


FORBIDDEN = {"control", "logs", "proxy", "node.creds", "sandbox", "forwarder", "security", "secrets", "certs", "nats"}
"""Names in the data directory no sandbox may show: the control plane's, the node's, other processes'."""
BOOKKEEPING = {"state.json", "stdout.log", "stderr.log", "logs.cursor", "image.json"}
"""The agent's files beside an instance's root filesystem."""


def test_the_spy_reads_nothing_under_the_data_dir_but_its_own_files(spied: Spied) -> None:
    data = str(spied.data)
    own = {"app": ("/rootfs/",), "build step": ("/src/", "/home/", "/downloads/")}
    for what, report in reports(spied):
        files = report["files"]
        for path in files["read"]:
            if path.startswith(data + "/"):
                assert any(part in path for part in own[what]), (what, path)
        assert f"{data}/agent/node.creds" not in files["read"], what
        # What it can list of the data dir is the sandbox's skeleton down to its own directory.
        for directory, entries in files["listed"].items():
            if not directory.startswith(data) or any(part in directory + "/" for part in own[what]):
                continue
            assert not (set(entries) & (FORBIDDEN | BOOKKEEPING)), (what, directory, entries)
            if directory.endswith(("/instances", "/builds")):
                assert len(entries) == 1, (what, directory, entries)  # its own, no other instance or build


def test_no_secret_or_key_of_the_cluster_is_in_anything_the_spy_got(spied: Spied) -> None:
    for what, report in reports(spied):
        text = json.dumps(report)
        assert spied.secret not in text, what
        for marker in ("NKEY SEED", "BEGIN NATS USER JWT", "PRIVATE KEY", "-----BEGIN EC"):
            assert marker not in text, (what, marker)


def test_no_other_process_is_visible_and_no_other_environment_readable(spied: Spied) -> None:
    for what, report in reports(spied):
        proc = report["proc"]
        assert len(proc["pids"]) <= 6, (what, proc["pids"])  # its own pid namespace: bwrap's pid 1 and itself
        for pid, environ in proc["environ"].items():  # only its own processes (the shell that started it)
            assert "ZATTERA_NATS_CREDS" not in environ and spied.secret not in environ, (what, pid)
            assert ("ZATTERA_BUILD_ID=" in environ) if what == "build step" else ("spies" not in environ), what


def test_no_docker_socket_is_reachable(spied: Spied) -> None:
    for what, report in reports(spied):
        for socket_path in DOCKER_SOCKETS:
            assert report["docker"][socket_path].startswith("unreachable: [Errno 2]"), (what, report["docker"])


def test_nats_and_the_console_refuse_the_spy_even_on_an_open_cluster_but_the_proxy_answers(spied: Spied) -> None:
    """The apps' firewall (services/agent/firewall.py): on an open cluster NATS has no credentials at all, so
    the spy must not even connect; the console neither. Other apps stay reachable through the proxy."""
    console = spied.up.env["ZATTERA_CONSOLE_PORT"]
    for what, report in reports(spied):
        nats = report["nats"]
        for port in (spied.nats, console):
            answer = nats[f"127.0.0.1:{port}"]
            assert answer.startswith("unreachable: [Errno 111]"), (what, port, answer)  # reset: refused
        # The proxy lets it connect (then says nothing to a NATS client: the spy's read times out).
        assert "[Errno 111]" not in nats[f"127.0.0.1:{spied.proxy}"], (what, nats)
    # The same NATS, outside the sandbox, without a credential: open answers, secured refuses.
    answer = talk_nats(f"127.0.0.1:{spied.nats}")
    assert ("Authorization Violation" in answer) if spied.secure else ("PONG" in answer), answer


def test_no_file_under_the_data_dir_is_readable_by_an_apps_user_even_by_path(spied: Spied) -> None:
    """Outside any sandbox, as the spy's users: the data directory cannot be entered, nothing in it opened."""
    walker = (
        "import os, sys, json\n"
        "seen = []\n"
        "for d, dirs, files in os.walk(sys.argv[1]):\n"
        "    seen.append(d)\n"
        "    for f in files:\n"
        "        try:\n"
        "            open(os.path.join(d, f), 'rb').close(); seen.append(os.path.join(d, f))\n"
        "        except OSError:\n"
        "            pass\n"
        "print(json.dumps(seen))\n"
    )
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")  # one the app's user may run
    assert python, "a system python3 (Debian: python3)"
    for what, report in reports(spied):
        uid = report["identity"]["uid"]
        done = subprocess.run(
            [python, "-c", walker, str(spied.data)],
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
        assert json.loads(done.stdout) == [], (what, done.stdout[:2000])
    assert spied.data.stat().st_mode & 0o777 == 0o700
