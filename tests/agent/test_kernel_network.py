"""The private network's kernel path (``services/agent/kernelnet.py``) with real iptables, inside network
namespaces this test creates (root only; nothing outside them is touched): a consumer reaches its target
through a DNAT rule, the rule follows a red/green endpoint change (an open connection drains on the old
replica), an endpoint on another namespace is reached over its mesh address (route_localnet, masquerade),
the rules of a stopped agent are removed, another project's env gets neither address nor rule, and without
iptables the user-space forwarder carries the traffic. Plus the rules and conntrack parsing as tables.

~3 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.agent.firewall import OWNER_MARK, stale
from services.agent.kernelnet import (
    CHAIN_PREFIX,
    GUARD_PREFIX,
    POST_PREFIX,
    Dnat,
    chains,
    dnats,
    old_connections,
    remote,
    restore_text,
    sub_chains,
)

ROOT = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(
    (os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None)
    and os.environ.get("CI") != "true",
    reason="needs root, iproute2 and iptables for network namespaces",
)

ECHO_B = """
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


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"zt-k-{os.getpid() % 100_000}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def scenario(ns: str, *args: str, path: str | None = None) -> dict[str, object]:
    env = {**os.environ, "PATH": path} if path is not None else None
    done = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.agent.kernelnet_scenarios", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _no_chains(saved: object) -> bool:
    assert isinstance(saved, str)
    return not any(prefix in saved for prefix in (CHAIN_PREFIX, POST_PREFIX, GUARD_PREFIX))


@needs_root
def test_a_consumer_reaches_its_target_through_the_rule_and_another_project_cannot(netns: str) -> None:
    result = scenario(netns, "reach")
    assert result["path"] == "kernel (iptables DNAT)"
    assert result["host"] == "127.129.0.5"
    assert result["answer"] == "db:hi"
    assert result["translated"] == [result["endpoint"]]  # the kernel translated it: no user-space hop
    rules = result["rules"]
    assert isinstance(rules, str)
    assert f"-d 127.129.0.5/32 -p tcp -m tcp --dport 5432 -j DNAT --to-destination {result['endpoint']}" in rules
    assert "127.130.0.5" not in rules  # the other project's env: no rule for its address of the target
    assert result["other_env"] == []  # ...and no variables
    assert result["other"] == "ConnectionRefusedError"  # ...and no listener
    assert _no_chains(result["after_stop"])  # a stopped forwarder leaves no rule


@needs_root
def test_the_apps_fence_still_holds_on_the_kernel_path(netns: str) -> None:
    result = scenario(netns, "fenced")
    assert result["path"] == "kernel (iptables DNAT)"
    assert result["installed"] is True, result["problem"]
    assert result["before"] == ["db:x", "ConnectionRefusedError"]  # the target through the rule; the fenced port reset
    assert result["through"] == ["ConnectionRefusedError"]  # a rule pointed at a fenced port: reset all the same
    assert result["outside"] == ["control:x"]  # a user outside the apps' range is not fenced
    assert _no_chains(result["after_stop"])


@needs_root
def test_the_rule_follows_a_red_green_change_and_open_connections_drain(netns: str) -> None:
    result = scenario(netns, "red_green")
    assert result["path"] == "kernel (iptables DNAT)"
    assert result["before"] == "red:a"
    assert result["after"] == "green:hi"  # a new connection follows the new endpoint
    assert result["same_host"] is True  # the consumer's address did not change
    assert result["held_after"] == "red:b"  # the open one stays on its replica...
    assert result["old"] == {"db-env": 1}  # ...and is reported for the drain
    rules = result["rules_without_endpoint"]
    assert isinstance(rules, str) and "-j DNAT" not in rules
    assert result["no_endpoint"] in ("", "ConnectionResetError")  # the user-space listener closes it
    assert _no_chains(result["after_stop"])


@needs_root
def test_an_endpoint_in_another_namespace_is_reached_over_the_mesh_address() -> None:
    tag = f"{os.getpid() % 100_000}"
    node_a, node_b = f"zt-ka-{tag}", f"zt-kb-{tag}"
    veth_a, veth_b = f"zka{tag}", f"zkb{tag}"
    mesh_a, mesh_b = "10.232.0.1", "10.232.0.2"
    _ip("netns", "add", node_a)
    try:
        _ip("netns", "add", node_b)
        _ip("link", "add", veth_a, "netns", node_a, "type", "veth", "peer", "name", veth_b, "netns", node_b)
        for ns, dev, address in ((node_a, veth_a, mesh_a), (node_b, veth_b, mesh_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        echo = subprocess.Popen(
            ["ip", "netns", "exec", node_b, sys.executable, "-c", ECHO_B, mesh_b, "7000"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
            result = scenario(node_a, "remote", f"{mesh_b}:7000", veth_a)
        finally:
            echo.kill()
            echo.wait()
        assert result["path"] == "kernel (iptables DNAT)"
        assert result["answer"] == "node-b:hi"
        assert result["route_localnet"] == "1"
        assert _no_chains(result["after_stop"])
        restored = subprocess.run(
            ["ip", "netns", "exec", node_a, "cat", f"/proc/sys/net/ipv4/conf/{veth_a}/route_localnet"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert restored.stdout.strip() == "0"  # given back when the agent stopped
    finally:
        for ns in (node_a, node_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_root
def test_the_chains_of_a_stopped_agent_are_removed_by_the_next(netns: str) -> None:
    result = scenario(netns, "stale")
    before, during = result["before"], result["during"]
    assert isinstance(before, str) and isinstance(during, str)
    assert f"{OWNER_MARK}{2**22 + 7}" in before
    assert f"{OWNER_MARK}{2**22 + 7}" not in during  # the gone agent's jumps went
    assert f"{OWNER_MARK}{result['pid']}" in during
    assert during.count(f"-j {CHAIN_PREFIX}") == 1
    consumer = f"{chains('/var/lib/zattera-test-agent').nat}-129"
    assert f":{consumer} " in before and consumer not in during  # the gone agent's consumer chain went too
    second = f"{chains('/var/lib/zattera-test-agent').nat}-130"
    assert f"-j {second}" in str(result["consumer"]) and second not in str(result["left"])
    assert _no_chains(result["after"])


@needs_root
def test_without_iptables_the_user_space_forwarder_carries_the_traffic(netns: str) -> None:
    result = scenario(netns, "fallback", path="/usr/bin:/bin")
    path = result["path"]
    assert isinstance(path, str) and path.startswith("user-space forwarder (iptables is not installed")
    assert result["answer"] == "db:hi"
    assert result["translated"] == []  # the forwarder's own connection: not translated
    assert _no_chains(result["rules"])


# ---------------------------------------------------------------------------------------------- pure tables


def test_rules_per_pair_with_endpoints_only() -> None:
    routes = {
        ("127.129.0.5", 5432): ("db-env", "db"),
        ("127.130.0.5", 5432): ("db-env", "db"),
        ("127.129.0.9", 80): ("cold-env", "http"),
    }
    endpoints = {("db-env", "db"): ["10.98.0.2:31000", "127.0.0.1:31001"], ("cold-env", "http"): []}
    found = dnats(routes, endpoints)
    assert found == [
        Dnat("127.129.0.5", 5432, ("10.98.0.2:31000", "127.0.0.1:31001")),
        Dnat("127.130.0.5", 5432, ("10.98.0.2:31000", "127.0.0.1:31001")),
    ]
    assert remote(found) == {"10.98.0.2"}
    names = chains("/var/lib/zattera/agent")
    text = restore_text(names, found[:1])
    lines = text.splitlines()
    consumer = f"{names.nat}-129"  # the first consumer's pairs (slot 1: 127.129.x.y)
    assert len(consumer) <= 28  # iptables' chain name limit
    assert lines[:4] == ["*nat", f":{names.nat} - [0:0]", f":{names.post} - [0:0]", f":{consumer} - [0:0]"]
    assert lines[4] == f"-A {names.nat} -d 127.129.0.0/16 -j {consumer}"
    match = f"-A {consumer} -d 127.129.0.5/32 -p tcp -m tcp --dport 5432"
    pick = "-m statistic --mode random --probability 0.5000000000"
    assert lines[5] == f"{match} {pick} -j DNAT --to-destination 10.98.0.2:31000"
    assert lines[6] == f"{match} -j DNAT --to-destination 127.0.0.1:31001"
    assert "-j MASQUERADE" in lines[7] and "--ctorigdst 127.128.0.0/9" in lines[7]
    assert f"-A {names.guard} ! -i lo -d 127.0.0.0/8 -j DROP" in lines
    assert text.count("COMMIT") == 2


def test_a_new_connection_is_matched_against_the_consumers_then_its_own_pairs_only() -> None:
    names = chains("/var/lib/zattera/agent")
    rules = [Dnat(f"127.{128 + c}.0.{t}", 5432, ("127.0.0.1:31000",)) for c in (1, 2, 3) for t in (5, 6)]
    lines = restore_text(names, rules, flush=[131, 140]).splitlines()
    jumps = [line for line in lines if line.startswith(f"-A {names.nat} ")]
    assert jumps == [f"-A {names.nat} -d 127.{o}.0.0/16 -j {names.nat}-{o}" for o in (129, 130, 131)]
    assert [line for line in lines if line.startswith(f"-A {names.nat}-130 ")] == [
        f"-A {names.nat}-130 -d 127.130.0.{t}/32 -p tcp -m tcp --dport 5432 -j DNAT --to-destination 127.0.0.1:31000"
        for t in (5, 6)
    ]
    assert f":{names.nat}-140 - [0:0]" in lines  # a consumer gone: its chain emptied (then deleted)
    assert not any(line.startswith(f"-A {names.nat}-140") or line.endswith(f"-j {names.nat}-140") for line in lines)
    saved = "\n".join([*lines, f":{names.nat}-x - [0:0]", f":{names.post} - [0:0]"])
    assert sub_chains(saved, names.nat) == [f"{names.nat}-{o}" for o in (129, 130, 131, 140)]


def test_a_malformed_endpoint_leaves_the_pair_to_the_forwarder() -> None:
    routes = {("127.129.0.5", 5432): ("db-env", "db")}
    assert dnats(routes, {("db-env", "db"): ["db.example:5432"]}) == []
    assert dnats(routes, {("db-env", "db"): ["[::1]:5432"]}) == []


def test_old_connections_from_conntrack() -> None:
    routes = {("127.129.0.5", 5432): ("db-env", "db")}
    endpoints = {("db-env", "db"): ["127.0.0.1:31002"]}
    conntrack = "\n".join(
        [
            # translated to the old replica: counted
            "ipv4     2 tcp      6 431999 ESTABLISHED src=127.0.0.1 dst=127.129.0.5 sport=40000 dport=5432 "
            "src=127.0.0.1 dst=127.0.0.1 sport=31001 dport=40000 [ASSURED] mark=0 zone=0 use=2",
            # to the current one: not counted
            "ipv4     2 tcp      6 431999 ESTABLISHED src=127.0.0.1 dst=127.129.0.5 sport=40001 dport=5432 "
            "src=127.0.0.1 dst=127.0.0.1 sport=31002 dport=40001 [ASSURED] mark=0 zone=0 use=2",
            # not translated (the user-space listener holds it): the forwarder counts its own
            "ipv4     2 tcp      6 431999 ESTABLISHED src=127.0.0.1 dst=127.129.0.5 sport=40002 dport=5432 "
            "src=127.129.0.5 dst=127.0.0.1 sport=5432 dport=40002 [ASSURED] mark=0 zone=0 use=2",
            # closing: not counted
            "ipv4     2 tcp      6 100 TIME_WAIT src=127.0.0.1 dst=127.129.0.5 sport=40003 dport=5432 "
            "src=127.0.0.1 dst=127.0.0.1 sport=31001 dport=40003 [ASSURED] mark=0 zone=0 use=2",
        ]
    )
    assert old_connections(conntrack, routes, endpoints) == {"db-env": 1}


def test_stale_finds_the_kernel_paths_jumps_of_a_gone_agent() -> None:
    names = chains("/var/lib/zattera/agent")
    saved = "\n".join(
        [
            f'-A OUTPUT -d 127.128.0.0/9 -m comment --comment "{OWNER_MARK}41" -j {names.nat}',
            f'-A POSTROUTING -m comment --comment "{OWNER_MARK}41" -j {names.post}',
            f'-A OUTPUT -d 127.128.0.0/9 -m comment --comment "{OWNER_MARK}42" -j {names.nat}',
        ]
    )
    found = stale(saved, lambda pid: pid == 42, prefixes=(CHAIN_PREFIX, POST_PREFIX, GUARD_PREFIX))
    assert [chain for chain, _ in found] == [names.nat, names.post]
    assert stale(saved, lambda pid: False) == []  # the fence's own prefix does not match them
