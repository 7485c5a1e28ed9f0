"""A cluster of machines, each a network namespace running what ``zattera up`` runs there (``--secure
--tls``): the first server machine, a worker joined with one command, every bad join refused in one line with
nothing left behind, app traffic between machines inside WireGuard, two more server machines joined with one
command each, every stream moved to three copies on three machines, and a removed worker's credential dead on
every server."""

from __future__ import annotations

import json

import pytest

from tests.multinode.harness import Network
from tests.multinode.machines import cli_env, nodes, servers, token
from tests.multinode.worker import first_server_and_worker, removed_worker_is_dead
from tests.waiting import eventually_sync


@pytest.mark.chaos  # machines in namespaces, about 2 min: make chaos runs it
@pytest.mark.timeout(600)
def test_a_worker_joins_with_one_command_over_an_encrypted_mesh_and_leaves_no_credential(network: Network) -> None:
    m1, w1, common = first_server_and_worker(network)

    # A second server machine joins with one command: its NATS server routes to the cluster's, its node registers.
    m2 = network.add("m2")
    m2.start(
        "--join",
        token(m1, "--server", "--data-dir", str(m1.data_dir)),
        "--server",
        "--name",
        "m2",
        "--advertise",
        m2.address,
        *common,
    )
    eventually_sync(lambda: "m2" in nodes(m1), timeout=150, what="the second server machine registers its node")
    eventually_sync(lambda: servers(m1) == 4, timeout=60, what="m2's NATS server in the cluster (3 seats and m2's)")

    # A third server machine, then every stream to three copies, one per machine (the seats count as one).
    m3 = network.add("m3")
    m3.start(
        "--join",
        token(m1, "--server", "--data-dir", str(m1.data_dir)),
        "--server",
        "--name",
        "m3",
        "--advertise",
        m3.address,
        *common,
    )
    eventually_sync(lambda: "m3" in nodes(m1), timeout=150, what="the third server machine registers its node")
    eventually_sync(lambda: servers(m1) == 5, timeout=60, what="m3's NATS server in the cluster")
    five = m1.zattera("cluster", "replicas", "5", env=cli_env(m1))
    assert five.returncode == 1 and "fewer than 5 server machines" in five.stderr, five.stderr
    moved = m1.zattera("cluster", "replicas", "3", "--json", env=cli_env(m1))
    assert moved.returncode == 0, moved.stderr
    report = json.loads(moved.stdout)
    assert report["replicas"] == 3 and report["streams"], report
    for stream in report["streams"]:
        placed = {name.partition("-seat")[0] for name in stream["servers"]}
        assert stream["current"] == 3 and placed == {"m1", "m2", "m3"}, stream
    status = json.loads(m1.zattera("cluster", "status", "--json", env=cli_env(m1), check=True).stdout)
    assert status["config"]["replicas"] == 3 and not status["mismatches"], status

    seats = [f"tls://{m1.address}:{port}" for port in (4222, 4223, 4224)]
    removed_worker_is_dead(m1, w1, [*seats, f"tls://{m2.address}:4222"])
