"""``make up`` = ``zattera up``, as a newcomer runs it: start the cluster, apply and deploy the example with
the CLI, curl it through the proxy, Ctrl-C (SIGINT) — nothing may be left running — then start it again on
the same data dir: the same cluster comes back, app included.

Default timers (no ``ZATTERA_*`` shortening): this is the product as shipped.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, ROOT, cli_argv, leftovers, version_of
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ENV = "demo/hello/production"


class Up:
    """One ``zattera up`` run as a subprocess (its own process group, as a terminal would start it)."""

    def __init__(self, data_dir: Path, nats_port: int, proxy_port: int, *, through_tee: bool = False) -> None:
        """``through_tee``: run as ``zattera up 2>&1 | tee FILE`` in a shell (:meth:`ctrl_c_group`)."""
        self.data_dir = data_dir
        self.nats_port = nats_port
        self.proxy_port = proxy_port
        self.output = data_dir.parent / f"up-{time.monotonic_ns()}.out"
        self.env = {
            **os.environ,
            "COLUMNS": "200",
            "PYTHONUNBUFFERED": "1",
            "OTEL_TRACES_EXPORTER": "none",
        }
        for name in [k for k in self.env if k.startswith("ZATTERA_")]:
            del self.env[name]
        ports = ["--port", str(nats_port), "--proxy-port", str(proxy_port)]
        argv = [*cli_argv(), "up", "--data-dir", str(data_dir), *ports]
        if through_tee:
            argv = ["/bin/sh", "-c", f"{shlex.join(argv)} 2>&1 | tee {shlex.quote(str(self.output))}"]
        with open(self.output, "wb") as sink:
            self.proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.DEVNULL if through_tee else sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def ctrl_c_group(self, timeout: float = 60.0) -> None:
        """Ctrl-C as a terminal sends it: to the whole foreground group, tee included."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    @property
    def url(self) -> str:
        match = re.search(r"NATS:\s+(nats://\S+)", self.text())
        assert match, self.text()
        return match.group(1)

    def ctrl_c(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*cli_argv(), *args],
            cwd=ROOT,
            env={**self.env, "ZATTERA_NATS_URL": self.url},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, f"zattera {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done


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
