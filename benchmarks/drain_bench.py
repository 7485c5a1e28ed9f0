"""Log drains (docs/logs.md "Drains"): lines/s one drain delivers, the CPU seconds the delivering process (the
secrets service's ``drains`` loop) spends per 1,000 lines, and the catch-up rate after an outage.

A real nats-server; the env's log stream filled as the agent fills it (``InstanceLogBatch`` messages of 256
lines of ~100 bytes); the ``Drainer`` loop in this process; the receiver in a child process (so its CPU is
not counted): an HTTP NDJSON endpoint, an OTLP/HTTP endpoint decoding every request with the official
protobufs, a syslog endpoint over TLS counting RFC 6587 frames.

* **throughput**: a backlog of N lines is stored, then the drain starts: lines/s from its start to the last
  line received, and the process CPU (user + system) over that time per 1,000 lines;
* **live** (HTTP): lines/s and CPU while another process stores lines as the agent does, from the first line
  received to the last;
* **catch-up**: the receiver is down while N lines are stored (the drain retrying, FAILING), then up: lines/s
  from the receiver's return to the last line received.

Quick: 100,000 lines per figure; ``--full``: 1,000,000.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import multiprocessing
import ssl
import tempfile
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from nacl.public import PrivateKey
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, listening, row
from services.secrets.drains import Drainer, DrainSettings
from shared.actions.context import ActionContext
from shared.actions.drains import AddDrain, RemoveDrain, add_drain, remove_drain
from shared.applogs import LogLimits, app_log_subject, app_logs_stream, app_logs_stream_config
from shared.clock import RealClock
from shared.connection import connect
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, Keyring, key_id, public_bytes
from shared.state.feed import StateView
from shared.txn import Writer

ENV = "01BENCHENV"
LINES_PER_MESSAGE = 256
LINE = "GET /api/items/42 200 0.003s user=7f3a request=01JD5Y… a typical access log line of about 100 b"


def _certificate(directory: Path) -> tuple[Path, Path, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench receiver")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (directory / "cert.pem").write_bytes(pem)
    (directory / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory / "cert.pem", directory / "key.pem", pem.decode()


# ---------------------------------------------------------------------------------------- the receiver (child)


def _receive(kind: str, port: int, count: Synchronized[int], cert_dir: str) -> None:
    asyncio.run(_serve(kind, port, count, Path(cert_dir)))


async def _serve(kind: str, port: int, count: Synchronized[int], cert_dir: Path) -> None:
    if kind == "syslog":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_dir / "cert.pem", cert_dir / "key.pem")

        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    length = await reader.readuntil(b" ")
                    await reader.readexactly(int(length))
                    with count.get_lock():
                        count.value += 1
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(client, "127.0.0.1", port, ssl=context)
        async with server:
            await server.serve_forever()
        return
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        if kind == "otlp":
            decoded = logs_service_pb2.ExportLogsServiceRequest.FromString(body)
            got = sum(len(s.log_records) for r in decoded.resource_logs for s in r.scope_logs)
        else:
            got = body.count(b"\n")
        with count.get_lock():
            count.value += got
        return web.Response(status=200)

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/v1/logs" if kind == "otlp" else "/ingest", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------- the drain (this process)


async def _publish(conn: object, first: int, lines: int) -> None:
    from shared.connection import Connection

    assert isinstance(conn, Connection)
    subject = app_log_subject(ENV, "01INST")
    pending = []
    for start in range(first, first + lines, LINES_PER_MESSAGE):
        batch = cpb.InstanceLogBatch(environment_id=ENV, instance_id="01INST", node_id="node-1", release_id="01REL")
        for i in range(start, min(start + LINES_PER_MESSAGE, first + lines)):
            line = batch.lines.add(line=f"{i} {LINE}", stream="stdout")
            line.time.FromNanoseconds(time.time_ns())
        pending.append(conn.js.publish(subject, batch.SerializeToString(), stream=app_logs_stream(ENV)))
        if len(pending) >= 64:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)


def _publisher(url: str, first: int, lines: int) -> None:
    """The agent's side, in a process of its own: ``lines`` lines stored as fast as it can."""
    asyncio.run(_publish_from(url, first, lines))


async def _publish_from(url: str, first: int, lines: int) -> None:
    conn = await connect(url, name="drain-bench-agent")
    try:
        await _publish(conn, first, lines)
    finally:
        await conn.close()


async def _wait_count(count: Synchronized[int], target: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while count.value < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count.value} of {target} lines received")
        await asyncio.sleep(0.005)
    return time.perf_counter()


async def _bench(url: str, lines: int, cert_dir: Path, ca: str) -> list[Row]:
    conn = await connect(url, name="drain-bench")
    await provision(conn.js, tombstone_ttl=900)
    view = StateView(conn, name="drain-bench")
    await view.start()
    rows: list[Row] = []
    ctx = ActionContext(conn, Writer(conn, view), "bench")
    key = PrivateKey.generate()
    record = pb.SecretsKey(key_id=key_id(public_bytes(key)), public_key=public_bytes(key))
    record.meta.id = CLUSTER_KEY
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = pb.Environment(app_id="01APP", project_id="01PROJ", name="production")
    env.meta.id = ENV
    await ctx.writer.commit(ctx.writer.txn().create(record).create(project).create(app).create(env))
    await conn.js.add_stream(app_logs_stream_config(ENV, LogLimits(4 * 1024**3, 3600.0), 1))
    settings = DrainSettings(retry_first=0.2, retry_most=0.5, status_every=1.0)
    fork = multiprocessing.get_context("fork")
    published = 0
    try:
        for kind in ("http", "otlp", "syslog"):
            port = _free_port()
            count: Synchronized[int] = fork.Value("q", 0)  # type: ignore[assignment]
            receiver = fork.Process(target=_receive, args=(kind, port, count, str(cert_dir)), daemon=True)
            receiver.start()
            target = {
                "http": f"http://127.0.0.1:{port}/ingest",
                "otlp": f"otlp+http://127.0.0.1:{port}",
                "syslog": f"syslog+tls://127.0.0.1:{port}",
            }[kind]
            await add_drain(ctx, AddDrain(kind, target, env=ENV, ca_pem=ca if kind == "syslog" else ""))
            await _publish(conn, published, lines)
            published += lines
            await listening(port)
            loop = Drainer(LoopDeps(conn, view, RealClock(), coalesce=0.0), lambda: Keyring([key]), settings=settings)
            loop.writer = ctx.writer
            await loop.begin_term()
            started, cpu = time.perf_counter(), time.process_time()
            await loop.run_pass()
            ended = await _wait_count(count, lines, 600)
            spent = time.process_time() - cpu
            rate = lines / (ended - started)
            rows.append(row(f"drain throughput, {kind} (backlog of {lines:,} lines)", rate, "lines/s", "≥ 20,000"))
            rows.append(row(f"drain CPU per 1,000 lines, {kind}", spent / (lines / 1000), "CPU s"))
            if kind == "http":  # live: an agent-like publisher in another process while the drain delivers
                count.value = 0
                publisher = multiprocessing.get_context("spawn").Process(
                    target=_publisher, args=(url, published, lines)
                )
                publisher.start()
                await _wait_count(count, 1, 120)
                t0, c0, cpu = time.perf_counter(), count.value, time.process_time()
                ended = await _wait_count(count, lines, 600)
                spent = time.process_time() - cpu
                publisher.join()
                published += lines
                rate = (lines - c0) / (ended - t0)
                rows.append(
                    row(
                        f"drain throughput, {kind}, live (lines stored meanwhile by another process)",
                        rate,
                        "lines/s",
                        "≥ 20,000",
                    )
                )
                rows.append(row(f"drain CPU per 1,000 lines, {kind}, live", spent / ((lines - c0) / 1000), "CPU s"))
            if kind == "http":  # the outage: receiver down, lines stored, receiver up
                receiver.kill()
                receiver.join()
                await _publish(conn, published, lines)
                published += lines
                await asyncio.sleep(2.0)  # retrying meanwhile
                count.value = 0
                receiver = fork.Process(target=_receive, args=(kind, port, count, str(cert_dir)), daemon=True)
                receiver.start()
                back = time.perf_counter()
                ended = await _wait_count(count, lines, 600)
                rate = lines / (ended - back)
                rows.append(row(f"drain catch-up after an outage, {kind} ({lines:,} lines)", rate, "lines/s"))
            await loop.end_term()
            await remove_drain(ctx, RemoveDrain(kind))
            receiver.kill()
            receiver.join()
    finally:
        await view.stop()
        await conn.close()
    return rows


def run(quick: bool = True) -> list[Row]:
    lines = 100_000 if quick else 1_000_000
    with embedded_server("zattera-drain-bench-") as server, tempfile.TemporaryDirectory() as tmp:
        _, _, ca = _certificate(Path(tmp))
        return asyncio.run(_bench(server.url, lines, Path(tmp), ca))


if __name__ == "__main__":
    bench_main("Log drains", run, __doc__, "1,000,000 lines per figure")
