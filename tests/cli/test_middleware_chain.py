"""Middleware from zattera.toml reaches the traffic: ``zattera apps apply`` → the env's middleware → the
routes service's snapshot → a proxy process that enforces it. Real NATS, real processes, real HTTP."""

from __future__ import annotations

import base64
import http.client
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import bcrypt
import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.embedded import free_port
from tests.cli.rig import state
from tests.factories import assignment, node, release
from tests.waiting import eventually_sync

PROJECT_ROOT = Path(__file__).resolve().parents[2]
HOST = "hello.example.com"
HASH = bcrypt.hashpw(b"open-sesame", bcrypt.gensalt(rounds=4)).decode()


def spec(allow: str) -> str:
    return f"""
project = "demo"
app = "hello"

[env.production]
replicas = 1
domains = ["{HOST}"]

[env.production.middleware]
ip_allowlist = ["{allow}"]
basic_auth = [{{ username = "ops", password_hash = "{HASH}" }}]
redirect_https = true
"""


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def backend() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _get(port: int, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/", headers={"Host": HOST, **headers})
        return connection.getresponse().status
    except OSError:
        return 0
    finally:
        connection.close()


def test_middleware_applied_from_the_toml_is_enforced_by_the_proxy(
    cli,
    nats_url: str,
    tmp_path: Path,
    backend: int,
) -> None:
    path = tmp_path / "zattera.toml"
    path.write_text(spec("127.0.0.1"))
    assert cli("apps", "apply", str(path)).exit_code == 0

    async def seed(conn, view, writer) -> None:
        env = pb.Environment()
        env.CopyFrom(next(e for e in view.envs() if e.name == "production"))
        n = node("n1")
        n.mesh_ip = "127.0.0.1"
        rel = release("R" * 26, env.meta.id)
        env.active_release_id = rel.meta.id
        a = assignment("n1", env.meta.id, rel.meta.id)
        await writer.commit(writer.txn().create(n).create(rel).put(env).create(a))
        observed = pb.AssignmentObserved(state=pb.INSTANCE_STATE_HEALTHY)
        observed.mesh_port_bindings["http"] = backend
        await writer.commit(writer.txn().put(observed, key=K.observed("n1", a.meta.id)))

    state(nats_url, seed)
    proxy_port = free_port()
    env = {"PATH": "/usr/bin:/bin", "ZATTERA_DOMAIN": ""}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "services.routes", "--nats", nats_url],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                *(sys.executable, "-m", "services.proxy", "--nats", nats_url),
                *("--listen", f"127.0.0.1:{proxy_port}", "--cache-dir", str(tmp_path / "proxy")),
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    login = {"Authorization": "Basic " + base64.b64encode(b"ops:open-sesame").decode(), "X-Forwarded-Proto": "https"}
    try:
        eventually_sync(lambda: _get(proxy_port, login) == 200, 30, "the route served with the right credentials")
        assert _get(proxy_port, {"X-Forwarded-Proto": "https"}) == 401
        wrong = {**login, "Authorization": "Basic " + base64.b64encode(b"ops:guess").decode()}
        assert _get(proxy_port, wrong) == 401
        assert _get(proxy_port, {k: v for k, v in login.items() if k != "X-Forwarded-Proto"}) == 308

        path.write_text(spec("10.0.0.0/8"))  # this client is no longer allowed
        assert cli("apps", "apply", str(path)).exit_code == 0
        eventually_sync(lambda: _get(proxy_port, login) == 403, 30, "the new allowlist enforced")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
