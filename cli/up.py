"""``zattera up``: the whole single-machine cluster on the embedded NATS server.

Starts nats-server (JetStream, data under ``<data_dir>/control/nats``), provisions the buckets and streams,
then the control plane — every service in one process (``cli.control_plane``, the default), or each service
as its own process (``--separate``) — and the local node (logs under ``<data_dir>/logs``), restarts a service or a NATS
server that dies (with backoff), and on Ctrl-C / SIGTERM stops the services (SIGTERM, then SIGKILL after a grace) and
then NATS, leaving no process behind. Running it again resumes the same cluster from its data dir. The control
plane, the local agent and the local proxy each keep their files in a directory of their own
(``cli/layout.py``): the agent is given its own credential, never a path into the control plane's files.

Run while a supervisor of the same data dir runs (``git pull && make up``), it asks that supervisor (its pid
in ``<data_dir>/up.pid``, locked while it lives) to roll its processes onto the code now installed:
migrations first, then each process stopped and started again, one at a time, the agent's instances kept
(docs/upgrades.md); it prints the supervisor's progress and exits.

The processes it runs and how are :mod:`cli.up_cluster`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from cli.lognotices import quiet_asyncio_tls_notice
from cli.up_cluster import ALL_IN_ONE, Cluster
from cli.up_provision import PROVISION_ENV, _provision, provision_in_child
from cli.up_roll import PID_FILE, ROLL_LOG, ROLL_SIGNAL, code_identity, hold_supervisor_lock
from services.proxy.launch import choose_engine, split_listen

NEXT_STEPS = """
Next, in another terminal (ZATTERA_NATS_URL={nats}):
  .venv/bin/zattera nodes list
  .venv/bin/zattera apps apply examples/hello/zattera.toml
  .venv/bin/zattera deploy examples/hello --env demo/hello/production
  curl -H 'Host: hello.localhost' http://127.0.0.1:{port}/
"""


def _proxy_engine() -> str:
    """``ZATTERA_PROXY_ENGINE`` ('' = the proxy picks), read as the proxy's settings read it; from the
    environment itself: the resident supervisor loads no settings (pydantic-settings, ~20 MB)."""
    return os.environ.get("ZATTERA_PROXY_ENGINE", "")


def data_plane_text() -> str:
    """Which data plane the proxy runs (the choice ``python -m services.proxy`` makes without ``--engine``)."""
    if choose_engine(_proxy_engine()) == "haproxy":
        return "haproxy (cold and basic-auth requests through the Python handler; docs/ingress.md)"
    return "python (haproxy not installed: make system-packages installs it; docs/ingress.md)"


def https_text(tls_listen: str, local_ca: Path) -> str:
    """Where the proxy serves HTTPS (the haproxy engine only), and how to trust its local certificates."""
    if not tls_listen:
        return "off (--proxy-tls-listen HOST:PORT turns it on)"
    if choose_engine(_proxy_engine()) != "haproxy":
        return "off: TLS needs the haproxy engine (make system-packages installs it; docs/certificates.md)"
    port = split_listen(tls_listen)[1]
    return f"https://<app>-<env>.localhost:{port}  (curl --cacert {local_ca} …)"


def proxy_listen_text(host: str, port: int) -> str:
    """Where the proxy listens, and what that means for who can reach it."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host in ("0.0.0.0", "::"):
        return f"{address} (every interface; --proxy-listen 127.0.0.1:{port} keeps it on this machine)"
    return address


CLUSTER_ENV = "ZATTERA_UP_CLUSTER"
"""How :func:`run_up` hands the cluster to the supervisor it execs (the environment: never on a command
line, where other users could read the NATS server configuration)."""


def run_up(cluster: Cluster, *, hint: str = "") -> NoReturn:
    """Supervise ``cluster`` until Ctrl-C, in a fresh interpreter that imports only what supervising needs.

    This process replaces itself (``exec``: same pid, terminal and signals, so Ctrl-C and the exit status
    are the caller's) with ``python -m cli.up``: the CLI's command modules, loaded to parse the options,
    would otherwise stay resident for as long as the cluster runs (~20 MB of a single machine's control
    plane, PERFORMANCE.md "footprint").
    """
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, CLUSTER_ENV: json.dumps({"cluster": cluster.config(), "hint": hint})}
    os.execve(sys.executable, [sys.executable, "-m", "cli.up"], env)


def supervise(cluster: Cluster, *, hint: str = "") -> int:
    stop = False
    roll = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    def on_roll(_sig: int, _frame: object) -> None:
        nonlocal roll
        roll = True

    lock = hold_supervisor_lock(cluster.data_dir)
    if lock is None:
        cluster.console.print(f"[red]another zattera up runs from {cluster.data_dir}[/] (pid {PID_FILE})")
        return 1
    # SIGHUP: the terminal went away (a closed window, a dropped SSH session) — stop as for Ctrl-C.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous[ROLL_SIGNAL] = signal.signal(ROLL_SIGNAL, on_roll)
    cluster.die_with_parent = True
    console = cluster.console
    try:
        cluster.layout.make()
        cluster.start_nats()
        cluster.code = code_identity()
        provision_in_child(cluster)
        cluster.start_services()
        console.print(f"[bold green]Zattera is up[/] — data in {cluster.data_dir}")
        console.print(
            f"  NATS:      {cluster.url}"
            + (f"  (cluster, replicas={cluster.replicas})" if cluster.cluster_servers else "")
            + (
                ""
                if cluster.creds or cluster.node_creds  # a worker machine holds its node's credentials only
                else "  (no authentication: every local process but sandboxed apps can use it;"
                " --secure before running untrusted apps)"
            )
        )
        for child in cluster.children:
            metrics = cluster.metrics_ports.get(child.name)
            where = f"  metrics http://127.0.0.1:{metrics}/metrics" if metrics else ""
            pid = child.proc.pid if child.proc else "-"
            console.print(f"  {child.name:<13} pid {pid}  log {child.log_path}{where}")
        if any(c.name in ("certs", ALL_IN_ONE) for c in cluster.children):
            local_ca = cluster.layout.local_ca
            console.print(f"  HTTPS:     *.localhost certificates from a local CA: trust {local_ca}")
        if any(c.name == "proxy" for c in cluster.children):
            console.print(f"  proxy:     listening on {proxy_listen_text(cluster.proxy_host, cluster.proxy_port)}")
            console.print(f"             data plane: {data_plane_text()}")
            console.print(f"             http://127.0.0.1:{cluster.proxy_port}  (apps at <app>-<env>.localhost)")
            console.print(f"             HTTPS: {https_text(cluster.proxy_tls_listen, cluster.layout.local_ca)}")
        if any(c.name in ("console", ALL_IN_ONE) for c in cluster.children):
            console.print(
                f"  console:   http://127.0.0.1:{cluster.console_port}  (users: `zattera console add-user NAME`)"
            )
        console.print(hint or NEXT_STEPS.format(nats=cluster.url, port=cluster.proxy_port))
        console.print("Press Ctrl-C to stop.")
        while not stop:
            if roll:
                roll = False
                cluster.roll(lambda line: _roll_progress(cluster, line))
            cluster.supervise_once()
            cluster.report_runtime()
            time.sleep(0.2)
    finally:
        # The terminal or the pipe it printed to may be gone (`zattera up | tee log` and Ctrl-C ends tee
        # too): saying so must not keep the cluster from stopping.
        with contextlib.suppress(OSError):
            console.print("stopping…")
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(OSError):
            console.print("stopped.")
        lock.close()
    return 0


def _roll_progress(cluster: Cluster, line: str) -> None:
    """A roll's progress: on the supervisor's terminal, and in ``<data_dir>/up-roll.log`` for the requester."""
    with contextlib.suppress(OSError):
        cluster.console.print(f"upgrade: {line}", markup=False, highlight=False)
    with (cluster.data_dir / ROLL_LOG).open("a") as log:
        log.write(line + "\n")


def main() -> None:
    """``python -m cli.up``, as :func:`run_up` execs it (and :func:`provision_in_child` runs it)."""
    quiet_asyncio_tls_notice()
    if PROVISION_ENV in os.environ:
        import asyncio

        sys.exit(asyncio.run(_provision(**json.loads(os.environ.pop(PROVISION_ENV)))))
    given = json.loads(os.environ.pop(CLUSTER_ENV))
    sys.exit(supervise(Cluster.from_config(given["cluster"]), hint=given["hint"]))


if __name__ == "__main__":
    main()
