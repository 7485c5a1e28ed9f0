"""The apps' network fence installed for real (``services/agent/firewall.py``, iptables): a process running as
a uid of the apps' range cannot connect to a port the control plane's process tree listens on, on any
address of this machine; it can still reach an allowed port (the proxy's), the private network's addresses
on the same port, and a port no control process holds. Outside the range nothing changes. The chain is
installed idempotently, follows listeners that appear later, and leaves nothing when removed.

Loopback only; ~2 s.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import pytest

from services.agent.firewall import Fence, chain_name

UIDS = range(0x7E000000, 0x7E000010)
APP_UID = UIDS.start + 3
OUTSIDE_UID = UIDS.stop + 5

CONNECT = (
    "import socket, sys\n"
    "for hp in sys.argv[1:]:\n"
    "    host, _, port = hp.rpartition(':')\n"
    "    try:\n"
    "        socket.create_connection((host, int(port)), timeout=3).close(); print('ok')\n"
    "    except OSError as exc:\n"
    "        print(type(exc).__name__)\n"
)

pytestmark = pytest.mark.skipif(
    (os.geteuid() != 0 or not shutil.which("iptables")) and os.environ.get("CI") != "true",
    reason="firewall rules need root and iptables",
)


def connect_as(uid: int, *addresses: str) -> list[str]:
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    assert python
    done = subprocess.run(
        [python, "-c", CONNECT, *addresses],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        timeout=30,
    )
    return done.stdout.split()


@contextmanager
def listener(host: str = "0.0.0.0", port: int = 0) -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    try:
        yield sock
    finally:
        sock.close()


def iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True)


def iptables_save() -> str:
    return subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True).stdout


@pytest.fixture
async def fence(tmp_path: object) -> AsyncIterator[Fence]:
    made: list[Fence] = []

    def make(**kwargs: object) -> Fence:
        f = Fence(str(tmp_path), UIDS, **kwargs)  # type: ignore[arg-type]
        made.append(f)
        return f

    yield make  # type: ignore[misc]
    for f in made:
        f.remove()


async def test_an_apps_user_cannot_connect_to_the_control_planes_ports_but_to_the_rest(fence: object) -> None:
    with listener() as anywhere, listener("127.0.0.1") as control, listener() as proxy:
        wide, port, proxy_port = (s.getsockname()[1] for s in (anywhere, control, proxy))
        # The private network's addresses, one on the same port number as a control listener.
        with listener("127.130.0.2") as private, listener("127.130.0.3", port):
            f: Fence = fence(control_pids=[os.getpid()], allowed_ports=[proxy_port])  # type: ignore[operator]
            assert await f.install(), f.problem
            assert {wide, port} <= f.blocked().ports and proxy_port not in f.blocked().ports
            targets = [
                f"127.0.0.1:{wide}",
                f"127.0.0.2:{wide}",  # every address of the machine
                f"127.0.0.1:{port}",
                f"127.0.0.1:{proxy_port}",
                f"127.130.0.2:{private.getsockname()[1]}",
                f"127.130.0.3:{port}",
            ]
            got = await asyncio.to_thread(connect_as, APP_UID, *targets)
            assert got == ["ConnectionRefusedError"] * 3 + ["ok"] * 3
            outside = await asyncio.to_thread(connect_as, OUTSIDE_UID, *targets[:3])
            assert outside == ["ok"] * 3


async def test_installing_twice_keeps_one_jump_and_remove_leaves_nothing(fence: object) -> None:
    f: Fence = fence()  # type: ignore[operator]
    assert await f.install() and await f.install()
    chain = chain_name(f.key)
    assert iptables_save().count(f"-j {chain}") == 1
    f.remove()
    assert chain not in iptables_save()


async def test_a_bridges_jumps_are_installed_once_and_removed_with_the_chain(tmp_path: object) -> None:
    f = Fence(f"{tmp_path}/bridged", UIDS, interfaces=["zbr-test0"])  # no such interface yet: rules still apply
    try:
        assert await f.install() and await f.install()
        saved = iptables_save()
        assert saved.count(f"-j {f.chain}") == 3
        assert "-A INPUT -i zbr-test0 " in saved and "-A FORWARD -i zbr-test0 " in saved
    finally:
        f.remove()
    assert f.chain not in iptables_save()


async def test_the_chain_of_an_agent_that_was_killed_is_removed_by_the_next_one(tmp_path: object) -> None:
    gone = Fence(f"{tmp_path}/killed", UIDS)
    assert await gone.install()
    own = gone._jumps()[0]  # as a killed agent leaves it, but naming a pid that no longer exists
    ghost = [*own[:-3], "zattera-agent-pid=999999999", *own[-2:]]
    iptables("-I", "OUTPUT", "1", *ghost[1:])
    iptables("-D", *own)
    assert gone.chain in iptables_save()
    fresh = Fence(f"{tmp_path}/fresh", UIDS)
    try:
        assert await fresh.install()
        assert gone.chain not in iptables_save() and fresh.chain in iptables_save()
    finally:
        fresh.remove()
        gone.remove()


async def test_a_listener_of_the_control_plane_started_later_is_fenced_at_the_next_sync(fence: object) -> None:
    f: Fence = fence(control_pids=[os.getpid()])  # type: ignore[operator]
    assert await f.install()
    with listener("127.0.0.1") as late:
        address = f"127.0.0.1:{late.getsockname()[1]}"
        assert await asyncio.to_thread(connect_as, APP_UID, address) == ["ok"]
        await f.sync()
        assert await asyncio.to_thread(connect_as, APP_UID, address) == ["ConnectionRefusedError"]


async def test_a_known_control_port_is_fenced_before_anything_listens_there(fence: object) -> None:
    """The console's port, named by ``zattera up``, is fenced from the start: a build step run while the console
    is still starting finds it refused, not open until the next sync (found by the isolation test)."""
    with listener("127.0.0.1") as reserved:
        port = reserved.getsockname()[1]
    f: Fence = fence(control_pids=[], fixed_ports=[port])  # type: ignore[operator]
    assert await f.install()
    with listener("127.0.0.1", port) as console:  # the console starts listening after the fence was installed
        address = f"127.0.0.1:{console.getsockname()[1]}"
        assert await asyncio.to_thread(connect_as, APP_UID, address) == ["ConnectionRefusedError"]


async def test_a_nats_server_elsewhere_is_fenced_by_address(fence: object) -> None:
    """A worker's NATS server on another machine: here 127.0.0.9 stands for it (not a listener of a control
    process, named only by the agent's server URL)."""
    with listener("127.0.0.9") as remote:
        port = remote.getsockname()[1]
        f: Fence = fence(nats_urls=[f"nats://127.0.0.9:{port}"])  # type: ignore[operator]
        assert await f.install()
        assert await asyncio.to_thread(connect_as, APP_UID, f"127.0.0.9:{port}") == ["ConnectionRefusedError"]
