"""Cross-node private networking inside network namespaces this test creates (root only): node A's
forwarder reaches a replica on node B through B's mesh address, as endpoints on other nodes are reached.
Every address used lives inside the two namespaces; nothing outside them is touched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for network namespaces"
)

ECHO = """
import asyncio, sys

async def serve(reader, writer):
    while data := await reader.read(1024):
        writer.write(b"node-b:" + data)
        await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(serve, sys.argv[1], int(sys.argv[2]))
    print("ready", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""

NODE_A = """
import asyncio, json, sys
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb
from services.agent.forwarder import Forwarder

async def main():
    service = cpb.InternalService(
        fqdn="db.production.shop.internal.", project_id="shop-id", environment_id="db-env", vip="127.128.0.5"
    )
    service.ports.add(name="db", port=5432, protocol="tcp", endpoints=[cpb.Endpoint(addr=sys.argv[1], healthy=True)])
    forwarder = Forwarder()
    await forwarder.apply(cpb.RouteSnapshot(version=1, internal_services=[service]))
    env = await forwarder.instance_env(
        pb.Assignment(environment_id="web-env", project_id="shop-id"),
        pb.Release(environment_id="web-env", project_id="shop-id"),
    )
    reader, writer = await asyncio.open_connection(env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], 5432)
    writer.write(b"across")
    answer = await asyncio.wait_for(reader.read(1024), 5)
    writer.close()
    await forwarder.close()
    print(json.dumps({"host": env["ZATTERA_SERVICE_DB_PRODUCTION_HOST"], "answer": answer.decode()}))

asyncio.run(main())
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_nodes() -> Iterator[tuple[str, str, str]]:
    """Namespaces A and B joined by a veth pair; B's mesh address (a /30 inside the pair only)."""
    tag = f"{os.getpid() % 100_000}"
    node_a, node_b = f"zt-a-{tag}", f"zt-b-{tag}"
    veth_a, veth_b = f"zva{tag}", f"zvb{tag}"
    mesh_a, mesh_b = "10.231.0.1", "10.231.0.2"
    _ip("netns", "add", node_a)
    try:
        _ip("netns", "add", node_b)
        _ip("link", "add", veth_a, "netns", node_a, "type", "veth", "peer", "name", veth_b, "netns", node_b)
        for ns, dev, address in ((node_a, veth_a, mesh_a), (node_b, veth_b, mesh_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield node_a, node_b, mesh_b
    finally:
        for ns in (node_a, node_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_forwarder_on_node_a_reaches_a_replica_on_node_b_by_mesh_ip(two_nodes: tuple[str, str, str]) -> None:
    node_a, node_b, mesh_b = two_nodes
    echo = subprocess.Popen(
        ["ip", "netns", "exec", node_b, sys.executable, "-c", ECHO, mesh_b, "7000"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        result = subprocess.run(
            ["ip", "netns", "exec", node_a, sys.executable, "-c", NODE_A, f"{mesh_b}:7000"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        answer = json.loads(result.stdout)
        assert answer == {"host": "127.129.0.5", "answer": "node-b:across"}
    finally:
        echo.kill()
        echo.wait()
