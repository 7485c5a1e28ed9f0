"""What the machine scenarios ask of a cluster of machines: the CLI's environment on a server machine, its
nodes, its NATS servers, join tokens, and starting a cluster of three server machines."""

from __future__ import annotations

import json

from tests.multinode.harness import Machine, Network
from tests.waiting import eventually_sync

COMMON = ("--metrics-port", "0", "--proxy-tls-listen", "", "--proxy-listen", "0.0.0.0:8080")
"""Every machine's ``zattera up`` options beside its role: the proxy on every interface, no metrics port."""


def cli_env(server: Machine) -> dict[str, str]:
    security = server.data_dir / "control" / "security"
    return {
        "ZATTERA_NATS_URL": f"nats://{server.address}:4222",
        "ZATTERA_NATS_CREDS": str(security / "creds" / "operator.creds"),
        "ZATTERA_NATS_TLS_CA": str(security / "tls" / "ca.pem"),
    }


def nodes(server: Machine) -> dict[str, dict[str, object]]:
    done = server.zattera("nodes", "list", "--json", env=cli_env(server))
    if done.returncode != 0:
        return {}
    return {n["meta"]["id"]: n for n in json.loads(done.stdout)}


def servers(server: Machine) -> int:
    """How many NATS servers the cluster has, as ``zattera cluster status`` counts them."""
    done = server.zattera("cluster", "status", "--json", env=cli_env(server))
    return int(json.loads(done.stdout)["servers"]) if done.returncode == 0 else 0


def token(server: Machine, *args: str) -> str:
    done = server.zattera("nodes", "join-token", *args, env=cli_env(server), check=True)
    return done.stdout.strip()


def join_server(first: Machine, machine: Machine, expect_servers: int) -> None:
    """Join ``machine`` as a server machine with one command and wait until its node and NATS server are in."""
    machine.start(
        "--join",
        token(first, "--server", "--data-dir", str(first.data_dir)),
        "--server",
        "--name",
        machine.name,
        "--advertise",
        machine.address,
        *COMMON,
    )
    eventually_sync(lambda: machine.name in nodes(first), timeout=150, what=f"{machine.name} registers its node")
    eventually_sync(
        lambda: servers(first) == expect_servers, timeout=60, what=f"{machine.name}'s NATS server in the cluster"
    )


def three_servers(network: Network) -> tuple[Machine, Machine, Machine]:
    """The first server machine (``--secure --tls``, its three seats) and two more joined with one command each;
    every stream then at three copies, one per machine."""
    m1, m2, m3 = network.add("m1"), network.add("m2"), network.add("m3")
    m1.start("--secure", "--tls", "--name", "m1", "--advertise", m1.address, *COMMON)
    eventually_sync(lambda: "m1" in nodes(m1), timeout=180, what="the first server machine registers its node")
    join_server(m1, m2, 4)
    join_server(m1, m3, 5)
    moved = m1.zattera("cluster", "replicas", "3", "--json", env=cli_env(m1))
    assert moved.returncode == 0, moved.stderr
    assert all(s["current"] == 3 for s in json.loads(moved.stdout)["streams"])
    return m1, m2, m3
