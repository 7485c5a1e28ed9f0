"""``make up`` = ``zattera up``, as a newcomer runs it: start the cluster, apply and deploy the example with
the CLI, curl it through the proxy, Ctrl-C (SIGINT) — nothing may be left running — then start it again on
the same data dir: the same cluster comes back, app included.

Default timers (no ``ZATTERA_*`` shortening): this is the product as shipped.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from services.proxy.launch import haproxy_binary
from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, Load, leftovers, version_of
from tests.e2e.upcmd import Up
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ENV = "demo/hello/production"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "zattera-data"
    yield directory
    # Whatever a failed test left behind: never let a process outlive it.
    from tests.e2e.cluster import kill_tree_under

    kill_tree_under(directory, also_matching=str(directory))


def left_running(data_dir: Path, url: str) -> list[str]:
    """App instances (working under the data dir), NATS and the agent (data dir arguments), the services
    (the NATS URL argument)."""
    return sorted(set(leftovers(data_dir, also_matching=str(data_dir)) + leftovers(data_dir, also_matching=url)))


def logs_of(data_dir: Path) -> str:
    return "\n".join(
        f"==> {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
        for p in sorted((data_dir / "logs").glob("*.log"))
    )


async def hello(port: int) -> tuple[int, str]:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{port}/", headers={"Host": "hello.localhost"}) as response,
        ):
            return response.status, await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return 0, repr(exc)


async def test_make_up_deploy_curl_ctrl_c_and_resume(data_dir: Path) -> None:
    nats_port, proxy_port = free_port(), free_port()
    up = Up(data_dir, nats_port, proxy_port)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up")
        assert f"http://127.0.0.1:{proxy_port}" in up.text(), up.text()
        # Which runtime the local node uses and why, on the terminal (docker wherever a daemon answers).
        await eventually(lambda: "agent runtime: " in up.text(), 60, "the agent's runtime said")
        said = re.search(r"agent runtime: (docker|process) — (.+)", up.text())
        assert said, up.text()
        assert said.group(1) == "process" or "a Docker daemon answers at" in said.group(2), said.group(0)
        assert "zattera deploy examples/hello" in up.text()  # the next-step hint
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        deployed = up.cli("deploy", str(EXAMPLE), "--env", ENV)
        assert "live: release" in deployed.stderr, deployed.stderr

        async def served() -> bool:
            status, body = await hello(proxy_port)
            return status == 200 and version_of(body) == "v1"

        await eventually(served, 60, "hello answers through the proxy")

        url = up.url
        assert up.ctrl_c() == 0, up.text()
        assert "stopped." in up.text()
        left = left_running(data_dir, url)
        assert left == [], "left running after Ctrl-C:\n" + "\n".join(left)

        # Again, same data dir: the same cluster resumes and the app comes back without a new deploy.
        up = Up(data_dir, nats_port, proxy_port)
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up again")
        await eventually(served, 90, "hello answers again after the restart")
        releases = up.cli("releases", "--env", ENV, "--json")
        assert releases.stdout.count('"version"') == 1, releases.stdout  # the same release, not a new one

        assert up.ctrl_c() == 0, up.text()
        left = left_running(data_dir, url)
        assert left == [], "left running after the second Ctrl-C:\n" + "\n".join(left)
    except BaseException:
        print(up.text())
        print(logs_of(data_dir))
        raise
    finally:
        up.kill()


async def test_nothing_is_left_running_when_the_terminal_goes_or_the_supervisor_is_killed(data_dir: Path) -> None:
    """``zattera up | tee log`` then Ctrl-C: tee ends first, so printing "stopping…" failed and the supervisor
    died before stopping anything. And a supervisor killed outright (SIGKILL, the OOM killer) cannot stop
    anything itself: every process it started gets SIGTERM from the kernel and stops on its own."""
    nats_port, proxy_port = free_port(), free_port()
    up = Up(data_dir, nats_port, proxy_port, through_tee=True)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up")
        url = up.url
        up.ctrl_c_group()
        await eventually(lambda: left_running(data_dir, url) == [], 30, "nothing left after Ctrl-C through tee")

        up = Up(data_dir, nats_port, proxy_port)
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up again")
        os.kill(up.proc.pid, signal.SIGKILL)  # the supervisor alone, not its children's sessions
        up.proc.wait(10)
        await eventually(lambda: left_running(data_dir, url) == [], 30, "nothing left after the supervisor's SIGKILL")
    except BaseException:
        print(up.text())
        print(logs_of(data_dir))
        print("\n".join(left_running(data_dir, up.url)))
        raise
    finally:
        up.kill()


def proxy_process_of(data_dir: Path) -> psutil.Process:
    """The proxy process ``zattera up`` runs for ``data_dir`` (its cache dir is under it)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "services.proxy" in argv and any(str(data_dir) in arg for arg in argv):
            found.append(proc)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")
async def test_the_proxy_process_killed_under_zattera_up_fails_no_request(data_dir: Path) -> None:
    """The proxy process killed outright (the OOM killer, a bug), as ``zattera up`` runs it with HAProxy: HAProxy
    keeps serving, ``zattera up`` starts the proxy again after its restart delay, and the new one adopts HAProxy.
    Not one request through the proxy fails, before, during or after."""
    nats_port, proxy_port = free_port(), free_port()
    up = Up(data_dir, nats_port, proxy_port)
    proxy_log = data_dir / "logs" / "proxy.log"
    load: Load | None = None
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up")
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        up.cli("deploy", str(EXAMPLE), "--env", ENV)
        await eventually(lambda: hello_is(proxy_port, "v1"), 60, "hello answers through the proxy")
        killed = proxy_process_of(data_dir)
        load = Load(proxy_port, "hello.localhost", rate=100).start()
        await eventually(lambda: load is not None and load.ok >= 100, 30, "requests before the kill")
        killed.kill()
        await eventually(lambda: "proxy exited" in up.text(), 30, "zattera up sees the proxy exit")
        adopted = "haproxy: adopted pid"
        await eventually(lambda: adopted in proxy_log.read_text(errors="replace"), 60, "the next proxy adopts HAProxy")
        assert proxy_process_of(data_dir).pid != killed.pid
        answered = load.ok
        await eventually(lambda: load is not None and load.ok >= answered + 100, 30, "requests after the adoption")
        await load.stop()
        print("through the kill:", load.summary())
        assert load.failures == [], load.summary()
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        print(logs_of(data_dir))
        raise
    finally:
        if load is not None:
            await load.stop()
        up.kill()


async def hello_is(port: int, version: str) -> bool:
    status, body = await hello(port)
    return status == 200 and version_of(body) == version
