"""HTTPS through a real ``zattera up`` at 10,000 envs with a certificate each, side by side with a
hand-configured HAProxy given the same 10,000 certificates (issue 42, item 4).

One ``zattera up`` (its own data dir and free ports, metrics off, every other setting its default). The envs
are declared the way users declare them — ``zattera apps apply`` of ``zattera.toml`` files, 500 envs per app
(one fenced write each, under the 1,000-write batch limit) — and one of them, ``ngx-prod``, deployed with
``zattera deploy`` (an nginx replica answering a fixed 200, started by the agent). Every env's implicit
hostname (``<app>-<env>.localhost``) gets its certificate the way the product delivers it: the certificate
loop has the cluster's local CA issue it, the secrets service hands the set to the proxy in pages, and the
proxy's HAProxy engine installs it at run time. The bench waits until HAProxy holds all of them (timed:
``apps apply`` → every certificate served), then checks that both sides serve a local-CA leaf.

Against it, HAProxy 2.6 configured by hand (:func:`benchmarks.side_by_side.hand_config`): every hostname in a
map to one backend whose server is the same nginx, and a crt-list of the same certificates (copied from the
proxy's files). Both run at once; the TLS loads of :mod:`benchmarks.side_by_side` (HTTPS keep-alive, a new
connection per request with the session resumed and with a full handshake, h2) go to each in alternating
rounds, each run with another env's hostname as its TLS server name (the certificate picked among the
10,000) and the deployed env's as its ``Host``; with each HAProxy worker's CPU time per request.

``python -m benchmarks.ingress_tls_bench [--full]``: quick, 1 round of 1 s per load and side; full, 3 rounds
of 8 s. ``ZATTERA_TLS_BENCH_ENVS`` sets the number of envs (10,000). The set-up (10,000 envs, certificates
issued one by one) takes minutes. Needs wrk, h2load (nghttp2-client), nginx and haproxy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Row, bench_main, row
from benchmarks.ingress_bench import install
from benchmarks.ingress_up_bench import APP, ENV, HOST, PROJECT, Up, app_dir, deployed_endpoint, https_ok
from benchmarks.side_by_side import Side, check_certificate, hand_haproxy, haproxy_worker, measure, rows
from shared.embedded import free_port

ENVS = int(os.environ.get("ZATTERA_TLS_BENCH_ENVS", "10000"))
PER_APP = 500
TLS_LOADS = ("tls", "tls-resumed", "tls-full", "h2")
SETUP_TIMEOUT = 1800.0


def app_toml(app: str, envs: int) -> str:
    """One app of ``envs`` envs (``e0`` …), never deployed: each gets a route and a certificate."""
    head = f'project = "{PROJECT}"\napp = "{app}"\n\n[run]\ncommand = "sh start.sh"\n'
    return head + "".join(f"\n[env.e{i}]\nreplicas = {{ min = 1, max = 1 }}\n" for i in range(envs))


def declared_hosts(total: int) -> list[str]:
    """The implicit hostnames of the ``total - 1`` declared envs (the deployed one is :data:`HOST`)."""
    hosts = []
    for index in range(total - 1):
        hosts.append(f"b{index // PER_APP}-e{index % PER_APP}.localhost")
    return hosts


def declare(up: Up, root: Path, total: int) -> None:
    others = total - 1
    for number, start in enumerate(range(0, others, PER_APP)):
        directory = root / f"b{number}"
        directory.mkdir()
        (directory / "zattera.toml").write_text(app_toml(f"b{number}", min(PER_APP, others - start)))
        up.cli("apps", "apply", str(directory / "zattera.toml"))


def served_count(certs_dir: Path) -> int:
    return len(list(certs_dir.glob("*.pem"))) if certs_dir.is_dir() else 0


def reloads(proxy_log: Path) -> str:
    """The proxy log's reloads and warnings (what moves HAProxy's worker or stalls it)."""
    lines = proxy_log.read_text(errors="replace").splitlines() if proxy_log.exists() else []
    return "\n".join(line[:240] for line in lines if "reload" in line or "WARNING" in line or "ERROR" in line)


def settled_worker(stats_socket: Path, proxy_log: Path, quiet: float = 15.0, timeout: float = 300.0) -> int:
    """The pid of our HAProxy worker once neither it nor the proxy log has changed for ``quiet`` seconds:
    the control plane still settles 10,000 envs (route versions, reloads) after the last certificate."""
    deadline = time.monotonic() + timeout
    pid, size, since = 0, -1, time.monotonic()
    while time.monotonic() < deadline:
        now_pid = asyncio.run(haproxy_worker(stats_socket))
        now_size = proxy_log.stat().st_size if proxy_log.exists() else 0
        if (now_pid, now_size) != (pid, size):
            pid, size, since = now_pid, now_size, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return pid
        time.sleep(1)
    _progress(f"the proxy did not settle within {timeout:.0f} s: measuring anyway")
    return pid


def run(quick: bool = True) -> list[Row]:
    install()
    rounds, seconds = (1, 1.0) if quick else (3, 8.0)
    with tempfile.TemporaryDirectory(prefix="zattera-tls-bench-") as tmp:
        root = Path(tmp)
        app = app_dir(root)
        up = Up(root)
        try:
            up.start()
            layout = up.haproxy
            started = time.monotonic()
            up.cli("apps", "apply", str(app / "zattera.toml"))
            declare(up, root, ENVS)
            declared = time.monotonic() - started
            _progress(f"{ENVS:,} envs declared in {declared:.1f} s")
            up.cli("deploy", str(app), "--env", f"{PROJECT}/{APP}/{ENV}")
            ca = up.data_dir / "control" / "certs" / "local-ca.pem"  # cli/layout.py: the control plane's files
            deadline = time.monotonic() + SETUP_TIMEOUT
            last = -1
            while served_count(layout.certs_dir) < ENVS or not https_ok(up.tls_port, ca):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{served_count(layout.certs_dir):,} of {ENVS:,} certificates served")
                count = served_count(layout.certs_dir)
                if count // 1000 != last // 1000:
                    _progress(f"{count:,} certificates in HAProxy after {time.monotonic() - started:.0f} s")
                    last = count
                time.sleep(1)
            served = time.monotonic() - started
            _progress(f"every certificate served {served:.0f} s after the first apply")
            endpoint = deployed_endpoint(up)
            pid = settled_worker(layout.stats_socket, up.data_dir / "logs" / "proxy.log")
            ours = Side("ours", up.http_port, up.tls_port, pid)
            hand_dir = root / "hand"
            (hand_dir / "certs").mkdir(parents=True)
            hosts = [HOST, *declared_hosts(ENVS)]
            certs = []
            for host in hosts:
                certs.append(Path(shutil.copy(layout.certs_dir / f"{host}.pem", hand_dir / "certs" / f"{host}.pem")))
            sni = hosts[1 :: max(1, len(hosts) // 97)]  # spread over the apps and envs
            with hand_haproxy(hand_dir, hosts, endpoint.addr, certs, (free_port(), free_port())) as hand:
                for side in (ours, hand):
                    for host in (HOST, sni[0], hosts[-1]):
                        check_certificate(side, host, hand_dir / "certs" / f"{host}.pem")
                results = measure(
                    [ours, hand], HOST, loads=TLS_LOADS, rounds=rounds, seconds=seconds, progress=_progress, sni=sni
                )
            after = asyncio.run(haproxy_worker(layout.stats_socket))
            if after != pid:  # a reload meanwhile: the rounds after it charged the old worker's CPU
                _progress(f"our HAProxy worker changed during the rounds ({pid} → {after}): its CPU figures are wrong")
            _progress("proxy log during the set-up and rounds:\n" + reloads(up.data_dir / "logs" / "proxy.log"))
        finally:
            up.stop()
    scale = f"zattera up, {ENVS:,} envs with a certificate each (hand: the same certificates)"
    return [
        row(f"zattera up: {ENVS:,} envs declared (apps apply, {PER_APP} per app)", declared, "s"),
        row(f"zattera up: first apply → all {ENVS:,} certificates served by HAProxy", served, "s"),
        *rows(results, scale),
    ]


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def main() -> None:
    bench_main("HTTPS at 10,000 envs through zattera up vs hand-configured HAProxy", run, __doc__, "3 rounds of 8 s")


if __name__ == "__main__":
    main()
