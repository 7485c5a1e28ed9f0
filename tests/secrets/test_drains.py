"""Log drains: the wire formats (tables), and the secrets service's ``drains`` loop on a real nats-server
delivering from durable consumers to real receivers on loopback: an HTTP NDJSON receiver (basic auth and a
header checked), a syslog receiver over TLS (a self-signed certificate, made here with ``cryptography``) that
parses RFC 6587 octet-counted RFC 5424 frames, and an OTLP/HTTP receiver decoding with the official
protobufs. A drain down for 10,000 lines catches up in order losing none; lines retention removed before
delivery are counted; no credential in any record, event, status or log line."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as otlp_logs
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.secrets.drains import Drainer, DrainSettings
from shared import drains
from shared import keys as K
from shared.actions.context import ActionContext
from shared.actions.drains import AddDrain, RemoveDrain, add_drain, list_drains, remove_drain
from shared.actions.refusals import Invalid, NotFound
from shared.applogs import LogLimits, app_log_subject, app_logs_stream, app_logs_stream_config
from shared.backup.sealed import open_settings
from shared.clock import RealClock
from shared.connection import Connection
from shared.drain_status import status_lines
from shared.events import EventPublisher, make_event
from shared.loop import LoopDeps
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, Keyring, load_keyring
from shared.state.feed import StateView
from shared.subjects import EVENTS_SUBJECT_PREFIX
from shared.txn import Writer
from tests.backup.test_schedule import _cluster
from tests.secrets.test_service import secrets_service
from tests.waiting import eventually

TOKEN = "drain-T0K3N-do-not-leak-91c2"
PASSWORD = "pa55-do-not-leak-33ab"
BEARER = "bearer-do-not-leak-5d7e"
ENV = "01ENV"
FAST = DrainSettings(timeout=2.0, retry_first=0.05, retry_most=0.2, failing_after=3, status_every=0.2, idle_wait=0.2)


# ------------------------------------------------------------------ pure


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("syslog+tls://logs.example.com:6514", None),
        ("https://user:pw@logs.example.com/ingest?token=x", None),
        ("otlp://collector:4318", None),
        ("otlp+http://127.0.0.1:4318/custom", None),
        ("syslog://logs.example.com:514", "scheme"),
        ("syslog+tls://logs.example.com", "needs a port"),
        ("syslog+tls://u:p@logs.example.com:6514", "host:port only"),
        ("otlp://collector", "needs a port"),
        ("https://", "no host"),
        ("logs.example.com", "scheme"),
    ],
)
def test_which_urls_a_drain_takes(url: str, problem: str | None) -> None:
    found = drains.url_problem(url)
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_the_url_is_shown_without_credentials_path_or_query() -> None:
    assert drains.shown_url(f"https://u:{PASSWORD}@h.example.com:8443/x?t={TOKEN}") == "https://h.example.com:8443/…"
    assert drains.shown_url("syslog+tls://10.0.0.1:6514") == "syslog+tls://10.0.0.1:6514"
    assert PASSWORD not in (drains.url_problem(f"ftp://u:{PASSWORD}@h/") or "")


def test_endpoints_take_the_credentials_out_of_the_url() -> None:
    e = drains.endpoint(f"https://bob:{PASSWORD}@h.example.com/in?token={TOKEN}", {"X-Key": BEARER})
    assert e.url == f"https://h.example.com/in?token={TOKEN}" and e.basic_auth == ("bob", PASSWORD)
    assert drains.endpoint("otlp://c:4318", {}).url == "https://c:4318/v1/logs"
    assert drains.endpoint("otlp+http://c:4318/base", {}).url == "http://c:4318/base/v1/logs"
    assert drains.endpoint("otlp+https://c/v1/logs", {}).url == "https://c/v1/logs"


def test_a_syslog_frame_is_rfc5424_octet_counted() -> None:
    record = drains.Record(
        time_ns=1_764_547_200_123_456_000,
        text='boom ] "quoted" ünïcode',
        env="shop/web/production",
        env_id=ENV,
        stream="stderr",
        instance="01INST",
        node="node-1",
        release="01REL",
        severity="error",
    )
    frame = drains.syslog_frames([record])
    length, _, message = frame.partition(b" ")
    assert int(length) == len(message)
    assert message.decode() == (
        "<11>1 2025-12-01T00:00:00.123456Z node-1 shop/web/production 01INST stderr "
        '[zattera@32473 env_id="01ENV" release="01REL"] boom ] "quoted" ünïcode'
    )


def test_ndjson_is_one_object_per_line() -> None:
    records = [
        drains.Record(time_ns=1_000_000_000 * i, text=f"line {i}\nwith a break", env="e", env_id=ENV, stream="stdout")
        for i in range(3)
    ]
    body = drains.ndjson(records)
    docs = [json.loads(line) for line in body.decode().splitlines()]
    assert [d["line"] for d in docs] == [f"line {i}\nwith a break" for i in range(3)] and body.endswith(b"\n")
    assert docs[0]["type"] == "log" and docs[0]["time"] == "1970-01-01T00:00:00.000000Z"


# ------------------------------------------------------------------ receivers on loopback


@dataclass
class HttpReceiver:
    """NDJSON (or OTLP, ``otlp=True``) over HTTP on loopback; checks basic auth and a header when told."""

    otlp: bool = False
    user: str = ""
    password: str = ""
    header: tuple[str, str] | None = None
    status: int = 200
    port: int = 0
    lines: list[str] = field(default_factory=list)
    docs: list[dict[str, object]] = field(default_factory=list)
    requests: list[otlp_logs.ExportLogsServiceRequest] = field(default_factory=list)
    refused: int = 0
    tls: ssl.SSLContext | None = None
    runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        if self.user and (request.headers.get("Authorization") or "") != _basic(self.user, self.password):
            self.refused += 1
            return web.Response(status=401)
        if self.header and request.headers.get(self.header[0]) != self.header[1]:
            self.refused += 1
            return web.Response(status=403)
        if self.status != 200:
            return web.Response(status=self.status)
        payload = await request.read()
        if self.otlp:
            assert request.content_type == drains.PROTOBUF
            decoded = otlp_logs.ExportLogsServiceRequest.FromString(payload)
            self.requests.append(decoded)
            for resource in decoded.resource_logs:
                for scope in resource.scope_logs:
                    self.lines.extend(r.body.string_value for r in scope.log_records)
        else:
            assert request.content_type == drains.NDJSON
            for raw in payload.decode().splitlines():
                doc = json.loads(raw)
                self.docs.append(doc)
                self.lines.append(str(doc.get("line", doc.get("message"))))
        return web.Response(status=200)

    async def start(self) -> int:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/logs" if self.otlp else "/ingest", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=self.tls).start()
        if not self.port:
            self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def _basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def self_signed(directory: Path) -> tuple[Path, Path, str]:
    """A certificate for 127.0.0.1 signed by itself: (cert file, key file, its PEM as the drain's CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "drain receiver")])
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
    cert_file, key_file = directory / "receiver.pem", directory / "receiver.key"
    cert_file.write_bytes(pem)
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file, pem.decode()


SYSLOG = re.compile(
    r"^<(?P<pri>\d+)>1 (?P<ts>\S+) (?P<host>\S+) (?P<app>\S+) (?P<procid>\S+) (?P<msgid>\S+) "
    r"(?P<sd>\[zattera@32473 [^\]]*\]) (?P<msg>.*)$",
    re.S,
)


@dataclass
class SyslogReceiver:
    """RFC 5424 over TLS with octet-counting framing (RFC 6587), as a log service's syslog endpoint."""

    cert: Path
    key: Path
    messages: list[re.Match[str]] = field(default_factory=list)
    server: asyncio.Server | None = None
    port: int = 0

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                length = await reader.readuntil(b" ")
                message = (await reader.readexactly(int(length))).decode()
                match = SYSLOG.match(message)
                assert match is not None, message
                self.messages.append(match)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> int:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0, ssl=context)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


@pytest.fixture
async def loops() -> AsyncIterator[list[Drainer]]:
    made: list[Drainer] = []
    yield made
    for loop in made:
        await loop.end_term()


@pytest.fixture
async def stoppers() -> AsyncIterator[list[Callable[[], object]]]:
    made: list[Callable[[], object]] = []
    yield made
    for stop in made:
        result = stop()
        if asyncio.iscoroutine(result):
            await result


async def _start(
    conn: Connection, view: StateView, keyring: Keyring, made: list[Drainer], settings: DrainSettings = FAST
) -> Drainer:
    """A leader's term without the lease: its passes start one delivery task per drain."""
    loop = Drainer(LoopDeps(conn, view, RealClock(), coalesce=0.0), lambda: keyring, settings=settings)
    loop.writer = Writer(conn, view)
    made.append(loop)
    await loop.begin_term()
    await loop.run_pass()
    return loop


async def _stop(loop: Drainer, made: list[Drainer]) -> None:
    await loop.end_term()
    made.remove(loop)


async def _env_cluster(conn: Connection, view: StateView, *, max_msgs: int = -1) -> tuple[ActionContext, Keyring]:
    """The secrets key, project ``shop`` with app ``web`` and env ``production``, and the env's log stream."""
    ctx, keyring = await _cluster(conn, view)
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = pb.Environment(app_id="01APP", project_id="01PROJ", name="production")
    env.meta.id = ENV
    await ctx.writer.commit(ctx.writer.txn().create(app).create(env))
    config = app_logs_stream_config(ENV, LogLimits(max_bytes=256 * 1024 * 1024, max_age=3600.0), 1)
    config.max_msgs = max_msgs
    await conn.js.add_stream(config)
    await eventually(lambda: view.env(ENV) is not None, 5)
    return ctx, keyring


async def _publish(conn: Connection, first: int, count: int, *, per_message: int = 100, stream: str = "stdout") -> None:
    """Lines ``line <first>`` … of instance 01INST, ``per_message`` to an InstanceLogBatch (as the agent)."""
    subject = app_log_subject(ENV, "01INST")
    for start in range(first, first + count, per_message):
        batch = cpb.InstanceLogBatch(environment_id=ENV, instance_id="01INST", node_id="node-1", release_id="01REL")
        for i in range(start, min(start + per_message, first + count)):
            line = batch.lines.add(line=f"line {i}", stream=stream)
            line.time.FromNanoseconds(1_764_547_200_000_000_000 + i)
        await conn.js.publish(subject, batch.SerializeToString(), stream=app_logs_stream(ENV))


def _status(view: StateView, name: str) -> pb.LogDrainStatus:
    found = view.get(K.LOG_DRAIN_STATUS, name)
    return found if isinstance(found, pb.LogDrainStatus) else pb.LogDrainStatus()


async def _seen_events(conn: Connection) -> list[pb.Event]:
    seen: list[pb.Event] = []

    async def got(msg: object) -> None:
        seen.append(pb.Event.FromString(msg.data))  # type: ignore[attr-defined]

    await conn.nc.subscribe(f"{EVENTS_SUBJECT_PREFIX}drain.>", cb=got)
    return seen


def _in_order_none_lost(got: list[str], expected: list[str]) -> None:
    """Every expected line, in order; a repeat only of a batch in flight at an outage (at least once)."""
    deduplicated = list(dict.fromkeys(got))
    assert deduplicated == expected, f"{len(deduplicated)} distinct of {len(expected)}"
    positions = [expected.index(line) for line in got] if len(got) < 200 else None
    if positions is not None:
        assert positions == sorted(positions)


# ------------------------------------------------------------------ real components


async def test_an_http_drain_down_for_10000_lines_catches_up_in_order_losing_none(
    conn: Connection,
    view: StateView,
    loops: list[Drainer],
    stoppers: list[Callable[[], object]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    ctx, keyring = await _env_cluster(conn, view)
    receiver = HttpReceiver(user="bob", password=PASSWORD, header=("X-Api-Key", BEARER))
    stoppers.append(receiver.stop)
    port = await receiver.start()
    url = f"http://bob:{PASSWORD}@127.0.0.1:{port}/ingest?token={TOKEN}"
    drain, replaced = await add_drain(
        ctx, AddDrain("logs", url, env="shop/web/production", headers=[f"X-Api-Key: {BEARER}"])
    )
    assert not replaced and drain.url == f"http://127.0.0.1:{port}/…" and drain.scope == "env shop/web/production"
    notices = await _seen_events(conn)
    loop = await _start(conn, view, keyring, loops)

    await _publish(conn, 0, 100)
    expected = [f"line {i}" for i in range(100)]
    await eventually(lambda: receiver.lines == expected, 15, "the first 100 lines")
    assert receiver.refused == 0 and receiver.docs[0]["env"] == "shop/web/production"
    assert receiver.docs[0]["instance"] == "01INST" and receiver.docs[0]["stream"] == "stdout"

    # The receiver goes down for 10,000 lines; the control plane restarts meanwhile.
    await receiver.stop()
    await _publish(conn, 100, 10_000)
    expected += [f"line {i}" for i in range(100, 10_100)]
    await eventually(lambda: _status(view, "logs").failing, 15, "the drain is FAILING while its receiver is down")
    await eventually(lambda: any(e.kind == drains.FAILING_KIND for e in notices), 10)
    [line] = [text for text, bad in status_lines(view) if bad]
    assert "drains: logs" in line and "FAILING" in line and "cannot reach the receiver" in line
    await _stop(loop, loops)
    await _start(conn, view, keyring, loops)
    await receiver.start()  # the same port
    await eventually(lambda: len(set(receiver.lines)) == len(expected), 60, "every line once the receiver is back")
    _in_order_none_lost(receiver.lines, expected)
    assert len(receiver.lines) - len(expected) <= FAST.batch_lines, "at most one batch in flight again"
    await eventually(lambda: not _status(view, "logs").failing, 10)
    await eventually(lambda: any(e.kind == drains.RECOVERED_KIND for e in notices), 10)
    await eventually(
        lambda: [(s.delivered_seq, s.last_seq) for s in _status(view, "logs").sources] == [(101, 101)],
        10,
        "the cursor at the last message, no lag",
    )
    status = _status(view, "logs")
    assert status.dropped_messages == 0 and status.delivered_lines >= len(expected)
    assert [s.stream for s in status.sources] == [app_logs_stream(ENV)] and status.sources[0].delivered_seq == 101
    info = await conn.js.consumer_info(app_logs_stream(ENV), drains.consumer_name("logs"))
    assert info.ack_floor is not None and info.ack_floor.stream_seq == 101, "acked only what was accepted"

    # Nothing secret in what others read: records, status, events, the service's log.
    for kind in (K.LOG_DRAIN, K.LOG_DRAIN_STATUS):
        for record in view.all(kind):
            raw = K.encode(record)
            for secret in (TOKEN, PASSWORD, BEARER):
                assert secret.encode() not in raw
    for notice in notices:
        for secret in (TOKEN, PASSWORD, BEARER):
            assert secret not in notice.message and secret not in str(dict(notice.fields))
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("services", "shared", "nats"))
    assert "cannot reach the receiver" in ours, "the service's log says why (the receiver's own access log is not ours)"
    for secret in (TOKEN, PASSWORD, BEARER):
        assert secret not in ours
        assert secret not in repr(list_drains(ctx))

    await remove_drain(ctx, RemoveDrain("logs"))
    assert view.get(K.LOG_DRAIN, "logs") is None and view.get(K.LOG_DRAIN_STATUS, "logs") is None
    await loops[0].run_pass()
    with pytest.raises(Exception, match="consumer not found"):
        await conn.js.consumer_info(app_logs_stream(ENV), drains.consumer_name("logs"))


async def test_a_syslog_tls_drain_sends_rfc5424_frames_to_a_self_signed_receiver(
    conn: Connection, view: StateView, loops: list[Drainer], stoppers: list[Callable[[], object]], tmp_path: Path
) -> None:
    ctx, keyring = await _env_cluster(conn, view)
    cert, key, ca = self_signed(tmp_path)
    receiver = SyslogReceiver(cert, key)
    stoppers.append(receiver.stop)
    port = await receiver.start()
    await add_drain(ctx, AddDrain("siem", f"syslog+tls://127.0.0.1:{port}", env=ENV, ca_pem=ca))
    await _start(conn, view, keyring, loops)
    await _publish(conn, 0, 30, per_message=7)
    await _publish(conn, 30, 5, stream="stderr")
    await eventually(lambda: len(receiver.messages) == 35, 15, "35 syslog messages")
    assert [m["msg"] for m in receiver.messages] == [f"line {i}" for i in range(35)]
    first, last = receiver.messages[0], receiver.messages[-1]
    assert (first["pri"], first["msgid"], last["pri"], last["msgid"]) == ("14", "stdout", "11", "stderr")
    assert first["app"] == "shop/web/production" and first["host"] == "node-1" and first["procid"] == "01INST"
    assert first["sd"] == '[zattera@32473 env_id="01ENV" release="01REL"]'

    # Without the CA the receiver's certificate is not trusted: the drain says so, and delivers nothing.
    await add_drain(ctx, AddDrain("untrusting", f"syslog+tls://127.0.0.1:{port}", env=ENV))
    await loops[0].run_pass()
    await _publish(conn, 35, 1)
    await eventually(lambda: "TLS failed" in _status(view, "untrusting").last_error, 15)
    await eventually(lambda: len(receiver.messages) == 36, 15, "the other drain goes on")


async def test_an_otlp_drain_posts_export_logs_requests_with_platform_events(
    conn: Connection, view: StateView, loops: list[Drainer], stoppers: list[Callable[[], object]]
) -> None:
    ctx, keyring = await _env_cluster(conn, view)
    receiver = HttpReceiver(otlp=True, header=("Authorization", f"Bearer {BEARER}"))
    stoppers.append(receiver.stop)
    port = await receiver.start()
    await add_drain(
        ctx,
        AddDrain(
            "otel",
            f"otlp+http://127.0.0.1:{port}",
            project="shop",
            events=True,
            headers=[f"Authorization: Bearer {BEARER}"],
        ),
    )
    await _start(conn, view, keyring, loops)
    await _publish(conn, 0, 20, per_message=5)
    await EventPublisher(conn).publish(
        make_event("deploy.failed", "v3 failed", severity="error", environment_id=ENV, project_id="01PROJ"),
        make_event("deploy.failed", "another project's", severity="error", project_id="01OTHER"),
    )
    await eventually(lambda: len(receiver.lines) == 21, 15, "20 lines and the project's event")
    assert receiver.refused == 0
    assert [line for line in receiver.lines if line.startswith("line")] == [f"line {i}" for i in range(20)]
    assert "v3 failed" in receiver.lines and "another project's" not in receiver.lines
    logs = [
        r
        for req in receiver.requests
        for r in req.resource_logs
        if r.scope_logs[0].log_records[0].body.string_value == "line 0"
    ]
    resource = {a.key: a.value.string_value for a in logs[0].resource.attributes}
    assert resource["service.name"] == "shop/web/production" and resource["service.instance.id"] == "01INST"
    record = logs[0].scope_logs[0].log_records[0]
    assert record.time_unix_nano == 1_764_547_200_000_000_000 and record.severity_text == "INFO"
    assert {a.key: a.value.string_value for a in record.attributes} == {"log.iostream": "stdout"}
    await eventually(
        lambda: (
            sorted(s.stream for s in _status(view, "otel").sources) == sorted([app_logs_stream(ENV), "ZATTERA_EVENTS"])
        ),
        10,
        "a cursor in each stream the drain reads",
    )

    # A new environment of the project: its stream comes with its first lines, and the drain takes it.
    staging = pb.Environment(app_id="01APP", project_id="01PROJ", name="staging")
    staging.meta.id = "01ENV2"
    await ctx.writer.commit(ctx.writer.txn().create(staging))
    await eventually(lambda: view.env("01ENV2") is not None, 5)
    await loops[0].run_pass()
    config = app_logs_stream_config("01ENV2", LogLimits(max_bytes=64 * 1024 * 1024, max_age=3600.0), 1)
    await conn.js.add_stream(config)
    batch = cpb.InstanceLogBatch(environment_id="01ENV2", instance_id="01INST2", node_id="node-2")
    batch.lines.add(line="staging line", stream="stderr").time.FromNanoseconds(1_764_547_300_000_000_000)
    await conn.js.publish(app_log_subject("01ENV2", "01INST2"), batch.SerializeToString())
    await eventually(lambda: "staging line" in receiver.lines, 15, "the new environment's line")
    [staging_logs] = [
        r
        for req in receiver.requests
        for r in req.resource_logs
        if any(a.value.string_value == "01ENV2" for a in r.resource.attributes)
    ]
    assert staging_logs.scope_logs[0].log_records[0].severity_text == "ERROR"


async def test_lines_retention_removed_before_delivery_are_counted(
    conn: Connection, view: StateView, loops: list[Drainer], stoppers: list[Callable[[], object]]
) -> None:
    ctx, keyring = await _env_cluster(conn, view, max_msgs=50)
    receiver = HttpReceiver()
    stoppers.append(receiver.stop)
    port = await receiver.start()
    await add_drain(ctx, AddDrain("logs", f"http://127.0.0.1:{port}/ingest", env=ENV))
    loop = await _start(conn, view, keyring, loops)
    await _publish(conn, 0, 10, per_message=1)
    await eventually(lambda: len(receiver.lines) == 10, 15)
    await eventually(lambda: [s.delivered_seq for s in _status(view, "logs").sources] == [10], 10, "the cursor saved")
    await _stop(loop, loops)  # the drain stops (its service is down) while 200 more lines are logged
    await _publish(conn, 10, 200, per_message=1)  # the stream keeps 50: 150 go before the drain reads them
    await _start(conn, view, keyring, loops)
    expected = [f"line {i}" for i in range(10)] + [f"line {i}" for i in range(160, 210)]
    await eventually(lambda: receiver.lines == expected, 15, "the 50 lines left")
    await eventually(lambda: _status(view, "logs").dropped_messages == 150, 10, "150 counted as dropped")
    status = _status(view, "logs")
    assert status.dropped_lines == 150 and status.sources[0].dropped_messages == 150
    [(line, bad)] = status_lines(view)
    assert bad and "150 message(s) (~150 lines) dropped by retention" in line
    [listed] = list_drains(ctx)
    assert listed.dropped_messages == 150 and listed.cursors == {app_logs_stream(ENV): 210}


async def test_an_https_drain_checks_the_receivers_certificate_against_its_ca(
    conn: Connection, view: StateView, loops: list[Drainer], stoppers: list[Callable[[], object]], tmp_path: Path
) -> None:
    ctx, keyring = await _env_cluster(conn, view)
    cert, key, ca = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    receiver, otlp = HttpReceiver(tls=tls), HttpReceiver(otlp=True, tls=tls)
    stoppers += [receiver.stop, otlp.stop]
    await add_drain(ctx, AddDrain("https", f"https://127.0.0.1:{await receiver.start()}/ingest", env=ENV, ca_pem=ca))
    await add_drain(ctx, AddDrain("otlps", f"otlp://127.0.0.1:{await otlp.start()}", env=ENV, ca_pem=ca))
    await add_drain(ctx, AddDrain("untrusting", f"https://127.0.0.1:{receiver.port}/ingest", env=ENV))
    await _start(conn, view, keyring, loops)
    await _publish(conn, 0, 10, per_message=3)
    expected = [f"line {i}" for i in range(10)]
    await eventually(lambda: receiver.lines == expected and otlp.lines == expected, 15, "both TLS drains deliver")
    await eventually(lambda: _status(view, "untrusting").failing, 15, "the drain without the CA fails")
    assert "certificate is not trusted" in _status(view, "untrusting").last_error


@pytest.mark.parametrize(
    ("request_", "field_"),
    [
        (AddDrain("Bad Name", "https://h/x", env=ENV), "name"),
        (AddDrain("ok", "https://h/x"), "env"),
        (AddDrain("ok", "https://h/x", env=ENV, project="shop"), "env"),
        (AddDrain("ok", f"ftp://u:{PASSWORD}@h/x", env=ENV), "url"),
        (AddDrain("ok", "syslog+tls://h", env=ENV), "url"),
        (AddDrain("ok", "https://h/x", env=ENV, headers=["no colon"]), "headers"),
        (AddDrain("ok", "https://h/x", env=ENV, ca_pem="not a certificate"), "ca"),
    ],
)
async def test_bad_input_is_refused_naming_the_field(
    conn: Connection, view: StateView, request_: AddDrain, field_: str
) -> None:
    ctx, _ = await _env_cluster(conn, view)
    with pytest.raises(Invalid) as refused:
        await add_drain(ctx, request_)
    assert refused.value.field == field_ and PASSWORD not in str(refused.value)
    assert view.get(K.LOG_DRAIN, request_.name) is None
    with pytest.raises(NotFound, match="no project 'nosuch'"):
        await add_drain(ctx, AddDrain("ok", "https://h/x", project="nosuch"))
    with pytest.raises(NotFound, match="no environment 'a/b/c'"):
        await add_drain(ctx, AddDrain("ok", "https://h/x", env="a/b/c"))
    with pytest.raises(NotFound, match="no drain 'nosuch'"):
        await remove_drain(ctx, RemoveDrain("nosuch"))


async def test_a_key_rotation_reseals_a_drains_url_and_headers(
    nats_url: str, conn: Connection, view: StateView, tmp_path: Path
) -> None:
    await provision(conn.js, tombstone_ttl=900)
    path = tmp_path / "cluster.key"
    async with secrets_service(nats_url, path) as running:
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the key is published")
        project = pb.Project(name="shop")
        project.meta.id = "01PROJ"
        ctx = ActionContext(conn, Writer(conn, view), "tester")
        await ctx.writer.commit(ctx.writer.txn().create(project))
        url = f"https://bob:{PASSWORD}@logs.example.com/in?token={TOKEN}"
        await add_drain(ctx, AddDrain("lake", url, project="shop", headers=[f"X-Key: {BEARER}"]))
        before = view.get(K.LOG_DRAIN, "lake")
        assert isinstance(before, pb.LogDrain)
        rotated = await running.service.rotate()
        assert not rotated.error and rotated.resealed == 1 and rotated.previous_key_id == before.key_id

        def drain() -> pb.LogDrain:
            found = view.get(K.LOG_DRAIN, "lake")
            assert isinstance(found, pb.LogDrain)
            return found

        await eventually(lambda: drain().key_id == rotated.key_id, 10, "re-sealed")
        opened = open_settings(load_keyring(path), drain().sealed, drain().key_id)
        assert opened["url"] == url and json.loads(opened["headers"]) == {"X-Key": BEARER}
