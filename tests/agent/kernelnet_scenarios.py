"""Scenarios of the private network's kernel path, each run inside a network namespace a test creates
(``ip netns exec NS python -m tests.agent.kernelnet_scenarios NAME ARGS``): the forwarder with its
:class:`~services.agent.kernelnet.KernelPath` fed a snapshot, real iptables, loopback and namespace addresses
only. Each prints one JSON object for the test to check."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.firewall import Fence
from services.agent.forwarder import Forwarder
from services.agent.kernelnet import CONNTRACK, Dnat, KernelPath

DB_VIP = "127.128.0.5"
DB_PORT = 5432


def snapshot(version: int, *endpoints: str, project: str = "shop-id") -> cpb.RouteSnapshot:
    service = cpb.InternalService(
        fqdn="db.production.shop.internal.", project_id=project, environment_id="db-env", vip=DB_VIP
    )
    service.ports.add(
        name="db", port=DB_PORT, protocol="tcp", endpoints=[cpb.Endpoint(addr=a, healthy=True) for a in endpoints]
    )
    return cpb.RouteSnapshot(version=version, internal_services=[service])


def consumer(env_id: str, project: str = "shop-id") -> tuple[pb.Assignment, pb.Release]:
    return (
        pb.Assignment(environment_id=env_id, project_id=project),
        pb.Release(environment_id=env_id, project_id=project),
    )


async def echo(name: str, host: str = "127.0.0.1") -> tuple[asyncio.Server, int]:
    """A server answering each message with ``name:`` and the message."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(f"{name}:".encode() + data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    return server, server.sockets[0].getsockname()[1]


async def ask(host: str, port: int, text: str = "hi") -> tuple[str, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    writer.write(text.encode())
    answer = await asyncio.wait_for(reader.read(1024), 5)
    return answer.decode(), writer


async def ask_once(host: str, port: int) -> str:
    try:
        answer, writer = await ask(host, port)
    except OSError as exc:
        return type(exc).__name__
    writer.close()
    return answer


def translated(address: str, port: int) -> list[str]:
    """``host:port`` each established connection to ``address:port`` was translated to (conntrack)."""
    found = []
    for line in CONNTRACK.read_text().splitlines():
        if f"dst={address} " in line and f"dport={port} " in line and "ESTABLISHED" in line:
            words = [w.split("=", 1) for w in line.split() if "=" in w]
            src = [v for k, v in words if k == "src"]
            sport = [v for k, v in words if k == "sport"]
            found.append(f"{src[1]}:{sport[1]}")
    return found


def route_localnet(device: str) -> str:
    return Path(f"/proc/sys/net/ipv4/conf/{device}/route_localnet").read_text().strip()


def saved() -> str:
    return "".join(
        subprocess.run(["/usr/sbin/iptables-save", "-t", table], capture_output=True, text=True, check=True).stdout
        for table in ("nat", "raw")
    )


async def with_forwarder(run: Callable[[Forwarder], Awaitable[dict[str, object]]]) -> dict[str, object]:
    forwarder = Forwarder(kernel=KernelPath("/var/lib/zattera-test-agent"), hold_timeout=1)
    path = await forwarder.start_kernel()
    try:
        result = await run(forwarder)
    finally:
        await forwarder.close()
    result["path"] = path
    result["after_stop"] = saved()
    return result


async def reach(forwarder: Forwarder) -> dict[str, object]:
    """A consumer reaches the target through the rule; another project's env has no address and no rule."""
    server, port = await echo("db")
    await forwarder.apply(snapshot(1, f"127.0.0.1:{port}"))
    env = await forwarder.instance_env(*consumer("web-env"))
    other_env = await forwarder.instance_env(*consumer("spy-env", project="other-id"))
    host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
    answer, writer = await ask(host, DB_PORT)
    result: dict[str, object] = {
        "host": host,
        "answer": answer,
        "translated": translated(host, DB_PORT),
        "endpoint": f"127.0.0.1:{port}",
        "rules": saved(),
        "other_env": sorted(k for k in other_env if k.startswith("ZATTERA_SERVICE_")),
        # The other env's own address for the target (slot 2), and the first consumer's, asked by the other env
        # (a process sharing the namespace can connect to any address: the policy gives it no name or rule).
        "other": await ask_once("127.130.0.5", DB_PORT),
    }
    writer.close()
    server.close()
    return result


async def red_green(forwarder: Forwarder) -> dict[str, object]:
    """The rule follows an endpoint change; a connection opened before it stays on the old replica."""
    red, red_port = await echo("red")
    green, green_port = await echo("green")
    await forwarder.apply(snapshot(1, f"127.0.0.1:{red_port}"))
    env = await forwarder.instance_env(*consumer("web-env"))
    host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
    reader, held = await asyncio.wait_for(asyncio.open_connection(host, DB_PORT), 5)
    held.write(b"a")
    before = (await asyncio.wait_for(reader.read(1024), 5)).decode()
    await forwarder.apply(snapshot(2, f"127.0.0.1:{green_port}"))
    env_after = await forwarder.instance_env(*consumer("web-env"))
    after = await ask_once(host, DB_PORT)
    held.write(b"b")
    await held.drain()
    result: dict[str, object] = {
        "before": before,
        "after": after,
        "same_host": env_after["ZATTERA_SERVICE_DB_PRODUCTION_HOST"] == host,
        "old": forwarder.old_connections(),
    }
    result["held_after"] = (await asyncio.wait_for(reader.read(1024), 5)).decode()
    held.close()
    # No endpoint (a scale-to-zero env asleep, here none at all): no rule, the user-space listener answers.
    await forwarder.apply(snapshot(3))
    result["no_endpoint"] = await ask_once(host, DB_PORT)
    result["rules_without_endpoint"] = saved()
    red.close()
    green.close()
    return result


async def remote(forwarder: Forwarder) -> dict[str, object]:
    """An endpoint in another namespace (its mesh address): route_localnet on the way out, masqueraded."""
    await forwarder.apply(snapshot(1, sys.argv[2]))
    env = await forwarder.instance_env(*consumer("web-env"))
    host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
    device = sys.argv[3]
    answer = await ask_once(host, DB_PORT)
    localnet = route_localnet(device)
    return {"answer": answer, "route_localnet": localnet, "translated": translated(host, DB_PORT)}


APP_UIDS = range(0x7E000000, 0x7E000010)
CONNECT_AS = (
    "import socket, sys\n"
    "for hp in sys.argv[1:]:\n"
    "    host, _, port = hp.rpartition(':')\n"
    "    try:\n"
    "        s = socket.create_connection((host, int(port)), timeout=3)\n"
    "        s.sendall(b'x')\n"
    "        print(s.recv(64).decode() or 'closed')\n"
    "    except OSError as exc:\n"
    "        print(type(exc).__name__)\n"
)


ECHO_AS = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"db:" + conn.recv(64))
    conn.close()
"""


def system_python() -> str:
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    assert python
    return python


def replica_as(uid: int) -> tuple[subprocess.Popen[str], int]:
    """An echo server answering ``db:`` and the message, run as ``uid``; its port."""
    db = subprocess.Popen(
        [system_python(), "-c", ECHO_AS], user=uid, group=uid, stdout=subprocess.PIPE, text=True, cwd="/"
    )
    assert db.stdout is not None
    return db, int(db.stdout.readline())


def connect_as(uid: int, *addresses: str) -> list[str]:
    python = system_python()
    done = subprocess.run(
        [python, "-c", CONNECT_AS, *addresses],
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


async def fenced(forwarder: Forwarder) -> dict[str, object]:
    """The apps' fence still holds with the kernel path: an app's user reaches its target through the rule,
    not a fenced port — neither directly nor through a rule pointed at it (the fence sees the translated
    destination)."""
    # The replica runs as an app's user, as the agent runs it (the agent's own listeners are fenced).
    db, db_port = await asyncio.to_thread(replica_as, APP_UIDS.start + 4)
    control, control_port = await echo("control")
    fence = Fence("/var/lib/zattera-test-agent", APP_UIDS, fixed_ports=[control_port])
    installed = await fence.install()
    try:
        await forwarder.apply(snapshot(1, f"127.0.0.1:{db_port}"))
        env = await forwarder.instance_env(*consumer("web-env"))
        host = env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"]
        app = APP_UIDS.start + 3
        before = await asyncio.to_thread(connect_as, app, f"{host}:{DB_PORT}", f"127.0.0.1:{control_port}")
        await forwarder.apply(snapshot(2, f"127.0.0.1:{control_port}"))  # a rule pointed at a fenced port
        through = await asyncio.to_thread(connect_as, app, f"{host}:{DB_PORT}")
        outside = await asyncio.to_thread(connect_as, APP_UIDS.stop + 5, f"{host}:{DB_PORT}")
    finally:
        fence.remove()
        db.kill()
        db.wait()
        control.close()
    return {"installed": installed, "problem": fence.problem, "before": before, "through": through, "outside": outside}


async def fallback() -> dict[str, object]:
    """No iptables on the PATH: the user-space forwarder carries the connection."""
    return await with_forwarder(reach)


async def stale() -> dict[str, object]:
    """Chains of an agent that is gone (its pid named in the jumps) are removed by the next one."""
    dead = KernelPath("/var/lib/zattera-test-agent", pid=2**22 + 7, alive=lambda pid: pid != 2**22 + 7)
    await asyncio.to_thread(dead.install)
    await asyncio.to_thread(dead.apply, [Dnat("127.129.0.5", 5432, ("127.0.0.1:31000",))])  # a consumer's chain
    before = saved()
    fresh = KernelPath("/var/lib/zattera-test-agent", alive=lambda pid: pid != 2**22 + 7)
    await asyncio.to_thread(fresh.install)
    during = saved()
    await asyncio.to_thread(fresh.apply, [Dnat("127.130.0.5", 5432, ("127.0.0.1:31000",))])
    consumer = saved()
    await asyncio.to_thread(fresh.apply, [])  # the consumer left: its chain goes
    left = saved()
    await asyncio.to_thread(fresh.remove)
    return {
        "before": before,
        "during": during,
        "consumer": consumer,
        "left": left,
        "after": saved(),
        "pid": os.getpid(),
    }


async def main() -> None:
    name = sys.argv[1]
    if name == "fallback":
        result = await fallback()
    elif name == "stale":
        result = await stale()
    else:
        runs = {"reach": reach, "red_green": red_green, "remote": remote, "fenced": fenced}
        result = await with_forwarder(runs[name])
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
