"""Node loss end to end: a machine dies (its agent and its app processes SIGKILLed); once the liveness
timeout passes the node is DOWN, its replicas are replaced on the surviving node, and traffic flows again.

Short liveness windows come from the harness (``ZATTERA_NODE_HEARTBEAT_DEADLINE=4``,
``ZATTERA_LIVENESS_GRACE=2``, agents heartbeating every 0.5 s). This module has a cluster of its own.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
from zattera.v1 import types_pb2 as pb

from tests.e2e.cluster import EXAMPLE, E2ECluster, Load, healthy, running
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HOST = "hello.localhost"


async def test_replicas_of_a_lost_node_are_replaced_on_the_other(cluster: E2ECluster) -> None:
    await cluster.acli("apps", "apply", str(EXAMPLE / "zattera.toml"))
    await cluster.acli("deploy", str(EXAMPLE), "--env", "demo/hello/production")
    async with cluster.state() as (_, view):
        env = next(e for e in view.envs() if e.name == "production")
        env_id = env.meta.id
        await eventually(lambda: len(healthy(view, env_id)) == 2, 60, "two healthy replicas")
        per_node = Counter(a.node_id for a in healthy(view, env_id))
        # The proxy runs on n1 and prefers its own node's endpoints on a tie: lose the node that takes traffic.
        victim = "n1" if per_node["n1"] else "n2"
        survivor = "n1" if victim == "n2" else "n2"
        lost = {a.meta.id for a in healthy(view, env_id) if a.node_id == victim}
        assert lost, per_node

        load = Load(cluster.proxy_port, HOST, rate=40).start()
        try:
            await eventually(lambda: load.ok >= 20, 30, "load is flowing")
            # The machine dies: the agent and every app process it ran, at once, without a goodbye.
            pids = cluster.instance_pids(victim)
            cluster.kill(f"agent-{victim}", signal.SIGKILL)
            for pid in pids:
                with_suppressed_kill(pid)

            await eventually(
                lambda: (n := view.node(victim)) is not None and n.status == pb.NODE_STATUS_DOWN,
                60,
                f"{victim} marked DOWN after missing heartbeats",
            )
            await eventually(
                lambda: len([a for a in healthy(view, env_id) if a.node_id == survivor]) == 2,
                60,
                f"the lost replicas replaced on {survivor}",
            )
            assert not any(a.meta.id in lost for a in running(view, env_id) if a.node_id == survivor)
            served = load.ok
            await eventually(lambda: load.ok >= served + 40, 30, "traffic flows on the survivor")
        finally:
            await load.stop()
    status, body = await cluster.get(HOST)
    assert status == 200, body
    # A refused connection is retried on the surviving endpoint by the proxy, so only a request caught in
    # flight inside a dying process may fail: at most a handful, never the seconds until the node is DOWN.
    assert len(load.failures) <= 3, load.summary()


def with_suppressed_kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
