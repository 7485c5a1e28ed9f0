"""The runtime API commands that take a running HAProxy from one :class:`~services.proxy.haproxy_plan.Plan`
to another of the same structure (pure): servers that arrive, change or leave, and Host and path map entries.
:class:`~services.proxy.haproxy_engine.HAProxyEngine` sends them in order (servers that arrive, the maps,
servers that leave); a structure change is a reload instead (:meth:`Plan.same_structure`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from services.proxy.haproxy_config import Plan, server_line

MAP_REWRITE_ABOVE = 128
"""More host map entries changing or going than this at once: the map is rewritten whole. HAProxy 2.6 finds
the entry of a ``set map``/``del map`` by scanning the map (~1-3 ms at 10,000 entries, on the data plane's
thread); a rewrite costs ~50 µs per entry: 10,000 envs warming at once took 30 s entry by entry."""
RUNTIME_SERVER_IDS = 1_000_000
"""The first id given to a server added at run time, above the ids the configuration's servers get (1, 2, …).
HAProxy 2.6 places a ``balance random`` server on its consistent-hash ring from its id, and a server added
without one is placed before it has one: two servers added so to one backend share their places and one of
them never gets a request (haproxy/haproxy#3413, fixed in 3.0). An explicit id avoids it."""


def server_commands(
    running: Plan, target: Plan, draining: set[tuple[str, str]], server_ids: Iterator[int]
) -> tuple[list[str], list[str]]:
    """(commands for the servers that arrive or change, commands for those that leave). ``draining`` holds the
    (backend, server) pairs in maintenance: a server that leaves is added (put in maintenance at once, deleted
    once HAProxy accepts it), one that comes back before its deletion is taken out and enabled again."""
    commands: list[str] = []
    leaving: list[str] = []
    for backend_name, backend in target.backends.items():
        if backend is running.backends[backend_name]:
            continue
        if backend.sticky:  # its servers are part of the structure, their weights are not (issue 41)
            weights = {s.name: s.weight for s in running.backends[backend_name].servers}
            commands += [
                f"set server {backend_name}/{s.name} weight {s.weight}"
                for s in backend.servers
                if weights.get(s.name) != s.weight
            ]
            continue
        have = {s.name: s for s in running.backends[backend_name].servers}
        for server in backend.servers:
            before = have.pop(server.name, None)
            where = f"{backend_name}/{server.name}"
            if before is None and (backend_name, server.name) in draining:
                draining.discard((backend_name, server.name))
                commands += [f"set server {where} addr {_host(server.addr)} port {_port(server.addr)}"]
                commands += [f"set server {where} weight {server.weight}", f"enable server {where}"]
            elif before is None:
                line = server_line(server, sticky=False, held=backend.held).split(" ", 2)[2]
                commands += [f"add server {where} {line} id {next(server_ids)}"]
                commands += [f"enable health {where}"] if backend.held else []
                commands += [f"enable server {where}"]
            elif before != server:
                if before.addr != server.addr:
                    commands += [f"set server {where} addr {_host(server.addr)} port {_port(server.addr)}"]
                commands += [f"set server {where} weight {server.weight}"]
        for gone in have.values():
            leaving.append(f"disable server {backend_name}/{gone.name}")
            draining.add((backend_name, gone.name))
    return commands, leaving


def hosts_map_commands(hosts_map: Path, running: Plan, target: Plan) -> list[str] | None:
    """Host map changes entry by entry; None when more than :data:`MAP_REWRITE_ABOVE` entries change or go
    (each ``set map``/``del map`` scans the map in HAProxy 2.6): the map is then rewritten whole."""
    added: list[str] = []
    changed: list[str] = []
    for host, backend_name in target.hosts.items():
        before_backend = running.hosts.get(host)
        if before_backend is None:
            added.append(f"add map {hosts_map} {host} {backend_name}")
        elif before_backend != backend_name:
            changed.append(f"set map {hosts_map} {host} {backend_name}")
    changed += [f"del map {hosts_map} {host}" for host in running.hosts.keys() - target.hosts.keys()]
    if len(changed) > MAP_REWRITE_ABOVE:
        return None
    return added + changed


def map_rewrite_commands(version: str, path: Path, entries: Iterable[tuple[str, str]]) -> list[str]:
    """An atomic rewrite of a map: the new ``version`` (from ``prepare map``) filled, then committed."""
    return [*(f"add map @{version} {path} {key} {name}" for key, name in entries), f"commit map @{version} {path}"]


def _host(addr: str) -> str:
    return addr.rpartition(":")[0].removeprefix("[").removesuffix("]")


def _port(addr: str) -> str:
    return addr.rpartition(":")[2]
