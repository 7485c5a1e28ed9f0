"""The worker half of the machine scenarios, shared by the short run of ``make test``
(``test_machines_short.py``) and the whole one of ``make chaos`` (``test_machines.py``): the first server machine
(``--secure --tls``), every bad join refused in one line with nothing left behind, a worker joined with one
command, app traffic between their mesh addresses inside WireGuard (a capture on the worker's veth); and the
worker's removal, after which its credential works on no server."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from shared.security.machines import MachineToken
from tests.multinode.harness import Machine, Network
from tests.multinode.machines import cli_env, nodes, token
from tests.waiting import eventually_sync

PAYLOAD = "zattera-plaintext-canary-7f3c"


def join_refused(machine: Machine, token_text: str, name: str) -> str:
    done = machine.zattera(
        "up", "--data-dir", str(machine.data_dir), "--join", token_text, "--name", name, "--advertise", machine.address
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert not (machine.data_dir / "machine.json").exists(), "a refused join left the machine half-joined"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def connects(machine: Machine, creds: Path, ca: Path, url: str) -> str:
    """Connect from inside ``machine`` with a credentials file: 'ok' or the error."""
    code = (
        "import asyncio, ssl, nats\n"
        "async def go():\n"
        f"    tls = ssl.create_default_context(cafile={str(ca)!r})\n"
        f"    nc = await nats.connect({url!r}, user_credentials={str(creds)!r}, tls=tls,\n"
        "        allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)\n"
        "    await nc.close()\n"
        "try:\n    asyncio.run(go()); print('ok')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    return machine.exec(sys.executable, "-c", code, check=False).stdout.strip()


def read_until(stream: IO[str], text: str, timeout: float) -> None:
    """Read lines of a child's output until one contains ``text`` (its sign of being ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = stream.readline()
            if text in line:
                return
            if not line:
                break
    raise AssertionError(f"no {text!r} from the child within {timeout}s")


def wireguard_datagrams(capture: Path) -> int:
    """How many UDP datagrams to or from the WireGuard port the capture holds so far."""
    udp = subprocess.run(["tcpdump", "-nr", str(capture), "udp port 51820"], capture_output=True, text=True)
    return udp.stdout.count("UDP")


def first_server_and_worker(network: Network) -> tuple[Machine, Machine, list[str]]:
    """m1 bootstrapped, w1 joined over the mesh (checked encrypted); returns them and the options of
    every machine's ``zattera up``."""
    m1 = network.add("m1")
    w1 = network.add("w1")
    w2 = network.add("w2")
    common = ["--metrics-port", "0", "--proxy-tls-listen", "", "--proxy-listen", "0.0.0.0:8080"]
    m1.start("--secure", "--tls", "--name", "m1", "--advertise", m1.address, *common)
    eventually_sync(lambda: "m1" in nodes(m1), timeout=180, what="the first server machine registers its node")

    # Bad input: each refused in one line, nothing written on the machine, nothing registered in the cluster.
    assert "malformed join token" in join_refused(w2, "not-a-token", "w2")
    good = token(m1, "--ttl", "10m")
    parsed = MachineToken.parse(good)
    assert parsed.urls and all(m1.address in u for u in parsed.urls) and "BEGIN CERTIFICATE" in parsed.ca_pem
    unreachable = str(MachineToken(parsed.secret, parsed.sentinel_jwt, ("nats://10.231.0.99:4222",), parsed.ca_pem))
    assert "unreachable" in join_refused(w2, unreachable, "w2")
    assert "already in the cluster" in join_refused(w2, token(m1), "m1")
    short = token(m1, "--ttl", "1s")
    time.sleep(1.5)  # the token's own expiry, measured by the join service's clock
    assert "expired" in join_refused(w2, short, "w2")

    w1.start("--join", good, "--name", "w1", "--advertise", w1.address, *common)
    eventually_sync(lambda: "w1" in nodes(m1), timeout=120, what="the worker registers its node")
    assert "already used" in join_refused(w2, good, "w2")
    assert set(nodes(m1)) == {"m1", "w1"}, "a refused join registered a node"

    # The mesh: both nodes publish a WireGuard key and endpoint; traffic between mesh addresses is encrypted.
    found = nodes(m1)
    mesh = {n: str(found[n]["mesh_ip"]) for n in ("m1", "w1")}
    assert all(ip.startswith("10.98.") for ip in mesh.values()), mesh
    assert all(found[n].get("wireguard_public_key") for n in ("m1", "w1"))
    # w1's proxy listens on every interface of w1: m1 reaches it at w1's mesh address only through the tunnel.
    probe = f"import socket; socket.create_connection(({mesh['w1']!r}, 8080), timeout=1).close()"
    eventually_sync(
        lambda: m1.exec("python3", "-c", probe, check=False).returncode == 0,
        timeout=60,
        what="m1 reaches w1 over the mesh",
    )
    capture = w1.data_dir / "eth0.pcap"
    tcpdump = subprocess.Popen(
        ["ip", "netns", "exec", w1.netns, "tcpdump", "-i", "eth0", "-w", str(capture), "-U"],
        stderr=subprocess.PIPE,
        text=True,
    )
    listener = (
        f"import socket; s=socket.create_server(({mesh['w1']!r}, 7001)); print('ready', flush=True); "
        "c,_=s.accept(); print(c.recv(100).decode(), flush=True)"
    )
    server = subprocess.Popen(
        ["ip", "netns", "exec", w1.netns, "python3", "-c", listener], stdout=subprocess.PIPE, text=True
    )
    try:
        assert tcpdump.stderr is not None and server.stdout is not None
        read_until(tcpdump.stderr, "listening on", timeout=30)  # capturing from here on
        read_until(server.stdout, "ready", timeout=30)
        send = (
            f"import socket; c=socket.create_connection(({mesh['w1']!r}, 7001), timeout=10); "
            f"c.sendall({PAYLOAD!r}.encode()); c.close()"
        )
        m1.exec("python3", "-c", send)
        out, _ = server.communicate(timeout=20)
        assert PAYLOAD in out
        eventually_sync(lambda: wireguard_datagrams(capture) > 0, timeout=20, what="WireGuard datagrams on the veth")
    finally:
        server.kill()
        tcpdump.terminate()
        tcpdump.wait(10)
    wire = capture.read_bytes()
    assert PAYLOAD.encode() not in wire, "the app's payload crossed the wire in clear"
    assert wireguard_datagrams(capture) > 0, "no WireGuard datagrams on the veth"
    return m1, w1, common


def removed_worker_is_dead(m1: Machine, w1: Machine, server_urls: list[str]) -> None:
    """``zattera nodes remove w1``: its credentials stop working on every server of ``server_urls``."""
    # Removal: the worker's credentials stop working on every server.
    creds = w1.data_dir / "agent" / "node.creds"  # the node's own, apart from the control plane's (cli/layout.py)
    ca = w1.data_dir / "control" / "security" / "tls" / "ca.pem"
    url = f"tls://{m1.address}:4222"
    assert connects(w1, creds, ca, url) == "ok"
    w1.stop()
    done = m1.zattera("nodes", "remove", "w1", env=cli_env(m1))
    assert done.returncode == 0, done.stderr
    assert "credential(s) revoked" in done.stdout
    for server_url in server_urls:
        assert "Authorization" in connects(w1, creds, ca, server_url), server_url
    assert "w1" not in nodes(m1)
