"""The apps' network fence: apps' users cannot connect to the control plane's listeners (SECURITY.md, "Apps").

The environments' users (the uid range of :class:`services.agent.sandbox_users.UidTable`: sandboxed
processes, build steps, and a docker node's containers on the host network, which run as those users too)
share the host's network namespace: without a fence an app of an open cluster (NATS without credentials)
could connect to the NATS server and read and write the whole cluster, or to the console and the
services' metrics. The agent (root) installs, with the ``iptables``/``ip6tables`` programs, a chain of
its own that packets of that uid range go through (``OUTPUT -m owner --uid-owner FIRST-LAST -j
ZATTERA-APPS-<id>``), and so do packets entering from a docker node's bridge (``INPUT``/``FORWARD -i
br-…``: bridged containers have a network namespace of their own):

* packets of established connections pass (an app answers its clients), so do the private network's
  addresses and resolvers (``127.128.0.0/9``, ``network.py``);
* a new TCP connection to a *fenced port* on any address of this machine is reset: the ports of the NATS
  servers the agent uses, and every port a process of the control plane's process tree listens on
  (``zattera up`` names its own process: the NATS servers, the services, the console, metrics, the join
  service, the proxy's HAProxy), except the proxy's public ports (apps reach other apps through them);
* a new TCP connection to a NATS server of another machine (the agent's servers' addresses) is reset.

Apps keep their own ports, other apps through the proxy, the private network and the internet. The chain is
written whole in one ``iptables-restore --noflush`` transaction (no moment without rules), re-derived while
the agent runs (:meth:`Fence.sync`: a service started later is fenced within a refresh) and removed when the
agent stops; an agent restarted at once for an upgrade (its instances left for the next one to adopt)
leaves it, and the next agent takes it over. The jump names the agent's pid: an agent starting removes
the chains of agents that are gone (:func:`stale`: killed, they could not). Rules are pure data
(:func:`rules`), tested as a table.

Where it cannot be installed (the agent is not root, no iptables, no netfilter), :func:`Fence.install` says
why; the node's isolation reports it (``nodes list``, the terminal). On a secured cluster NATS refuses
connections without a credential anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil

from shared.errors import ZatteraError

log = logging.getLogger(__name__)

PRIVATE_NETWORK = "127.128.0.0/9"
"""The private network's consumer addresses and resolvers (``network.py``): always reachable."""
CHAIN_PREFIX = "ZATTERA-APPS-"
OWNER_MARK = "zattera-agent-pid="
REFRESH = 5.0
"""Seconds between re-derivations of the fenced ports while the agent runs."""
COMMAND_TIMEOUT = 20.0
NATS_DEFAULT_PORT = 4222


@dataclass(frozen=True)
class Blocked:
    """What apps may not connect to: ``ports`` on every address of this machine, ``remote`` (address, port)
    pairs elsewhere."""

    ports: frozenset[int] = frozenset()
    remote: frozenset[tuple[str, int]] = frozenset()


def chain_name(key: str) -> str:
    """The chain of one agent (its data directory): agents of several clusters on one machine keep theirs."""
    return CHAIN_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:10]


def rules(chain: str, blocked: Blocked, *, v6: bool) -> list[list[str]]:
    """The chain's rules (``iptables -A`` arguments after the chain name) for one address family."""
    out: list[list[str]] = [["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"]]
    if not v6:
        out.append(["-d", PRIVATE_NETWORK, "-j", "RETURN"])
    reset = ["-j", "REJECT", "--reject-with", "tcp-reset"]
    for port in sorted(blocked.ports):
        out.append(["-p", "tcp", "-m", "addrtype", "--dst-type", "LOCAL", "--dport", str(port), *reset])
    for address, port in sorted(blocked.remote):
        if (ipaddress.ip_address(address).version == 6) == v6:
            out.append(["-p", "tcp", "-d", address, "--dport", str(port), *reset])
    return [[chain, *rule] for rule in out]


def restore_text(chain: str, blocked: Blocked, *, v6: bool) -> str:
    """``iptables-restore --noflush`` input replacing the chain's rules in one transaction."""
    lines = ["*filter", f":{chain} - [0:0]"]
    lines += ["-A " + " ".join(rule) for rule in rules(chain, blocked, v6=v6)]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def jump(chain: str, first: int, last: int, pid: int) -> list[str]:
    """The OUTPUT rule sending the uid range's packets through the chain, naming the agent's pid."""
    owner = ["-m", "owner", "--uid-owner", f"{first}-{last}"]
    return ["OUTPUT", *owner, "-m", "comment", "--comment", f"{OWNER_MARK}{pid}", "-j", chain]


def bridge_jumps(chain: str, interfaces: Iterable[str], pid: int) -> list[list[str]]:
    """The INPUT and FORWARD rules sending what enters from each bridge interface (a docker node's bridged
    containers: their own network namespace, their packets reach the node from the bridge, not through
    OUTPUT) through the chain, naming the agent's pid."""
    mark = ["-m", "comment", "--comment", f"{OWNER_MARK}{pid}", "-j", chain]
    return [[hook, "-i", interface, *mark] for interface in sorted(interfaces) for hook in ("INPUT", "FORWARD")]


def stale(
    saved: str, alive: Callable[[int], bool], *, prefixes: tuple[str, ...] = (CHAIN_PREFIX,)
) -> list[tuple[str, list[str]]]:
    """(chain, jump rule) of each fence in ``iptables-save`` output whose agent is gone (killed: it could not
    remove its chain), to be removed so its ports do not stay fenced once other processes reuse them
    (``prefixes``: the chains looked for; the private network's kernel path passes its own)."""
    found = []
    hooks = ("-A OUTPUT ", "-A INPUT ", "-A FORWARD ", "-A PREROUTING ", "-A POSTROUTING ")
    for line in saved.splitlines():
        if not line.startswith(hooks) or OWNER_MARK not in line:
            continue
        words = shlex.split(line)
        chain = words[words.index("-j") + 1] if "-j" in words else ""
        marks = [w for w in words if w.startswith(OWNER_MARK)]
        if not chain.startswith(prefixes) or not marks:
            continue
        pid = marks[0].removeprefix(OWNER_MARK)
        if pid.isdigit() and not alive(int(pid)):
            found.append((chain, words[1:]))
    return found


def nats_addresses(urls: Iterable[str]) -> set[tuple[str, int]]:
    """(address, port) of each NATS server URL, host names resolved (one unresolvable is skipped)."""
    found: set[tuple[str, int]] = set()
    for url in urls:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if not parts.hostname:
            continue
        port = parts.port or NATS_DEFAULT_PORT
        try:
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for info in infos:
            found.add((str(info[4][0]).split("%")[0], port))
    return found


def _is_local_listener(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip not in ipaddress.ip_network(PRIVATE_NETWORK)


def control_ports(root_pids: Iterable[int], *, apps: range, allowed: Iterable[int]) -> set[int]:
    """Ports the processes of the trees under ``root_pids`` listen on (TCP), except listeners of an app's user
    (``apps``: a sandboxed instance below the agent), the private network's and the ``allowed`` ones."""
    pids: set[int] = set()
    for root in root_pids:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(root)
            for proc in (top, *top.children(recursive=True)):
                with contextlib.suppress(psutil.Error):
                    if proc.uids().real not in apps:
                        pids.add(proc.pid)
    keep = set(allowed)
    ports: set[int] = set()
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections("tcp"):
            if conn.status != psutil.CONN_LISTEN or conn.pid not in pids or not conn.laddr:
                continue
            if _is_local_listener(conn.laddr.ip) and conn.laddr.port not in keep:
                ports.add(conn.laddr.port)
    return ports


class FenceError(ZatteraError):
    """An iptables command failed (reported as the fence's problem, never raised out of the agent)."""


@dataclass
class Fence:
    """The fence of one agent's uid range (see the module docstring)."""

    key: str
    """Names the chain (the agent's data directory)."""
    uids: range
    nats_urls: Sequence[str] = ()
    control_pids: Sequence[int] = ()
    """Roots of the process trees whose listeners are fenced (the agent's own always is)."""
    allowed_ports: Sequence[int] = ()
    """Ports apps may connect to even when a fenced process listens there (the proxy's public ones)."""
    fixed_ports: Sequence[int] = ()
    """Ports fenced whether or not anything listens there yet (the control plane's known ones)."""
    interfaces: Sequence[str] = ()
    """Bridges whose incoming packets are fenced too (a docker node's bridge network)."""
    problem: str = ""
    """Why apps are not fenced ('' once installed)."""
    _installed: dict[str, Blocked] = field(default_factory=dict)

    @property
    def chain(self) -> str:
        return chain_name(self.key)

    def blocked(self) -> Blocked:
        roots = {os.getpid(), *self.control_pids}
        ports = control_ports(roots, apps=self.uids, allowed=self.allowed_ports)
        ports |= {p for p in self.fixed_ports if p not in self.allowed_ports}
        remote = nats_addresses(self.nats_urls)
        local = {a for a, _ in remote if _address_is_local(a)}
        ports |= {p for a, p in remote if a in local}
        return Blocked(frozenset(ports), frozenset((a, p) for a, p in remote if a not in local))

    async def install(self) -> bool:
        """Create the chain and its jump, idempotently; False (and :attr:`problem`) when it cannot be done."""
        if os.geteuid() != 0:
            self.problem = "the agent does not run as root (firewall rules need root)"
            return False
        programs = _programs()
        if not programs:
            self.problem = "iptables is not installed (Debian: apt-get install iptables)"
            return False
        try:
            for family in programs:
                await _remove_stale(family)
            await self.sync()
            for family in programs:
                for rule in self._jumps():
                    if await _run([family, "-w", "-C", *rule], check=False) != 0:
                        await _run([family, "-w", "-I", rule[0], "1", *rule[1:]])
        except FenceError as exc:
            self.problem = f"firewall rules cannot be installed: {exc}"
            await asyncio.to_thread(self.remove)
            return False
        self.problem = ""
        return True

    async def sync(self) -> None:
        """Rewrite the chain when the fenced ports changed (one transaction per address family)."""
        blocked = await asyncio.to_thread(self.blocked)
        for family in _programs():
            if self._installed.get(family) == blocked:
                continue
            text = restore_text(self.chain, blocked, v6=family == "ip6tables")
            await _run([f"{family}-restore", "-w", "--noflush"], stdin=text)
            self._installed[family] = blocked
            log.info("agent: apps fenced from ports %s (%s)", sorted(blocked.ports), family)

    async def keep(self) -> None:
        """Re-derive the fence every :data:`REFRESH` seconds until cancelled."""
        while True:
            await asyncio.sleep(REFRESH)
            try:
                await self.sync()
            except FenceError as exc:
                log.warning("agent: the apps' firewall could not be refreshed: %s", exc)

    def remove(self) -> None:
        """Remove the jump and the chain. Blocking on purpose: called as the agent stops, where a repeated
        cancellation must not cut it short (a few iptables commands)."""
        for family in _programs():
            _drop_chain_now(family, self.chain, self._jumps())
        self._installed.clear()

    def _jumps(self) -> list[list[str]]:
        pid = os.getpid()
        owner = jump(self.chain, self.uids.start, max(self.uids.start, self.uids.stop - 1), pid)
        return [owner, *bridge_jumps(self.chain, self.interfaces, pid)]


async def _drop_chain(family: str, chain: str, rule: list[str]) -> None:
    while await _run([family, "-w", "-D", *rule], check=False) == 0:
        pass
    await _run([family, "-w", "-F", chain], check=False)
    await _run([family, "-w", "-X", chain], check=False)


def _drop_chain_now(family: str, chain: str, rules: Sequence[list[str]]) -> None:
    def run(*args: str) -> int:
        try:
            return subprocess.run([family, "-w", *args], capture_output=True, timeout=COMMAND_TIMEOUT).returncode
        except (OSError, subprocess.TimeoutExpired):
            return 1

    drop_chain(run, chain, rules)


def drop_chain(run: Callable[..., int], chain: str, rules: Sequence[list[str]]) -> None:
    """Delete every copy of the ``rules`` that jump to ``chain``, then flush and delete ``chain``, through
    ``run`` (an iptables command's arguments → its exit status), blocking."""
    for rule in rules:
        while run("-D", *rule) == 0:
            pass
    run("-F", chain)
    run("-X", chain)


async def _remove_stale(family: str) -> None:
    saved = await _output([f"{family}-save", "-t", "filter"])
    for chain, rule in stale(saved, psutil.pid_exists):
        log.info("agent: removing the apps' firewall chain %s of a stopped agent", chain)
        await _drop_chain(family, chain, rule)


def _address_is_local(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    with contextlib.suppress(OSError):
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))  # binds only to an address of this machine
            return True
    return False


def _programs() -> list[str]:
    """The address families' programs present (``iptables`` first; ``ip6tables`` when there too)."""
    found = []
    for name in ("iptables", "ip6tables"):
        if shutil.which(name) and shutil.which(f"{name}-restore"):
            found.append(name)
    return found if "iptables" in found else []


async def _output(argv: list[str]) -> str:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        out, _ = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        raise FenceError(f"{argv[0]}: {exc!r}") from exc
    return out.decode(errors="replace")


async def _run(argv: list[str], *, stdin: str = "", check: bool = True) -> int:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(stdin.encode()), COMMAND_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        raise FenceError(f"{argv[0]}: {exc!r}") from exc
    code = proc.returncode or 0
    if check and code != 0:
        said = err.decode(errors="replace").strip().splitlines()
        raise FenceError(f"{' '.join(argv[:4])}: {said[-1] if said else f'exit status {code}'}")
    return code
