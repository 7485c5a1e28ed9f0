"""The ingress of a real ``zattera up`` side by side with a hand-configured HAProxy (issues 32 and 42).

One ``zattera up`` (its own data dir and free ports, metrics off, every other setting its default) and one
env deployed through the CLI (``zattera apps apply`` + ``zattera deploy``, twice: the second deploy's
replica reaches HAProxy the way every red/green replica does, added at run time through the runtime API —
the bench checks that its server is not in the configuration file). The env's replica is nginx (1 worker,
a fixed 200) started by the agent. Its HTTPS certificate is the one the cluster's local CA issued, served
by the proxy's TLS listener.

Against it, HAProxy 2.6 configured by hand (:func:`benchmarks.side_by_side.hand_config`): a 10,000-host map
(the env's hostname and 9,999 others) to one backend whose server is the same nginx, a TLS listener with the
same certificate (copied from the proxy). Both run at once; the loads of :mod:`benchmarks.side_by_side`
(HTTP and HTTPS keep-alive, a new connection per request with and without session resumption, h2) go to
each in alternating rounds with the CPU time of each HAProxy worker per request.

The hand-configured HAProxy runs twice: bare (no ``X-Forwarded-*`` header, the issue's baseline), and with
the forwarded headers every request through Zattera's ingress gets (``option forwardfor`` and
``X-Forwarded-Proto``/``-Host`` set, :data:`benchmarks.side_by_side.FORWARDED_HEADERS`): what an operator
configures for apps to learn the client's address, scheme and host, so that comparison prices the platform
rather than the headers (the three cost ~6,000 of the ~38,000 user-space instructions of a keep-alive
request, valgrind).

Beside each HAProxy worker's CPU per request, ours also reports its companions': every other process of the
``zattera up`` (the proxy process, which also reads HAProxy's request log for the latency percentiles, the
agent, the control plane, nats-server, HAProxy's master; not the app's nginx) — what the platform spends
while it serves, on the same cores. ``ZATTERA_PROXY_LATENCY_LOG`` and ``ZATTERA_PROXY_LATENCY_LOG_SAMPLE``
in the bench's environment reach the cluster (every other setting is its default).

Not here: 10,000 envs with a certificate each (``ingress_tls_bench``, through ``zattera up`` too; the
engine alone: ``ingress_bench``).

``python -m benchmarks.ingress_up_bench [--full]``: quick, 1 round of 1 s per load and side (~1 min with
the cluster's start and two deploys); full, 3 rounds of 8 s. Needs wrk, h2load (nghttp2-client), nginx
and haproxy (installed from Debian when running as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb

from benchmarks.common import Row, bench_main, row
from benchmarks.ingress_bench import install
from benchmarks.side_by_side import Side, check_certificate, hand_haproxy, haproxy_worker, measure, rows
from services.proxy.haproxy_config import Layout
from services.proxy.haproxy_plan import server_name
from shared.embedded import free_port
from tests.e2e.cluster import ROOT, cli_argv, kill_tree_under

PROJECT, APP, ENV = "bench", "ngx", "prod"
HOST = f"{APP}-{ENV}.localhost"
OTHER_HOSTS = 9_999
XF = "hand-xf"
TOML = f"""project = "{PROJECT}"
app = "{APP}"

[run]
command = "sh start.sh"

[env.{ENV}]
replicas = {{ min = 1, max = 1 }}
healthcheck = {{ type = "http", path = "/", interval = "1s", timeout = "1s", grace_period = "10s" }}
"""
START = r"""#!/bin/sh
# nginx answering a fixed 200 on $PORT at the node's address: 1 worker, in the foreground.
d="$(pwd)/run"; mkdir -p "$d"
cat > "$d/nginx.conf" <<CONF
daemon off; worker_processes 1; pid $d/nginx.pid; error_log stderr;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $d; proxy_temp_path $d; fastcgi_temp_path $d;
  uwsgi_temp_path $d; scgi_temp_path $d;
  server { listen ${ZATTERA_BIND_ADDR:-127.0.0.1}:$PORT; location / { return 200 "ok"; } } }
CONF
exec nginx -c "$d/nginx.conf"
"""


PASSED_THROUGH = ("ZATTERA_PROXY_LATENCY_LOG", "ZATTERA_PROXY_LATENCY_LOG_SAMPLE")
"""The settings of the environment the cluster gets (every other ``ZATTERA_*`` is its default)."""


class Up:
    """One ``zattera up`` in its own process group, on free ports."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.nats_port, self.http_port, self.tls_port = free_port(), free_port(), free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_") or k in PASSED_THROUGH}
        self.env |= {"PYTHONUNBUFFERED": "1", "OTEL_TRACES_EXPORTER": "none", "COLUMNS": "200"}
        self.env["ZATTERA_CONSOLE_PORT"] = str(free_port())
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    def start(self) -> None:
        argv = [*cli_argv(), "up", "--data-dir", str(self.data_dir), "--port", str(self.nats_port)]
        argv += ["--proxy-listen", f"127.0.0.1:{self.http_port}", "--proxy-tls-listen", f"127.0.0.1:{self.tls_port}"]
        argv += ["--metrics-port", "0"]
        with open(self.root / "up.out", "wb") as sink:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 120
        log = self.data_dir / "logs" / "control-plane.log"
        while not (log.exists() and "running" in log.read_text(errors="replace")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"zattera up did not come up:\n{(self.root / 'up.out').read_text()[-3000:]}")
            time.sleep(0.2)

    def cli(self, *args: str, timeout: float = 300) -> str:
        env = self.env | {"ZATTERA_NATS_URL": self.nats_url}
        done = subprocess.run([*cli_argv(), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"zattera {' '.join(args)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        return done.stdout

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        kill_tree_under(self.data_dir, also_matching=str(self.data_dir))

    @property
    def haproxy(self) -> Layout:
        """Where the proxy keeps its HAProxy's files and sockets (the listeners do not matter here)."""
        return Layout(self.data_dir / "proxy" / "haproxy", "", "", hold_timeout=0, connect_timeout=0)


def https_ok(port: int, ca: Path) -> bool:
    """``GET /`` over the TLS listener with the env's name, its certificate verified against the local CA."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname=HOST) as tls,
        ):
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
            return tls.recv(64).startswith(b"HTTP/1.1 200")
    except (OSError, ssl.SSLError):
        return False


def deployed_endpoint(up: Up) -> cpb.Endpoint:
    routes = json.loads(up.cli("routes", "--json"))
    for route in routes.get("http_routes", []):
        if route["hostname"] == HOST and route.get("endpoints"):
            endpoint = route["endpoints"][0]
            return cpb.Endpoint(assignment_id=endpoint["assignment_id"], addr=endpoint["addr"])
    raise RuntimeError(f"no endpoint routed for {HOST}")


def app_dir(root: Path) -> Path:
    """The benchmark app's source (``zattera.toml`` and ``start.sh``) in ``root/app``."""
    app = root / "app"
    app.mkdir()
    (app / "zattera.toml").write_text(TOML)
    (app / "start.sh").write_text(START)
    return app


def run(quick: bool = True) -> list[Row]:
    install()
    rounds, seconds = (1, 1.0) if quick else (3, 8.0)
    with tempfile.TemporaryDirectory(prefix="zattera-up-bench-") as tmp:
        root = Path(tmp)
        app = app_dir(root)
        up = Up(root)
        try:
            started = time.monotonic()
            up.start()
            up.cli("apps", "apply", str(app / "zattera.toml"))
            env = f"{PROJECT}/{APP}/{ENV}"
            up.cli("deploy", str(app), "--env", env)
            up.cli("deploy", str(app), "--env", env)  # a red/green deploy: its replica is added at run time
            ca = up.data_dir / "control" / "certs" / "local-ca.pem"  # cli/layout.py: the control plane's files
            deadline = time.monotonic() + 60
            while not https_ok(up.tls_port, ca):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"https://{HOST} did not answer with the local CA's certificate")
                time.sleep(0.2)
            ready = time.monotonic() - started
            endpoint = deployed_endpoint(up)
            layout = up.haproxy
            if server_name(endpoint) in layout.config_file.read_text():
                raise RuntimeError("the deployed replica's server is in haproxy.cfg: not the runtime path users get")
            pid = asyncio.run(haproxy_worker(layout.stats_socket))
            ours = Side("ours", up.http_port, up.tls_port, pid, companions(up, pid))
            hand_dir = root / "hand"
            hand_dir.mkdir()
            cert = hand_dir / f"{HOST}.pem"
            shutil.copy(layout.certs_dir / f"{HOST}.pem", cert)
            hosts = [f"h{i}.bench" for i in range(OTHER_HOSTS)] + [HOST]
            with (
                hand_haproxy(hand_dir, hosts, endpoint.addr, [cert], (free_port(), free_port())) as hand,
                hand_haproxy(
                    root / "hand-xf", hosts, endpoint.addr, [cert], (free_port(), free_port()), forwarded=True, name=XF
                ) as hand_xf,
            ):
                for side in (ours, hand, hand_xf):
                    check_certificate(side, HOST, cert)
                results = measure([ours, hand, hand_xf], HOST, rounds=rounds, seconds=seconds, progress=_progress)
        finally:
            up.stop()
    return [
        row("zattera up → two deploys → HTTPS answering", ready, "s", "", "cluster start, apply, deploy x2"),
        *rows(results, "zattera up, 1 env (hand: 10,000 hosts)"),
        *rows(results, "zattera up, 1 env (hand: 10,000 hosts, the same X-Forwarded-* headers)", hand=XF),
    ]


def companions(up: Up, worker: int) -> tuple[int, ...]:
    """Every process of ``up``'s session but the HAProxy worker and the app's nginx: the proxy process (it
    also reads HAProxy's request log for the latency percentiles), the agent, the control plane, nats-server
    and HAProxy's master — what the platform spends beside the data plane while it serves."""
    assert up.process is not None
    found = []
    for process in [psutil.Process(up.process.pid), *psutil.Process(up.process.pid).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if process.pid != worker and process.name() != "nginx":
                found.append(process.pid)
    print(f"  companions: {len(found)} processes of zattera up", file=sys.stderr)
    return tuple(found)


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def main() -> None:
    bench_main("Ingress through zattera up vs hand-configured HAProxy", run, __doc__, "3 rounds of 8 s per load")


if __name__ == "__main__":
    main()
