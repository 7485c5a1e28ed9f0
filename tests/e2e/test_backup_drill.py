"""The disaster-recovery drill through ``zattera up`` as an operator runs it: a cluster serving the example
app, whose release holds a sealed secret, backed up to a real S3 API server (moto on loopback); every
process stopped and the data directory deleted; ``zattera up`` on a new data directory, ``zattera restore``:
the app serves again through the new proxy, its replicas placed on the new machine and started with the
secret the restored key opens; a stateful env serves again the file it wrote on its volume on the old
machine (the volume rebuilt on the new machine's node from the snapshot the backup carried) and sees its own
secret (it serves the secret's digest); its domain and its implicit name are served over HTTPS by the new
proxy (SNI) with the very certificates the old one served (same leaf fingerprint, verified against the old
machine's local CA: a client that trusted it still does); the restore put that CA in the new data dir, so
the new machine's ``local-ca.pem`` is the old one and a domain added after the restore is issued from it.

Run twice: an open cluster, and a secured one (``zattera up --secure``: the CLI, backup and restore included,
runs with the operator credential the run prints; the new cluster issues its own credentials)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from shared.embedded import free_port
from tests.backup.conftest import BUCKET, s3
from tests.e2e.cluster import EXAMPLE, kill_tree_under, version_of
from tests.e2e.test_isolation import serving
from tests.e2e.test_up import hello, logs_of
from tests.e2e.upcmd import Up, listen_port
from tests.waiting import eventually

__all__ = ["s3"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]

ENV = "demo/hello/production"
PASSPHRASE = {"ZATTERA_RECOVERY_PASSPHRASE": "drill recovery passphrase"}
NOTES_ENV = "demo/notes/production"
NOTES_HOST = "notes.localhost"
NOTES_TOML = f"""project = "demo"
app = "notes"

[run]
command = "python3 app.py"

[env.production]
stateful = true
resources = {{ cpu_millis = 100, memory_mb = 64 }}
healthcheck = {{ type = "http", path = "/healthz", interval = "1s", timeout = "1s", grace_period = "10s" }}
domains = ["{NOTES_HOST}"]
[[env.production.volumes]]
volume_name = "data"
mount_path = "/data"
"""
NOTES_SECRET = "notes-drill-secret"
TLS_HOSTS = (NOTES_HOST, "notes-production.localhost")
"""Its domain, and its implicit name (routed once the env is: a restore writes the certificates before)."""
FRESH_HOST = "fresh.localhost"
"""A domain added after the restore: its certificate comes from the restored local CA."""
NOTES_APP = """import hashlib, os, secrets
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

path = os.path.join(os.environ["ZATTERA_VOLUME_DATA"], "note.txt")
if not os.path.exists(path):  # the first start writes it; a restored volume already holds it
    with open(path, "w") as f:
        f.write(secrets.token_hex(16))


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/healthz":
            body = b"ok"
        elif self.path == "/secret":  # a digest: the secret itself never leaves the app
            body = hashlib.sha256(os.environ.get("NOTES_TOKEN", "").encode()).hexdigest().encode()
        else:
            body = open(path, "rb").read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        return


bind = (os.environ.get("ZATTERA_BIND_ADDR", "127.0.0.1"), int(os.environ["PORT"]))
ThreadingHTTPServer(bind, Handler).serve_forever()
"""


async def note(port: int, path: str = "/") -> str:
    """What the stateful env serves at ``path`` ("" while it does not answer 200)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{port}{path}", headers={"Host": NOTES_HOST}) as response,
        ):
            return (await response.text()) if response.status == 200 else ""
    except (aiohttp.ClientError, OSError, TimeoutError):
        return ""


async def served_certificate(port: int, ca_pem: str, host: str) -> str:
    """The SHA-256 fingerprint of the leaf certificate the proxy's TLS listener serves for ``host`` (SNI),
    verified against ``ca_pem`` ("" while no such certificate is served)."""
    context = ssl.create_default_context(cadata=ca_pem)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=host), 5
        )
    except (ssl.SSLError, OSError, TimeoutError):
        return ""  # not listening yet, or HAProxy's self-signed fallback (no certificate for the name)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return hashlib.sha256(der).hexdigest()
    finally:
        writer.close()


def registered(up: Up) -> bool:
    """The local node is registered (on a secured cluster: through the join service's relay, which the
    restore's writes take too)."""
    return bool(json.loads(up.cli("nodes", "list", "--json", check=False).stdout or "[]"))


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    old, new = tmp_path / "old-machine", tmp_path / "new-machine"
    yield old, new
    for directory in (old, new):
        kill_tree_under(directory, also_matching=str(directory))


@pytest.mark.parametrize("mode", ["open", "secure"])
async def test_backup_to_s3_then_restore_on_a_new_data_dir_serves_again(
    s3: str, dirs: tuple[Path, Path], tmp_path: Path, mode: str
) -> None:
    old, new = dirs
    tls_port = listen_port()
    options = ("--proxy-tls-listen", f"127.0.0.1:{tls_port}", *(["--secure"] if mode == "secure" else []))
    fingerprints: dict[str, str] = {}
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "zattera.toml").write_text(NOTES_TOML)
    (notes / "app.py").write_text(NOTES_APP)
    written = ""
    nats_port, proxy_port = free_port(), free_port()
    target = f"s3://{BUCKET}/drill"

    async def served() -> bool:
        status, body = await hello(proxy_port)
        return status == 200 and version_of(body) == "v1"

    up = Up(old, nats_port, proxy_port, options=options, env=PASSPHRASE)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up")
        await eventually(lambda: serving(up), 90, "the local node registered, the example app applied")
        assert (mode == "secure") == ("ZATTERA_NATS_CREDS=" in up.text()), up.text()  # the operator's credential
        up.cli("deploy", str(EXAMPLE), "--env", ENV)
        up.cli("secrets", "set", "API_TOKEN", "--env", ENV, stdin="drill-secret-value\n")
        await eventually(served, 90, "hello answers through the proxy")
        up.cli("apps", "apply", str(notes / "zattera.toml"))
        up.cli("secrets", "set", "NOTES_TOKEN", "--env", NOTES_ENV, stdin=f"{NOTES_SECRET}\n")
        up.cli("deploy", str(notes), "--env", NOTES_ENV)

        async def wrote() -> bool:
            nonlocal written
            written = await note(proxy_port)
            return len(written) == 32

        await eventually(wrote, 90, "the stateful env serves the note it wrote on its volume")
        assert await note(proxy_port, "/secret") == hashlib.sha256(NOTES_SECRET.encode()).hexdigest()
        # The old machine's local CA: what a browser that trusted it keeps trusting after the restore.
        old_ca = (old / "control" / "certs" / "local-ca.pem").read_text()

        async def https() -> bool:
            fingerprints.update({h: await served_certificate(tls_port, old_ca, h) for h in TLS_HOSTS})
            return all(fingerprints.values())

        await eventually(https, 60, f"{TLS_HOSTS} are served over HTTPS")
        volumes = json.loads(up.cli("volumes", "list", "--json").stdout)
        assert len(volumes) == 1, volumes
        up.cli("volumes", "snapshot", volumes[0]["meta"]["id"])
        created = up.cli("backup", "create", "--to", target, "--data-dir", str(old))
        assert "objects" in created.stderr, created.stderr
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        print(logs_of(old))
        raise
    finally:
        up.kill()
    shutil.rmtree(old)

    up = Up(new, nats_port, proxy_port, options=options, env=PASSPHRASE)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up on the new machine")
        await eventually(lambda: registered(up), 90, "the new machine's node registered")
        verified = up.cli("backup", "verify", "--from", target)
        assert "all intact" in verified.stderr, verified.stderr
        restored = up.cli("restore", "--from", target, "--data-dir", str(new))
        assert "restored" in restored.stderr, restored.stderr
        assert "1 volumes' data" in restored.stderr, restored.stderr
        await eventually(served, 120, "hello answers again on the new machine")

        async def same_note() -> bool:
            return await note(proxy_port) == written

        await eventually(same_note, 120, "the stateful env serves the note it wrote on the old machine")
        assert await note(proxy_port, "/secret") == hashlib.sha256(NOTES_SECRET.encode()).hexdigest()

        async def same_certificates() -> bool:
            return {h: await served_certificate(tls_port, old_ca, h) for h in TLS_HOSTS} == fingerprints

        await eventually(same_certificates, 30, f"{TLS_HOSTS} are served over HTTPS with the certificates of before")
        # The restore put the old machine's local CA in the new data dir: `curl --cacert` of the new machine's
        # local-ca.pem verifies the restored certificates, and what the new machine issues from now on.
        assert "local CA restored (SHA-256 " in restored.stderr, restored.stderr
        new_ca = (new / "control" / "certs" / "local-ca.pem").read_text()
        assert new_ca == old_ca
        assert {h: await served_certificate(tls_port, new_ca, h) for h in TLS_HOSTS} == fingerprints
        up.cli("domains", "add", FRESH_HOST, "--env", NOTES_ENV)

        async def fresh_certificate() -> bool:
            return bool(await served_certificate(tls_port, new_ca, FRESH_HOST))

        await eventually(fresh_certificate, 60, f"{FRESH_HOST}, added after the restore, served under the old CA")
        shown = json.loads(up.cli("domains", "list", "--json").stdout)
        assert {d["hostname"]: d["state"] for d in shown if d["hostname"] in TLS_HOSTS} == dict.fromkeys(
            TLS_HOSTS, "valid"
        ), shown
        # A replica starts only once the secrets service opened its secrets: with the restored key.
        logs = "".join(p.read_text(errors="replace") for p in (new / "logs").glob("*.log"))
        assert "secrets: sealed 1 secret(s)" in logs, logs[-3000:]
        secrets = up.cli("secrets", "list", "--env", ENV)
        assert "API_TOKEN" in secrets.stdout and "drill-secret-value" not in secrets.stdout + secrets.stderr
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        print(logs_of(new))
        raise
    finally:
        up.kill()
