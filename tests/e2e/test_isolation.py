"""A hostile app gets nothing of the platform: the real ``zattera up`` (open, then ``--secure``) on the process
runtime, a victim app with a secret (``examples/hello``) and the spy (``tests/apps/spy``) deployed from
source as a user does. The spy runs once as a build step and once as the app; each time it tries every file
under the data directory (the control plane's keys and credentials, the node's own credential), every
other process's environment, NATS and the console without a credential (the apps' firewall refuses even
the connection, open or secured) and the Docker sockets, and reports what it got.

Then the data directory is walked as the spy's user, outside any sandbox: not one file may be readable
even by a path (the directory is the agent's and the control plane's alone).

The same spy runs on the docker runtime of an open cluster (the session's private dockerd): its container
runs as its environment's user, so the same fence refuses its connections to NATS and to every other
listener of the control plane, while it serves through the proxy.

Three clusters: process runtime open and secured, docker runtime open (~1-2 min each on a busy machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import ipaddress
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from services.agent.firewall import PRIVATE_NETWORK, chain_name
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
APP_UIDS = 0x70000000
"""The first uid of the environments' users (``ZATTERA_AGENT_SANDBOX_UID_BASE``'s default)."""


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
    listeners: list[str]
    """Every listener of the control plane's process tree but the proxy's public port (``host:port``)."""


async def fetch(port: int, path: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers={"Host": "spy.localhost"}) as response,
    ):
        assert response.status == 200, await response.text()
        return dict(json.loads(await response.text()))


def control_listeners(root_pid: int, *, apps_from: int, allowed: set[int]) -> list[str]:
    """``host:port`` of every TCP listener of the process tree under ``root_pid`` (``zattera up``: NATS, the
    services, the console, metrics, the join service, HAProxy) on an address of this machine, but the
    ``allowed`` ports, the private network's and an app's (a sandboxed instance: uid ``apps_from`` up)."""
    pids = set()
    top = psutil.Process(root_pid)
    for proc in (top, *top.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            if proc.uids().real < apps_from:
                pids.add(proc.pid)
    found = set()
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids or not conn.laddr:
            continue
        address, port = conn.laddr.ip, conn.laddr.port
        if port in allowed or ":" in address or ipaddress.ip_address(address) in ipaddress.ip_network(PRIVATE_NETWORK):
            continue
        found.add(f"{'127.0.0.1' if address == '0.0.0.0' else address}:{port}")
    return sorted(found)


@contextlib.contextmanager
def spy_cluster(root: Path, *, secure: bool, runtime: str, docker_host: str = "") -> Iterator[Spied]:
    """``zattera up`` (``runtime``), the victim with its secret and the spy deployed from source; the spy told
    to try the data directory, the node's credential, the Docker sockets, and NATS at every listener of the
    control plane and at the proxy (only the proxy may even accept the connection)."""
    data, nats, proxy = root / "data", free_port(), free_port()
    args = ["--proxy-listen", f"127.0.0.1:{proxy}", "--proxy-tls-listen", "", "--metrics-port", "0"]
    env = {"ZATTERA_AGENT_RUNTIME": runtime, "ZATTERA_CONSOLE_PORT": str(free_port())}
    if docker_host:
        env["ZATTERA_AGENT_DOCKER_HOST"] = docker_host
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
        # NATS, the console and the proxy by name, then every other listener of the control plane.
        named = [f"127.0.0.1:{nats}", f"127.0.0.1:{env['ZATTERA_CONSOLE_PORT']}", f"127.0.0.1:{proxy}"]
        listeners = control_listeners(up.proc.pid, apps_from=APP_UIDS, allowed={proxy})
        assert any(a.endswith(f":{nats}") for a in listeners), listeners
        tcp = [*named, *(a for a in listeners if a not in named)]
        (spy / "spy.env").write_text(
            f"SPY_PATHS={':'.join(targets)}\nSPY_NATS={','.join(tcp)}\nSPY_SOCKETS={','.join(DOCKER_SOCKETS)}\n"
        )
        up.cli("apps", "apply", str(spy / "zattera.toml"))
        up.cli("deploy", str(spy), "--env", SPY_ENV, timeout=240)
        report = asyncio.run(fetch(proxy, "/"))  # the spy serves through the proxy: its deploy went live
        build = asyncio.run(fetch(proxy, "/build"))
        yield Spied(secure, up, data, nats, proxy, secret, report, build, listeners)
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


@pytest.fixture(scope="module", params=["open", "secure"])
def spied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Spied]:
    root = tmp_path_factory.mktemp(f"isolation-{request.param}")
    with spy_cluster(root, secure=request.param == "secure", runtime="process") as found:
        yield found


@pytest.fixture(scope="module")
def docker_spied(tmp_path_factory: pytest.TempPathFactory, docker_host: str) -> Iterator[Spied]:
    """The docker runtime on an open cluster (the session's private dockerd, host network)."""
    root = tmp_path_factory.mktemp("isolation-docker")
    with spy_cluster(root, secure=False, runtime="docker", docker_host=docker_host) as found:
        yield found


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
        for address in spied.listeners:  # every other listener of the control plane too
            assert nats[address].startswith("unreachable: [Errno 111]"), (what, address, nats[address])
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


# ------------------------------------------------------------------------------------------ docker runtime


def test_a_docker_node_says_its_containers_are_fenced(docker_spied: Spied) -> None:
    assert "apps: containers (docker runtime, a user per environment, no capabilities, fenced" in docker_spied.up.text()
    nodes = json.loads(docker_spied.up.cli("nodes", "list", "--json").stdout)
    assert [(n.get("isolation"), n.get("isolationProblem", "")) for n in nodes] == [("container", "")]


def test_a_docker_spy_runs_as_its_environments_user_without_any_capability(docker_spied: Spied) -> None:
    me = docker_spied.report["identity"]
    assert me["uid"] >= APP_UIDS and me["gid"] == me["uid"], me
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert me["status"][caps] == "0000000000000000", (caps, me["status"])
    assert me["status"]["NoNewPrivs"] == "1"
    assert me["uid"] != docker_spied.build["identity"]["uid"]  # its builds have a user of their own


def test_a_docker_spy_on_an_open_cluster_cannot_connect_to_nats_nor_any_control_listener(docker_spied: Spied) -> None:
    """The container shares the host's network, but its sockets are its environment's user's: the apps'
    firewall resets its connections to NATS, the console and every other listener of the control plane.
    The proxy accepts it, and it served these reports through the proxy (the fixture fetched them)."""
    nats = docker_spied.report["nats"]
    console = docker_spied.up.env["ZATTERA_CONSOLE_PORT"]
    for address in {f"127.0.0.1:{docker_spied.nats}", f"127.0.0.1:{console}", *docker_spied.listeners}:
        assert nats[address].startswith("unreachable: [Errno 111]"), (address, nats[address])
    assert "[Errno 111]" not in nats[f"127.0.0.1:{docker_spied.proxy}"], nats
    assert "PONG" in talk_nats(f"127.0.0.1:{docker_spied.nats}")  # the same NATS answers anybody outside


def test_a_docker_spy_sees_no_file_of_the_data_dir_no_socket_no_secret(docker_spied: Spied) -> None:
    report = docker_spied.report
    assert report["files"]["read"] == {} and report["files"]["listed"] == {}, report["files"]
    for socket_path in DOCKER_SOCKETS:
        assert report["docker"][socket_path].startswith("unreachable: [Errno 2]"), report["docker"]
    text = json.dumps(report)
    assert docker_spied.secret not in text and "NKEY SEED" not in text
    assert len(report["proc"]["pids"]) <= 4, report["proc"]["pids"]  # tini and the spy: its own pid namespace
