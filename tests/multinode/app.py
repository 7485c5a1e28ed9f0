"""The app the machine scenarios run and how they look at it: examples/hello as ``demo/hello/production``, three
replicas, the client that sends requests one at a time through machines' proxies, and where replicas serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.multinode.harness import Machine
from tests.multinode.machines import cli_env, nodes
from tests.waiting import eventually_sync

ENV = "demo/hello/production"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello"

CLIENT = """
import http.client, json, os, sys, time
targets, stop, out = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
ok, failed, by_node, fails, i = 0, 0, {}, [], 0
while not os.path.exists(stop):
    host = targets[i % len(targets)]
    i += 1
    try:
        conn = http.client.HTTPConnection(host, 8080, timeout=5)
        conn.request("GET", "/", headers={"Host": "hello.localhost"})
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        if answer.status == 200:
            ok += 1
            node = host + "->" + json.loads(body)["node"]
            by_node[node] = by_node.get(node, 0) + 1
        else:
            failed += 1
            fails.append([time.time(), host, answer.status])
    except Exception as exc:
        failed += 1
        fails.append([time.time(), host, repr(exc)])
    time.sleep(0.02)
with open(out, "w") as f:
    json.dump({"ok": ok, "failed": failed, "nodes": by_node, "fails": fails[:100]}, f)
"""


def replicas(machine: Machine, env: str = ENV) -> list[dict[str, Any]]:
    done = machine.zattera("ps", "--env", env, "--json", env=cli_env(machine))
    return json.loads(done.stdout) if done.returncode == 0 else []


def serving_on(machine: Machine) -> dict[str, int]:
    """Healthy replicas meant to run, per node."""
    counts: dict[str, int] = {}
    for replica in replicas(machine):
        observed = replica.get("observed", {})  # a replica just placed has no report yet (no field in its JSON)
        if replica["desired"] == "ASSIGNMENT_DESIRED_RUN" and observed.get("state") == "INSTANCE_STATE_HEALTHY":
            counts[replica["node_id"]] = counts.get(replica["node_id"], 0) + 1
    return counts


ASK = """
import http.client, json, sys
seen = {}
for _ in range(int(sys.argv[2])):
    conn = http.client.HTTPConnection(sys.argv[1], 8080, timeout=5)
    conn.request("GET", "/", headers={"Host": "hello.localhost", "Connection": "close"})
    answer = conn.getresponse()
    node = json.loads(answer.read())["node"] if answer.status == 200 else str(answer.status)
    seen[node] = seen.get(node, 0) + 1
print(json.dumps(seen))
"""


def answered_by(client: Machine, proxy: Machine, requests: int = 30) -> dict[str, int]:
    """Which nodes' replicas answered ``requests`` requests sent through ``proxy``'s proxy."""
    done = client.exec("python3", "-c", ASK, proxy.address, str(requests), check=False)
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-300:]}


def node_status(machine: Machine, name: str) -> str:
    return str(nodes(machine).get(name, {}).get("status", ""))


def deploy_three_replicas(first: Machine, timeout: float = 180) -> None:
    """examples/hello applied, deployed and scaled to three replicas through ``first``; returns once all serve."""
    env = cli_env(first)
    for command in (("apps", "apply", str(EXAMPLE / "zattera.toml")), ("deploy", str(EXAMPLE), "--env", ENV)):
        done = first.zattera(*command, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    assert first.zattera("scale", "3", "--env", ENV, env=env).returncode == 0
    eventually_sync(lambda: sum(serving_on(first).values()) == 3, timeout=timeout, what="three replicas running")


DB_ENV = "demo/hello/db"
STATEFUL_ENV = """
[env.db]
stateful = true
placement_constraints = { role = "db" }
healthcheck = { type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }
[[env.db.volumes]]
volume_name = "data"
mount_path = "/data"
"""
"""A stateful env of the same app: one replica, pinned to its volume's node, placed on nodes labelled role=db."""


def deploy_stateful(first: Machine, on: Machine, workdir: Path) -> None:
    """``demo/hello/db`` (stateful, one volume) deployed with its replica on ``on`` (the one node labelled
    role=db at the time); returns once it serves."""
    env = cli_env(first)
    assert first.zattera("nodes", "label", on.name, "role=db", env=env).returncode == 0
    spec = workdir / "zattera-stateful.toml"
    spec.write_text((EXAMPLE / "zattera.toml").read_text() + STATEFUL_ENV)
    for command in (("apps", "apply", str(spec)), ("deploy", str(EXAMPLE), "--env", DB_ENV)):
        done = first.zattera(*command, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    eventually_sync(
        lambda: (
            [(r["node_id"], r.get("observed", {}).get("state")) for r in running(first, DB_ENV)]
            == [(on.name, "INSTANCE_STATE_HEALTHY")]
        ),
        timeout=180,
        what=f"the stateful replica serving on {on.name}",
    )


def running(machine: Machine, env: str) -> list[dict[str, Any]]:
    """The env's replicas meant to run."""
    return [r for r in replicas(machine, env) if r["desired"] == "ASSIGNMENT_DESIRED_RUN"]
