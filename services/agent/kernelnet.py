"""The private network's kernel path (docs/networking.md, "Kernel path"): iptables DNAT per (consumer, target)
pair instead of copying bytes in the agent.

For each consumer address and port the forwarder would listen on (:func:`services.agent.network.listeners`)
whose target has healthy endpoints, the agent's own nat chain holds a DNAT rule to those endpoints
(``-d 127.(128+c).a.b -p tcp --dport P -j DNAT --to-destination ENDPOINT``; several endpoints are picked at
random per new connection with ``-m statistic``, as kube-proxy does). A connection is then translated once,
by the kernel, on its first packet; its later packets never reach user space. The rules are in two levels:
the agent's chain jumps by consumer (``-d 127.(128+c).0.0/16 -j ZATTERA-NET-<id>-<128+c>``) to a chain holding
that consumer's pairs, so a new connection is matched against the node's consumers plus its own pairs, not
every pair of the node (1,000 pairs in one chain cost a new connection ~22 µs of CPU, benchmarks/
network_bench.py):

* ``OUTPUT -d 127.128.0.0/9 -j ZATTERA-NET-<id>`` (nat): the apps share the node's network namespace (the
  process runtime, a docker node's host-network containers), so their connections pass OUTPUT;
* an endpoint on another node (``<mesh_ip>:<port>``): a connection to a 127/8 address has the source
  127.0.0.1, which may not leave ``lo``: ``route_localnet`` is set on the interface the endpoint is reached
  through and ``POSTROUTING … -j ZATTERA-NETP-<id>`` masquerades such connections to that interface's address;
  a raw-table guard drops packets for 127/8 arriving on any interface but ``lo`` (what ``route_localnet``
  would otherwise let in, CVE-2020-8558);
* a pair with no healthy endpoint has no rule: the connection reaches the user-space forwarder's listener on
  the same address, which holds it while a scale-to-zero env wakes (or closes it), as before. The user-space
  forwarder stays the whole path when iptables is missing or the agent is not root.

The chains are rewritten whole in one ``iptables-restore --noflush`` transaction per table on every change
(an endpoint change re-points every rule of its pairs at once; established connections keep their
translation: they drain on the old replica). The jumps name the agent's pid; an agent starting removes the
chains of agents that are gone (as :mod:`services.agent.firewall` does for its chain), one stopping removes
its own. Rules are pure data (:func:`restore_text`), tested as a table.

Why ``iptables-restore`` rather than python-iptables or pyroute2: the agent's fence already writes its chain
that way (one program, one transaction per table, no moment without rules); python-iptables drives libiptc,
which cannot edit the nf_tables backend Debian's iptables uses, and pyroute2 does not write netfilter rules.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.agent.firewall import COMMAND_TIMEOUT, OWNER_MARK, PRIVATE_NETWORK, drop_chain, stale
from shared.errors import ZatteraError

log = logging.getLogger(__name__)

CHAIN_PREFIX = "ZATTERA-NET-"
POST_PREFIX = "ZATTERA-NETP-"
GUARD_PREFIX = "ZATTERA-NETG-"
LOOPBACK = "127.0.0.0/8"
CONNTRACK = Path("/proc/net/nf_conntrack")


class KernelPathError(ZatteraError):
    """An iptables command failed; the user-space forwarder carries the traffic."""


@dataclass(frozen=True, order=True)
class Dnat:
    """One consumer address and port → the target's endpoints (``host:port``)."""

    address: str
    port: int
    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class Chains:
    nat: str
    post: str
    guard: str


def chains(key: str) -> Chains:
    """The chains of one agent (its data directory): agents of several clusters on one machine keep theirs."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Chains(CHAIN_PREFIX + digest, POST_PREFIX + digest, GUARD_PREFIX + digest)


def dnats(
    routes: Mapping[tuple[str, int], tuple[str, str]], endpoints: Mapping[tuple[str, str], Sequence[str]]
) -> list[Dnat]:
    """The rules wanted: each listened (address, port) whose target port has endpoints (the others are the
    user-space forwarder's: it holds or refuses them)."""
    found = []
    for (address, port), route in routes.items():
        addrs = tuple(sorted(set(endpoints.get(route, ()))))
        if addrs and all(_endpoint(a) is not None for a in addrs):
            found.append(Dnat(address, port, addrs))
    return sorted(found)


def _endpoint(addr: str) -> tuple[str, int] | None:
    host, _, port = addr.rpartition(":")
    try:
        if ipaddress.ip_address(host).version != 4 or not 0 < int(port) < 65536:
            return None
    except ValueError:
        return None
    return host, int(port)


def remote(rules: Iterable[Dnat]) -> set[str]:
    """The endpoint addresses outside 127/8 (reached over the mesh: masqueraded, need ``route_localnet``)."""
    loopback = ipaddress.ip_network(LOOPBACK)
    return {
        host
        for rule in rules
        for addr in rule.endpoints
        if (found := _endpoint(addr)) and ipaddress.ip_address(host := found[0]) not in loopback
    }


def consumer_chain(names: Chains, octet: int) -> str:
    """The chain of one consumer's pairs (``octet``: the second octet of its addresses, 128 + its slot)."""
    return f"{names.nat}-{octet}"


def consumer_octets(rules: Iterable[Dnat]) -> set[int]:
    return {int(rule.address.split(".")[1]) for rule in rules}


def restore_text(names: Chains, rules: Iterable[Dnat], flush: Iterable[int] = ()) -> str:
    """``iptables-restore --noflush`` input replacing the chains' rules (one transaction per table); ``flush``:
    consumers' chains to empty besides (consumers no longer there, their chains deleted afterwards)."""
    by_octet: dict[int, list[Dnat]] = {}
    for rule in rules:
        by_octet.setdefault(int(rule.address.split(".")[1]), []).append(rule)
    octets = sorted(by_octet.keys() | set(flush))
    nat = ["*nat", f":{names.nat} - [0:0]", f":{names.post} - [0:0]"]
    nat += [f":{consumer_chain(names, octet)} - [0:0]" for octet in octets]
    nat += [f"-A {names.nat} -d 127.{octet}.0.0/16 -j {consumer_chain(names, octet)}" for octet in sorted(by_octet)]
    for octet, pairs in sorted(by_octet.items()):
        for rule in pairs:
            match = f"-A {consumer_chain(names, octet)} -d {rule.address}/32 -p tcp -m tcp --dport {rule.port}"
            count = len(rule.endpoints)
            for i, endpoint in enumerate(rule.endpoints):
                pick = "" if i == count - 1 else f" -m statistic --mode random --probability {1 / (count - i):.10f}"
                nat.append(f"{match}{pick} -j DNAT --to-destination {endpoint}")
    # Translated from a consumer address to an endpoint off this machine's loopback: leave with the source
    # of the outgoing interface (127.0.0.1 may not leave lo).
    nat.append(
        f"-A {names.post} -s {LOOPBACK} ! -d {LOOPBACK} ! -o lo"
        f" -m conntrack --ctstate DNAT --ctorigdst {PRIVATE_NETWORK} -j MASQUERADE"
    )
    nat.append("COMMIT")
    raw = ["*raw", f":{names.guard} - [0:0]", f"-A {names.guard} ! -i lo -d {LOOPBACK} -j DROP", "COMMIT"]
    return "\n".join(nat + raw) + "\n"


def jumps(names: Chains, pid: int) -> list[tuple[str, list[str]]]:
    """(table, rule) of the jumps into the chains, naming the agent's pid."""
    mark = ["-m", "comment", "--comment", f"{OWNER_MARK}{pid}"]
    return [
        ("nat", ["OUTPUT", "-d", PRIVATE_NETWORK, *mark, "-j", names.nat]),
        ("nat", ["POSTROUTING", *mark, "-j", names.post]),
        ("raw", ["PREROUTING", *mark, "-j", names.guard]),
    ]


Routes = Mapping[tuple[str, int], tuple[str, str]]
"""(consumer address, port) → (target env id, port name), as :func:`services.agent.network.listeners`."""
Endpoints = Mapping[tuple[str, str], Sequence[str]]
"""(env id, port name) → its endpoints ``host:port``."""


def old_connections(conntrack: str, routes: Routes, endpoints: Endpoints) -> dict[str, int]:
    """Env id → established connections translated to an endpoint its port no longer lists (``/proc/net/
    nf_conntrack`` text): what the orchestrator's drain waits for, as the forwarder's own count."""
    old: dict[str, int] = {}
    for line in conntrack.splitlines():
        words = line.split()
        if "tcp" not in words or "ESTABLISHED" not in words:
            continue
        fields = [w.split("=", 1) for w in words if "=" in w]
        src = [v for k, v in fields if k == "src"]
        dst = [v for k, v in fields if k == "dst"]
        sport = [v for k, v in fields if k == "sport"]
        dport = [v for k, v in fields if k == "dport"]
        if len(src) < 2 or len(dst) < 1 or len(sport) < 2 or len(dport) < 1 or not dport[0].isdigit():
            continue
        route = routes.get((dst[0], int(dport[0])))
        reached = f"{src[1]}:{sport[1]}"  # the reply's source: where the connection was translated to
        if route is None or reached == f"{dst[0]}:{dport[0]}":
            continue  # not a consumer address, or not translated (the user-space forwarder's listener counts it)
        if reached not in endpoints.get(route, ()):
            old[route[0]] = old.get(route[0], 0) + 1
    return old


def unavailable() -> str:
    """Why the kernel path cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "the agent is not root"
    if not (shutil.which("iptables") and shutil.which("iptables-restore") and shutil.which("iptables-save")):
        return "iptables is not installed (Debian: apt-get install iptables)"
    return ""


def _run(argv: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelPathError(f"{argv[0]}: {exc!r}") from exc


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise KernelPathError(f"{what}: {said[-1] if said else f'exit status {done.returncode}'}")


def _device_of(address: str) -> str:
    """The interface a connection to ``address`` leaves by ('' when there is no route)."""
    words = _run(["ip", "-o", "route", "get", address]).stdout.split()
    return words[words.index("dev") + 1] if "dev" in words else ""


def _sysctl_path(device: str) -> Path:
    return Path("/proc/sys/net/ipv4/conf") / device / "route_localnet"


@dataclass
class KernelPath:
    """One agent's DNAT chains (see the module docstring). Blocking: called in a thread, or as the agent stops."""

    key: str
    """Names the chains (the agent's data directory)."""
    pid: int = field(default_factory=os.getpid)
    alive: Callable[[int], bool] = psutil.pid_exists
    installed: list[Dnat] | None = None
    localnet: dict[str, str] = field(default_factory=dict)
    """Interfaces given ``route_localnet`` → the value they had."""
    devices: dict[str, str] = field(default_factory=dict)
    """Remote endpoint address → the interface it is reached through (looked up once it has a route)."""

    @property
    def names(self) -> Chains:
        return chains(self.key)

    def install(self) -> None:
        """Remove stale agents' chains, write empty chains and the jumps (idempotent)."""
        for table in ("nat", "raw"):
            saved = _run(["iptables-save", "-t", table]).stdout
            for chain, rule in stale(saved, self.alive, prefixes=(CHAIN_PREFIX, POST_PREFIX, GUARD_PREFIX)):
                log.info("agent: removing the private network's chain %s of a stopped agent", chain)
                _drop(table, chain, [rule])
                for sub in sub_chains(saved, chain):
                    _drop(table, sub, [])
        self.apply([])
        for table, rule in jumps(self.names, self.pid):
            if _run(["iptables", "-w", "-t", table, "-C", *rule]).returncode != 0:
                _check(_run(["iptables", "-w", "-t", table, "-I", rule[0], "1", *rule[1:]]), f"iptables -t {table}")

    def apply(self, rules: list[Dnat]) -> bool:
        """Rewrite the chains when the rules changed; True when they were rewritten."""
        if rules == self.installed:
            return False
        for host in remote(rules):
            device = self.devices.get(host) or _device_of(host)
            if device:
                self.devices[host] = device  # no route yet (the mesh coming up): asked again next time
            if device and device != "lo" and device not in self.localnet:
                path = _sysctl_path(device)
                with contextlib.suppress(OSError):
                    self.localnet[device] = path.read_text().strip()
                    path.write_text("1\n")
                    log.info("agent: route_localnet set on %s (private network endpoints over it)", device)
        gone = consumer_octets(self.installed or ()) - consumer_octets(rules)
        text = restore_text(self.names, rules, flush=gone)
        _check(_run(["iptables-restore", "-w", "--noflush"], text), "iptables-restore")
        for octet in gone:  # emptied and no longer jumped to: a chain left behind is harmless, removed on stop
            with contextlib.suppress(KernelPathError):
                _run(["iptables", "-w", "-t", "nat", "-X", consumer_chain(self.names, octet)])
        self.installed = list(rules)
        return True

    def remove(self) -> None:
        """Remove the jumps and the chains; give back the interfaces' ``route_localnet``."""
        names = self.names
        by_table: dict[str, list[list[str]]] = {}
        for table, rule in jumps(names, self.pid):
            by_table.setdefault(table, []).append(rule)
        try:
            saved = _run(["iptables-save", "-t", "nat"]).stdout
        except KernelPathError:
            saved = ""
        _drop("nat", names.nat, by_table["nat"][:1])
        for sub in sub_chains(saved, names.nat):
            _drop("nat", sub, [])
        _drop("nat", names.post, by_table["nat"][1:])
        _drop("raw", names.guard, by_table["raw"])
        for device, value in self.localnet.items():
            with contextlib.suppress(OSError):
                _sysctl_path(device).write_text(f"{value}\n")
        self.localnet.clear()
        self.devices.clear()
        self.installed = None


def sub_chains(saved: str, chain: str) -> list[str]:
    """The consumers' chains of an agent's nat ``chain`` declared in ``iptables-save`` output."""
    return [
        line[1:].split()[0]
        for line in saved.splitlines()
        if line.startswith(f":{chain}-") and line[len(chain) + 2 :].split(" ", 1)[0].isdigit()
    ]


def _drop(table: str, chain: str, rules: Sequence[list[str]]) -> None:
    def run(*args: str) -> int:
        try:
            return _run(["iptables", "-w", "-t", table, *args]).returncode
        except KernelPathError:
            return 1

    drop_chain(run, chain, rules)
