"""The apps' network fence without installing it: the chain's rules per address family, the
iptables-restore text, NATS URLs to addresses, and what the node's isolation says when it is missing."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from cli.nodes_cmds import isolation_text
from services.agent.firewall import (
    Blocked,
    bridge_jumps,
    chain_name,
    jump,
    nats_addresses,
    restore_text,
    rules,
    stale,
)
from services.agent.sandbox import CONTAINER, SANDBOX, Isolation

CHAIN = "ZATTERA-APPS-0123456789"
RESET = ["-j", "REJECT", "--reject-with", "tcp-reset"]


def test_ipv4_rules_let_replies_and_the_private_network_through_then_reset_fenced_ports() -> None:
    blocked = Blocked(frozenset({4222, 8090}), frozenset({("10.0.0.7", 4222), ("fd00::7", 4222)}))
    assert rules(CHAIN, blocked, v6=False) == [
        [CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"],
        [CHAIN, "-d", "127.128.0.0/9", "-j", "RETURN"],
        [CHAIN, "-p", "tcp", "-m", "addrtype", "--dst-type", "LOCAL", "--dport", "4222", *RESET],
        [CHAIN, "-p", "tcp", "-m", "addrtype", "--dst-type", "LOCAL", "--dport", "8090", *RESET],
        [CHAIN, "-p", "tcp", "-d", "10.0.0.7", "--dport", "4222", *RESET],
    ]


def test_ipv6_rules_have_no_private_network_and_only_ipv6_remote_servers() -> None:
    blocked = Blocked(frozenset({4222}), frozenset({("10.0.0.7", 4222), ("fd00::7", 6222)}))
    assert rules(CHAIN, blocked, v6=True) == [
        [CHAIN, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"],
        [CHAIN, "-p", "tcp", "-m", "addrtype", "--dst-type", "LOCAL", "--dport", "4222", *RESET],
        [CHAIN, "-p", "tcp", "-d", "fd00::7", "--dport", "6222", *RESET],
    ]


def test_the_chain_is_replaced_whole_in_one_transaction() -> None:
    text = restore_text(CHAIN, Blocked(frozenset({4222})), v6=False)
    lines = text.splitlines()
    assert lines[0] == "*filter" and lines[1] == f":{CHAIN} - [0:0]" and lines[-1] == "COMMIT"
    assert f"-A {CHAIN} -p tcp -m addrtype --dst-type LOCAL --dport 4222 -j REJECT --reject-with tcp-reset" in lines
    assert not any(line.startswith(("-F", "-X", ":OUTPUT", ":INPUT")) for line in lines)  # nothing else touched


def test_each_agent_has_its_own_chain_within_iptables_name_limit() -> None:
    a, b = chain_name("/tmp/a/agent"), chain_name("/tmp/b/agent")
    assert a != b and a == chain_name("/tmp/a/agent") and len(a) <= 28 and a.startswith("ZATTERA-APPS-")
    assert jump(a, 0x70000000, 0x7000FFFF, 42) == [
        "OUTPUT",
        *("-m", "owner", "--uid-owner", "1879048192-1879113727"),
        *("-m", "comment", "--comment", "zattera-agent-pid=42", "-j", a),
    ]


def test_the_chains_of_agents_that_are_gone_are_found_for_removal() -> None:
    mark = "-m owner --uid-owner 1-9 -m comment --comment"
    saved = "\n".join(
        [
            "*filter",
            ":ZATTERA-APPS-aaaaaaaaaa - [0:0]",
            f'-A OUTPUT {mark} "zattera-agent-pid=100" -j ZATTERA-APPS-aaaaaaaaaa',
            f'-A OUTPUT {mark} "zattera-agent-pid=200" -j ZATTERA-APPS-bbbbbbbbbb',
            '-A OUTPUT -m comment --comment "zattera-agent-pid=300" -j SOMEONE-ELSES',
            "-A OUTPUT -j ZATTERA-APPS-cccccccccc",  # no owner named: left alone
            "-A ZATTERA-APPS-aaaaaaaaaa -p tcp -j REJECT",
            "COMMIT",
        ]
    )
    assert stale(saved, lambda pid: pid == 200) == [
        (
            "ZATTERA-APPS-aaaaaaaaaa",
            ["OUTPUT", *mark.split(), "zattera-agent-pid=100", "-j", "ZATTERA-APPS-aaaaaaaaaa"],
        )
    ]


def test_nats_urls_become_addresses_and_ports() -> None:
    found = nats_addresses(["nats://127.0.0.1:4333", "tls://[::1]:7422", "127.0.0.2", "nats://no-such-host.invalid:1"])
    assert found == {("127.0.0.1", 4333), ("::1", 7422), ("127.0.0.2", 4222)}


def test_a_sandboxed_node_without_its_fence_says_so_on_the_terminal_and_in_nodes_list() -> None:
    assert Isolation(SANDBOX).describe().endswith("fenced from the control plane's ports)")
    unfenced = Isolation(SANDBOX, "iptables is not installed (Debian: apt-get install iptables)")
    assert "NOT fenced from the control plane's ports: iptables is not installed" in unfenced.describe()
    node = pb.Node(isolation="sandbox", isolation_problem="iptables is not installed")
    assert isolation_text(node) == "sandbox, network not fenced (iptables is not installed)"
    assert isolation_text(pb.Node(isolation="sandbox")) == "sandbox"


def test_a_docker_node_without_its_fence_says_so_too() -> None:
    assert (
        Isolation(CONTAINER)
        .describe()
        .endswith("a user per environment, no capabilities, fenced from the control plane's ports)")
    )
    unfenced = Isolation(CONTAINER, "the agent does not run as root (firewall rules need root)")
    assert "NOT fenced from the control plane's ports: the agent does not run as root" in unfenced.describe()
    node = pb.Node(isolation="container", isolation_problem="iptables is not installed")
    assert isolation_text(node) == "container, network not fenced (iptables is not installed)"
    assert isolation_text(pb.Node(isolation="container")) == "container"


def test_a_bridge_is_fenced_where_its_packets_enter_and_a_dead_agents_bridge_jumps_are_stale() -> None:
    """Bridged containers' packets reach the node through INPUT (its addresses) and FORWARD (elsewhere)."""
    mark = ["-m", "comment", "--comment", "zattera-agent-pid=100", "-j", CHAIN]
    assert bridge_jumps(CHAIN, ["br-2", "br-1"], 100) == [
        ["INPUT", "-i", "br-1", *mark],
        ["FORWARD", "-i", "br-1", *mark],
        ["INPUT", "-i", "br-2", *mark],
        ["FORWARD", "-i", "br-2", *mark],
    ]
    saved = "\n".join(["-A " + " ".join(rule) for rule in bridge_jumps(CHAIN, ["br-1"], 100)])
    assert stale(saved, lambda pid: False) == [(CHAIN, rule) for rule in bridge_jumps(CHAIN, ["br-1"], 100)]
    assert stale(saved, lambda pid: True) == []
