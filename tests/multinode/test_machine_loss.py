"""A server machine lost at once, and back: three server machines (``--secure --tls``, every stream at three
copies), an app spread over them and a client sending requests through the other machines' proxies. The lost
machine's processes are all SIGKILLed and its link cut: the control plane keeps writing, its replicas are
placed on the others and serve, the client sees only requests caught in flight fail; the machine comes back
(its ``zattera up`` started again, as a reboot would) and rejoins with no operator action. Then a partition:
one server machine cut off for 60 s, the majority side writing, the isolated side committing nothing, the
stateful env's single replica on the isolated machine never started a second time meanwhile, and the cluster
converged once it heals."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.multinode.app import (
    CLIENT,
    DB_ENV,
    ENV,
    answered_by,
    deploy_stateful,
    deploy_three_replicas,
    node_status,
    replicas,
    running,
    serving_on,
)
from tests.multinode.harness import Network
from tests.multinode.machines import COMMON, cli_env, nodes, servers, three_servers
from tests.waiting import eventually_sync


@pytest.mark.chaos  # three machines in namespaces, minutes: make chaos runs it
@pytest.mark.timeout(900)
def test_a_server_machine_lost_and_back(network: Network) -> None:
    m1, m2, m3 = three_servers(network)
    env = cli_env(m1)
    deploy_three_replicas(m1)
    spread = serving_on(m1)
    assert "m2" in spread and len(spread) >= 2, f"replicas not spread over the machines: {spread}"
    # Every machine's proxy reaches the replicas on every machine (over the mesh).
    for proxy in (m1, m2, m3):
        answers: dict[str, int] = {}
        deadline = time.monotonic() + 60
        while set(answers) != set(spread) and time.monotonic() < deadline:
            answers = answered_by(m1, proxy)
        assert set(answers) == set(spread), f"{proxy.name}'s proxy: {answers}, replicas on {spread}"

    stop, out = network.base / "client.stop", network.base / "client.json"
    client = subprocess.Popen(
        ["ip", "netns", "exec", m1.netns, "python3", "-c", CLIENT, f"{m1.address},{m3.address}", str(stop), str(out)]
    )
    try:
        time.sleep(5)  # steady traffic before the loss (the client's own pace, not a timer of the product)
        lost_at = time.monotonic()
        m2.kill_all()
        m2.link(False)
        # The control plane keeps writing: the survivors mark the lost node down and place its replicas elsewhere.
        eventually_sync(lambda: node_status(m1, "m2") == "NODE_STATUS_DOWN", timeout=120, what="m2 down")
        down_after = time.monotonic() - lost_at
        eventually_sync(
            lambda: sum(n for node, n in serving_on(m1).items() if node != "m2") == 3,
            timeout=180,
            what="the lost replicas running on the other machines",
        )
        replaced_after = time.monotonic() - lost_at
        assert m1.zattera("scale", "3", "--env", ENV, env=env).returncode == 0, "an operator write after the loss"
    finally:
        stop.touch()
        client.wait(60)
    seen = json.loads(out.read_text())
    print(f"machine loss: down after {down_after:.1f} s, replaced after {replaced_after:.1f} s, client {seen}")
    assert seen["ok"] > 100, seen
    assert {n.partition("->")[2] for n in seen["nodes"]} >= {"m1", "m3"}, seen
    # Only requests caught in flight to the lost machine may fail: a new connection to it (no refusal comes
    # from a machine that is gone) times out after the proxies' connect timeout and is sent to another
    # replica. The client sends one request at a time, so one may be in flight when the machine goes.
    assert seen["failed"] <= 1, seen

    # The machine comes back (a reboot: its zattera up starts again with its data dir) and rejoins by itself.
    m2.link(True)
    m2.start("--secure", "--tls", *COMMON)
    eventually_sync(lambda: node_status(m1, "m2") == "NODE_STATUS_ALIVE", timeout=180, what="m2 back")
    eventually_sync(lambda: servers(m1) == 5, timeout=120, what="m2's NATS server back in the cluster")

    # A stateful env whose single replica runs on m3, the machine about to be cut off; m2 is labelled to take it
    # too, so only the volume's pin keeps it from being started a second time while the first may still run.
    deploy_stateful(m1, m3, network.base)
    assert m1.zattera("nodes", "label", "m2", "role=db", env=env).returncode == 0

    # A partition: m3 cut off for 60 s. The majority side writes; the isolated side commits nothing.
    m3.link(False)
    cut_at = time.monotonic()
    majority = m1.zattera("nodes", "label", "m1", "partition=majority", env=env)
    assert majority.returncode == 0, majority.stderr
    isolated = m3.zattera("nodes", "label", "m3", "partition=isolated", env=cli_env(m3))
    assert isolated.returncode != 0, "a write on the isolated side was acknowledged"
    eventually_sync(lambda: node_status(m1, "m3") == "NODE_STATUS_DOWN", timeout=120, what="m3 down")
    cut_down = time.monotonic() - cut_at
    eventually_sync(
        lambda: sum(n for node, n in serving_on(m1).items() if node != "m3") == 3,
        timeout=180,
        what="m3's replicas running on the majority side",
    )
    cut_replaced = time.monotonic() - cut_at
    while time.monotonic() - cut_at < 60:  # the partition lasts 60 s (the scenario's length)
        elsewhere = [r["node_id"] for r in running(m1, DB_ENV) if r["node_id"] != "m3"]
        assert not elsewhere, f"the stateful replica started again on {elsewhere} while m3's may still run"
        time.sleep(2)
    m3.link(True)
    eventually_sync(lambda: node_status(m1, "m3") == "NODE_STATUS_ALIVE", timeout=180, what="m3 back")
    # Converged: three replicas meant to run, each healthy, none twice; what was acknowledged is kept and the
    # isolated side's write is nowhere.
    eventually_sync(
        lambda: (
            sum(serving_on(m1).values()) == 3
            and sum(r["desired"] == "ASSIGNMENT_DESIRED_RUN" for r in replicas(m1)) == 3
        ),
        timeout=180,
        what="three replicas after the partition healed",
    )
    eventually_sync(
        lambda: (
            [(r["node_id"], r.get("observed", {}).get("state")) for r in running(m1, DB_ENV)]
            == [("m3", "INSTANCE_STATE_HEALTHY")]
        ),
        timeout=180,
        what="the stateful replica serving on m3 again, once",
    )
    healed = time.monotonic() - cut_at - 60
    print(f"partition: m3 down after {cut_down:.1f} s, replaced after {cut_replaced:.1f} s, healed in {healed:.1f} s")
    labels = {name: node.get("labels", {}) for name, node in nodes(m1).items()}
    assert labels["m1"].get("partition") == "majority", labels
    assert "partition" not in labels["m3"], labels
