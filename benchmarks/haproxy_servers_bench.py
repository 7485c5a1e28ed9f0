"""How HAProxy 2.6 serves an endpoint depending on how the server got there (issue 32): requests/s and the
HAProxy worker's CPU per request, in alternating rounds, for one nginx backend reached through

* ``configured`` — a ``server`` line in the configuration file;
* ``added`` — ``add server`` + ``enable server`` at run time, nothing else (no idle connection pool:
  ``show servers conn`` reads ``idle_lim 0``, every request opens a backend connection);
* ``added with pool`` — the same with ``pool-max-conn -1 pool-purge-delay 5s`` (what the engine sends);
* ``template slot`` — a ``server-template`` slot whose address and port are set at run time, then made ready;
* ``… http-reuse always`` — the last two with ``http-reuse always`` (first requests of new client
  connections may take an idle backend connection; HAProxy's default, ``safe``, never does).

Loads: wrk HTTP keep-alive, and a new client connection per request (``Connection: close``). One HAProxy
(1 thread, each kind its own backend behind a Host map) serves every kind, so the rounds differ only in the
server. ``python -m benchmarks.haproxy_servers_bench [--full]``: quick, 1 round of 1 s; full, 3 of 5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import Row, bench_main, median, row
from benchmarks.ingress_bench import daemon, install, nginx_conf
from benchmarks.side_by_side import cpu_seconds, serving_process, wait_listening, wrk
from services.proxy.haproxy_config import IDLE_POOL
from services.proxy.haproxy_runtime import execute
from shared.embedded import free_port

KINDS = {
    "configured": "",
    "added": "",
    "added with pool": "",
    "template slot": "",
    "added with pool, http-reuse always": "    http-reuse always\n",
    "template slot, http-reuse always": "    http-reuse always\n",
}


def _backend(index: int) -> str:
    return f"k{index}"


def config(directory: Path, port: int, backend_addr: str) -> Path:
    lines = [
        "global",
        f"    stats socket {directory}/stats.sock mode 600 level admin",
        "    nbthread 1",
        "defaults",
        "    mode http",
        "    option http-keep-alive",
        "    timeout connect 5s",
        "    timeout client 30s",
        "    timeout server 30s",
        "frontend fe",
        f"    bind 127.0.0.1:{port}",
        f"    use_backend %[req.hdr(host),lower,map({directory}/kinds.map)]",
    ]
    for index, (kind, extra) in enumerate(KINDS.items()):
        lines += [f"backend {_backend(index)}", "    balance random(2)", *([extra.rstrip()] if extra else [])]
        if kind == "configured":
            lines.append(f"    server s1 {backend_addr}")
        elif kind.startswith("template slot"):
            lines.append("    server-template s 1-4 127.0.0.1:1 disabled")
    (directory / "kinds.map").write_text("".join(f"k{i}.bench {_backend(i)}\n" for i in range(len(KINDS))))
    path = directory / "servers.cfg"
    path.write_text("\n".join(lines) + "\n")
    return path


def runtime_commands(backend_addr: str) -> list[str]:
    host, _, port = backend_addr.rpartition(":")
    commands: list[str] = []
    for index, kind in enumerate(KINDS):
        where = f"{_backend(index)}/s1"
        if kind == "added":
            commands += [f"add server {where} {backend_addr}", f"enable server {where}"]
        elif kind.startswith("added with pool"):
            commands += [f"add server {where} {backend_addr} {IDLE_POOL}", f"enable server {where}"]
        elif kind.startswith("template slot"):
            commands += [f"set server {where} addr {host} port {port}", f"set server {where} state ready"]
    return commands


@contextlib.contextmanager
def haproxy(directory: Path, backend_addr: str) -> Iterator[tuple[int, int]]:
    """(port, pid) of the HAProxy serving every kind."""
    port = free_port()
    cfg = config(directory, port, backend_addr)
    process = serving_process(["haproxy", "-db", "-f", str(cfg)])
    try:
        wait_listening(process, [port], 30)
        answers = asyncio.run(execute(directory / "stats.sock", runtime_commands(backend_addr)))
        refused = [a for a in answers if "error" in a.lower() or "unknown" in a.lower()]
        if refused:
            raise RuntimeError(f"runtime commands refused: {refused}")
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(10)


def run(quick: bool = True) -> list[Row]:
    install()
    rounds, seconds = (1, 1.0) if quick else (3, 5.0)
    samples: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="zattera-servers-") as tmp:
        root = Path(tmp)
        backend_port = free_port()
        backend = nginx_conf(root, f'server {{ listen 127.0.0.1:{backend_port}; location / {{ return 200 "ok"; }} }}')
        with (
            daemon(["nginx", "-c", str(backend)], backend_port),
            haproxy(root, f"127.0.0.1:{backend_port}") as (
                port,
                pid,
            ),
        ):
            for close in (False, True):
                for index in range(rounds):
                    kinds = list(enumerate(KINDS))
                    for number, kind in kinds if index % 2 == 0 else list(reversed(kinds)):
                        before = cpu_seconds(pid)
                        outcome = wrk(f"http://127.0.0.1:{port}/", f"k{number}.bench", seconds, close=close)
                        used = cpu_seconds(pid) - before
                        samples.setdefault((kind, close), []).append((outcome.rate, 1e6 * used / outcome.requests))
                        time.sleep(0.2)
    out: list[Row] = []
    for close in (False, True):
        load = "new connection per request" if close else "keep-alive"
        for kind in KINDS:
            got = samples[(kind, close)]
            rounds_text = " / ".join(f"{rate:,.0f} req/s {cpu:.1f} µs" for rate, cpu in got)
            out.append(row(f"{kind}, {load}: req/s", median([r for r, _ in got]), "req/s", "", rounds_text))
            out.append(row(f"{kind}, {load}: HAProxy CPU per request", median([c for _, c in got]), "µs"))
    return out


def main() -> None:
    bench_main("HAProxy servers: configured, added at run time, template slots", run, __doc__, "3 rounds of 5 s")


if __name__ == "__main__":
    main()
