"""What each rule of our HAProxy configuration costs a keep-alive request, in user-space instructions.

The figure noise does not move: each configuration's HAProxy runs under valgrind (callgrind, instruction
counts only), its counters zeroed after 300 warm-up requests, then ``h2load --h1 -c4`` sends keep-alive
requests through it to one nginx and the worker's instructions are divided by their number (two runs of
the same configuration agree within 0.2 %). Ours is what :func:`services.proxy.haproxy_config.render`
writes for one env, its server added at run time the way the engine adds a deployed replica (``add
server`` with the same line); the hand-configured HAProxy is :func:`benchmarks.side_by_side.hand_config`,
bare and with the forwarded headers ours sets. The full mode also runs ours with one rule taken out or
spelled otherwise at a time.

Bypassed: ``zattera up`` (``ingress_up_bench`` measures through it, in req/s and CPU time). Counted: user
space only; the system calls per request are the same for ours and the hand configuration (strace: 2
``sendto``, 2 ``recvfrom``).

``python -m benchmarks.ingress_rules_bench [--full]``: quick, ours and the two hand configurations, 500
requests each (~40 s); full, every variant, 2,000 requests each (~5 min). Needs valgrind, h2load, nginx and
haproxy (installed from Debian when running as root).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb

from benchmarks.common import Row, bench_main, row
from benchmarks.ingress_bench import PACKAGES, ROOT
from benchmarks.side_by_side import hand_config, serving_process, wait_listening
from services.proxy import haproxy_config as hc
from services.proxy import haproxy_plan as hp
from services.proxy.haproxy_rules import backend_rules
from services.proxy.haproxy_runtime import command
from shared.embedded import free_port

HOST = "app-prod.localhost"
WARM_UP = 300
Edit = Callable[[str], str]


def _drop(*needles: str) -> Edit:
    return lambda text: "".join(line for line in text.splitlines(True) if not any(n in line for n in needles))


def _swap(old: str, new: str) -> Edit:
    def edit(text: str) -> str:
        if old not in text:
            raise RuntimeError(f"{old!r} is not in the configuration any more: update the variant")
        return text.replace(old, new)

    return edit


VARIANTS: dict[str, Edit] = {
    "without X-Forwarded-Proto and -Host": _drop("X-Forwarded-Proto", "X-Forwarded-Host"),
    "without X-Forwarded-Host": _drop("X-Forwarded-Host"),
    "without X-Forwarded-Proto": _drop("X-Forwarded-Proto"),
    "without option forwardfor (X-Forwarded-For)": _drop("option forwardfor"),
    "without the ACME path_beg check": _drop("acme-challenge"),
    "Host not stripped of a port": _swap("req.hdr(host),field(1,:),lower", "req.hdr(host),lower"),
    "balance roundrobin": _swap("balance random(2)", "balance roundrobin"),
    "balance leastconn": _swap("balance random(2)", "balance leastconn"),
    "without retry-on, retries, redispatch": _drop("retry-on", "retries", "redispatch"),
}


def _ours(directory: Path, edit: Edit) -> tuple[Path, int, tuple[Path, str]]:
    """Our configuration for one env without servers (edited), its port, its stats socket and the backend."""
    directory.mkdir(parents=True)
    route = cpb.HTTPRoute(hostname=HOST, environment_id="e1")
    name = hp.backend_name(route)
    plan = hc.Plan({HOST: name}, (), {name: hc.Backend(name, "e1", backend_rules(route, 30.0), False, ())})
    port = free_port()
    layout = hc.Layout(directory, f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}", hold_timeout=30, connect_timeout=5)
    layout.hosts_map.write_text(hc.map_text(plan.hosts.items()))
    layout.config_file.write_text(edit(hc.render(plan, layout)))
    return layout.config_file, port, (layout.stats_socket, name)


def _hand(directory: Path, backend_addr: str, *, forwarded: bool) -> tuple[Path, int]:
    port = free_port()
    config = hand_config(directory, [HOST], backend_addr, port, free_port(), [], forwarded=forwarded)
    config.write_text(_drop("ssl crt-list")(config.read_text()))  # plain HTTP only: no certificate needed
    return config, port


def _requests(port: int, count: int) -> None:
    argv = ["h2load", "--h1", "-t1", "-c4", f"-n{count}", f"--connect-to=127.0.0.1:{port}", f"http://{HOST}/"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600).stdout
    if f"{count} succeeded, 0 failed" not in out:
        raise RuntimeError(f"h2load through port {port}: {out[-1500:]}")


async def _add_server(stats_socket: Path, backend: str, backend_addr: str, process: subprocess.Popen[bytes]) -> None:
    """As the engine adds a deployed replica: ``add server`` with the configured line, then ``enable``."""
    server = hc.Server("s_a1", backend_addr, hp.LOCAL_WEIGHT, 0, "")
    line = hc.server_line(server, sticky=False).split(" ", 2)[2]  # without "server <name>"
    deadline = time.monotonic() + 120
    while True:
        try:
            await command(stats_socket, f"add server {backend}/s_a1 {line}", timeout=60)
            break
        except OSError:  # the socket is not there yet (valgrind starts HAProxy slowly)
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    await command(stats_socket, f"enable server {backend}/s_a1", timeout=60)


def instructions(config: Path, port: int, count: int, runtime: tuple[Path, str, str] | None = None) -> float:
    """User-space instructions per keep-alive request of the HAProxy running ``config``; ``runtime``:
    (stats socket, backend, address) of the server to add at run time first."""
    out = config.parent / "callgrind.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "haproxy", "-db", "-f", str(config)]
    process = serving_process(argv)
    try:
        wait_listening(process, [port], 120)
        if runtime is not None:
            asyncio.run(_add_server(*runtime, process))
        _requests(port, WARM_UP)
        subprocess.run(["callgrind_control", "--zero", str(process.pid)], check=True, capture_output=True)
        _requests(port, count)
        subprocess.run(["callgrind_control", "--dump", str(process.pid)], check=True, capture_output=True)
        dumps = sorted(config.parent.glob("callgrind.out.*"))
        if not dumps:
            raise RuntimeError(f"callgrind wrote no dump for {config}")
        totals = re.search(r"^(?:summary|totals): (\d+)", dumps[-1].read_text(), re.MULTILINE)
        if totals is None:
            raise RuntimeError(f"no instruction total in {dumps[-1]}")
        return int(totals.group(1)) / count
    finally:
        process.terminate()
        process.wait(60)


def run(quick: bool = True) -> list[Row]:
    subprocess.run([str(ROOT / "deploy" / "system-packages.sh"), *PACKAGES, "valgrind"], check=True)
    count = 500 if quick else 2_000
    with tempfile.TemporaryDirectory(prefix="zattera-rules-bench-") as tmp:
        root = Path(tmp)
        backend_port = free_port()
        backend_addr = f"127.0.0.1:{backend_port}"
        nginx_conf = root / "nginx.conf"
        nginx_conf.write_text(
            f"daemon off; worker_processes 1; pid {root}/nginx.pid; error_log stderr;\n"
            "events { worker_connections 1024; }\n"
            f"http {{ access_log off; client_body_temp_path {root}; proxy_temp_path {root};\n"
            f"  fastcgi_temp_path {root}; uwsgi_temp_path {root}; scgi_temp_path {root};\n"
            f'  server {{ listen {backend_addr}; location / {{ return 200 "ok"; }} }} }}\n'
        )
        nginx = serving_process(["nginx", "-c", str(nginx_conf)])
        try:
            wait_listening(nginx, [backend_port], 30)
            config, port, (socket, backend) = _ours(root / "ours", lambda text: text)
            ours = instructions(config, port, count, (socket, backend, backend_addr))
            bare = instructions(*_hand(root / "hand", backend_addr, forwarded=False), count)
            same = instructions(*_hand(root / "hand-xf", backend_addr, forwarded=True), count)
            rows = [
                row("keep-alive request through our HAProxy config, user-space instructions", ours, "instr", ""),
                row("hand-configured HAProxy (no X-Forwarded-* header)", bare, "instr", "", f"ours ×{ours / bare:.2f}"),
                row(
                    "hand-configured HAProxy with the same X-Forwarded-* headers",
                    same,
                    "instr",
                    "",
                    f"ours ×{ours / same:.2f}",
                ),
                row("ours / hand-configured with the same headers", ours / same, "x", "≤ 1.2", "issue 32's CPU target"),
            ]
            for index, (label, edit) in enumerate(VARIANTS.items() if not quick else ()):
                config, port, (socket, backend) = _ours(root / f"v{index}", edit)
                value = instructions(config, port, count, (socket, backend, backend_addr))
                rows.append(row(f"ours {label}", value, "instr", "", f"{value - ours:+,.0f} against ours"))
        finally:
            nginx.terminate()
            nginx.wait(30)
    return rows


def main() -> None:
    bench_main("HAProxy configuration rules, instructions per request", run, __doc__, "every variant, 2,000 requests")


if __name__ == "__main__":
    main()
