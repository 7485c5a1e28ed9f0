"""Log drains (docs/logs.md "Drains"): which receivers a drain may name, how its URL is shown, and the exact
bytes each kind of receiver is sent. Pure: the delivering loop is services/secrets/drains.py.

* ``syslog+tls://host:port``: RFC 5424 messages over TCP with TLS, octet-counting framing (RFC 6587
  3.4.1: ``<length> <message>``), one message per line;
* ``https://…`` / ``http://…``: a POST of an NDJSON batch (``application/x-ndjson``), one JSON object per
  line;
* ``otlp://host:port`` (TLS), ``otlp+https://…``, ``otlp+http://…``: OTLP/HTTP logs, an
  ``ExportLogsServiceRequest`` (the official ``opentelemetry-proto`` messages) POSTed as
  ``application/x-protobuf`` to ``/v1/logs``.
"""

from __future__ import annotations

import datetime
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as otlp_logs
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common
from opentelemetry.proto.logs.v1 import logs_pb2 as otlp_log
from opentelemetry.proto.resource.v1 import resource_pb2 as otlp_resource
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.names import label_problem

SYSLOG_TLS = "syslog+tls"
HTTP_SCHEMES = ("https", "http")
OTLP_SCHEMES = ("otlp", "otlp+https", "otlp+http")
SCHEMES = (SYSLOG_TLS, *HTTP_SCHEMES, *OTLP_SCHEMES)
FAILING_KIND = "drain.failing"
RECOVERED_KIND = "drain.recovered"
OTLP_PATH = "/v1/logs"
SYSLOG_ENTERPRISE = "32473"
"""The structured-data id's enterprise number: 32473 is the one RFC 5612 reserves for documentation."""
NDJSON = "application/x-ndjson"
PROTOBUF = "application/x-protobuf"

_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


def consumer_name(drain: str) -> str:
    """The durable consumer a drain reads each of its streams with."""
    return f"drain_{drain}"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a drain (None: it can)."""
    return label_problem(name, "drain")


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot receive a drain (None: it can). Never quotes the URL (it may hold credentials)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parsed.scheme not in SCHEMES:
        return f"the scheme {parsed.scheme + '://' if parsed.scheme else '(none)'} is not one of " + ", ".join(
            f"{s}://" for s in SCHEMES
        )
    if not parsed.hostname:
        return "the URL names no host"
    if parsed.scheme == SYSLOG_TLS:
        if port is None:
            return "syslog+tls:// needs a port (syslog+tls://host:6514)"
        if parsed.username or parsed.password or parsed.path.strip("/") or parsed.query:
            return "syslog+tls:// takes host:port only (no credentials, path or query)"
    if parsed.scheme == "otlp" and port is None:
        return "otlp:// needs a port (otlp://host:4318)"
    return None


def header_problem(header: str) -> str | None:
    name, sep, value = header.partition(":")
    if not sep or not _HEADER_NAME.match(name.strip()) or not value.strip():
        return "a header is 'Name: value' (e.g. 'Authorization: Bearer …')"
    if "\n" in value or "\r" in value:
        return "a header value holds no line break"
    return None


def parse_headers(headers: Iterable[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for header in headers:
        name, _, value = header.partition(":")
        found[name.strip()] = value.strip()
    return found


def shown_url(url: str) -> str:
    """``scheme://host[:port]``: never the credentials, path or query."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parsed.port}" if parsed.port else ""
    except ValueError:
        port = ""
    rest = "/…" if parsed.path.strip("/") or parsed.query else ""
    return f"{parsed.scheme}://{host}{port}{rest}"


@dataclass(frozen=True)
class Endpoint:
    """Where and how a drain's deliveries go, from its sealed URL (never logged)."""

    scheme: str
    host: str
    port: int
    url: str
    """The HTTP URL requests go to (credentials taken out); "" for syslog."""
    headers: Mapping[str, str]
    basic_auth: tuple[str, str] | None
    tls: bool


def endpoint(url: str, headers: Mapping[str, str]) -> Endpoint:
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme
    host = parsed.hostname or ""
    auth = None
    if parsed.username is not None:
        auth = (urllib.parse.unquote(parsed.username), urllib.parse.unquote(parsed.password or ""))
    netloc = f"[{host}]" if ":" in host else host
    if parsed.port:
        netloc += f":{parsed.port}"
    if scheme == SYSLOG_TLS:
        return Endpoint(scheme, host, parsed.port or 6514, "", dict(headers), None, True)
    if scheme in OTLP_SCHEMES:
        tls = scheme != "otlp+http"
        path = parsed.path.rstrip("/")
        if not path.endswith(OTLP_PATH):
            path += OTLP_PATH
        http_url = urllib.parse.urlunsplit(("https" if tls else "http", netloc, path, parsed.query, ""))
        return Endpoint(scheme, host, parsed.port or (443 if tls else 80), http_url, dict(headers), auth, tls)
    http_url = urllib.parse.urlunsplit((scheme, netloc, parsed.path or "/", parsed.query, ""))
    tls = scheme == "https"
    return Endpoint(scheme, host, parsed.port or (443 if tls else 80), http_url, dict(headers), auth, tls)


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Record:
    """One line of an app's output, or one platform event, as a drain ships it."""

    time_ns: int
    text: str
    env: str
    """``project/app/env`` (the id when the environment is gone)."""
    env_id: str
    stream: str = ""
    """``stdout`` / ``stderr`` for a line; "" for an event."""
    instance: str = ""
    node: str = ""
    release: str = ""
    kind: str = ""
    """The event kind ("" for a line)."""
    severity: str = ""
    """The event's severity; for a line: ``error`` on stderr, ``info`` on stdout."""


def records_of_batch(data: bytes, env: str) -> list[Record]:
    """The lines of one ``InstanceLogBatch`` message."""
    batch = cpb.InstanceLogBatch.FromString(data)
    return [
        Record(
            time_ns=line.time.ToNanoseconds(),
            text=line.line,
            env=env,
            env_id=batch.environment_id,
            stream=line.stream,
            instance=batch.instance_id,
            node=batch.node_id,
            release=batch.release_id,
            severity="error" if line.stream == "stderr" else "info",
        )
        for line in batch.lines
    ]


def record_of_event(event: pb.Event, env: str) -> Record:
    return Record(
        time_ns=event.meta.created_at.ToNanoseconds(),
        text=event.message,
        env=env,
        env_id=event.environment_id,
        node=event.node_id,
        kind=event.kind,
        severity=event.severity or "info",
    )


def rfc3339(time_ns: int) -> str:
    seconds, nanos = divmod(time_ns, 1_000_000_000)
    at = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos // 1000:06d}Z"


# ---------------------------------------------------------------------------------------- NDJSON


def ndjson(records: Sequence[Record]) -> bytes:
    """One JSON object per record, each on its own line (``\\n`` after each)."""
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    out = []
    for r in records:
        if r.kind:
            doc: dict[str, object] = {
                "type": "event",
                "time": rfc3339(r.time_ns),
                "env": r.env,
                "env_id": r.env_id,
                "kind": r.kind,
                "severity": r.severity,
                "message": r.text,
                "node": r.node,
            }
        else:
            doc = {
                "type": "log",
                "time": rfc3339(r.time_ns),
                "env": r.env,
                "env_id": r.env_id,
                "instance": r.instance,
                "node": r.node,
                "release": r.release,
                "stream": r.stream,
                "line": r.text,
            }
        out.append(dumps(doc))
    out.append("")
    return "\n".join(out).encode()


# ---------------------------------------------------------------------------------------- syslog

_SEVERITY = {"error": 3, "warning": 4, "info": 6}
_FACILITY_USER = 1


def _sd_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")


def _token(value: str, most: int) -> str:
    """An RFC 5424 header field: printable US-ASCII without space, at most ``most``; ``-`` when empty."""
    cleaned = "".join(c if 33 <= ord(c) <= 126 else "_" for c in value)[:most]
    return cleaned or "-"


def syslog_message(r: Record) -> bytes:
    """``<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID [zattera@32473 …] MSG`` (RFC 5424): facility user,
    severity err (stderr, error events), warning, or info; HOSTNAME the node, APP-NAME the environment,
    PROCID the instance, MSGID ``stdout``/``stderr`` or the event kind."""
    pri = _FACILITY_USER * 8 + _SEVERITY.get(r.severity, 6)
    params = [f'env_id="{_sd_escape(r.env_id)}"']
    if r.release:
        params.append(f'release="{_sd_escape(r.release)}"')
    sd = f"[zattera@{SYSLOG_ENTERPRISE} {' '.join(params)}]"
    head = (
        f"<{pri}>1 {rfc3339(r.time_ns)} {_token(r.node, 255)} {_token(r.env, 48)} "
        f"{_token(r.instance, 128)} {_token(r.kind or r.stream, 32)} {sd} "
    )
    return head.encode() + r.text.encode()


def syslog_frames(records: Sequence[Record]) -> bytes:
    """Octet-counting framing (RFC 6587 3.4.1): ``<length of the message in octets> SP <message>``."""
    out = bytearray()
    for r in records:
        message = syslog_message(r)
        out += str(len(message)).encode() + b" " + message
    return bytes(out)


# ---------------------------------------------------------------------------------------- OTLP

_OTLP_SEVERITY = {
    "error": (otlp_log.SEVERITY_NUMBER_ERROR, "ERROR"),
    "warning": (otlp_log.SEVERITY_NUMBER_WARN, "WARN"),
    "info": (otlp_log.SEVERITY_NUMBER_INFO, "INFO"),
}


def _attr(key: str, value: str) -> otlp_common.KeyValue:
    return otlp_common.KeyValue(key=key, value=otlp_common.AnyValue(string_value=value))


def otlp_request(records: Sequence[Record], *, observed_ns: int) -> otlp_logs.ExportLogsServiceRequest:
    """One ``ResourceLogs`` per (environment, instance, node, release), in order of first appearance: resource
    attributes ``service.name`` (the environment), ``service.instance.id``, ``host.name``,
    ``zattera.env.id``, ``zattera.release.id``; scope ``zattera``; each record's ``body`` the line,
    ``severity_number`` INFO / WARN / ERROR, attribute ``log.iostream`` (stdout/stderr) or ``event.name``."""
    request = otlp_logs.ExportLogsServiceRequest()
    groups: dict[tuple[str, str, str, str], otlp_log.ScopeLogs] = {}
    for r in records:
        key = (r.env_id, r.instance, r.node, r.release)
        scope = groups.get(key)
        if scope is None:
            resource_logs = request.resource_logs.add()
            attrs = [_attr("service.name", r.env), _attr("zattera.env.id", r.env_id)]
            if r.instance:
                attrs.append(_attr("service.instance.id", r.instance))
            if r.node:
                attrs.append(_attr("host.name", r.node))
            if r.release:
                attrs.append(_attr("zattera.release.id", r.release))
            resource_logs.resource.CopyFrom(otlp_resource.Resource(attributes=attrs))
            scope = resource_logs.scope_logs.add()
            scope.scope.name = "zattera"
            groups[key] = scope
        number, text = _OTLP_SEVERITY.get(r.severity, _OTLP_SEVERITY["info"])
        record = scope.log_records.add(
            time_unix_nano=r.time_ns,
            observed_time_unix_nano=observed_ns,
            severity_number=number,
            severity_text=text,
        )
        record.body.string_value = r.text
        if r.kind:
            record.attributes.append(_attr("event.name", r.kind))
        else:
            record.attributes.append(_attr("log.iostream", r.stream))
    return request


def encode(scheme: str, records: Sequence[Record], *, observed_ns: int) -> bytes:
    """The bytes one delivery of ``records`` sends to a receiver of ``scheme``."""
    if scheme == SYSLOG_TLS:
        return syslog_frames(records)
    if scheme in OTLP_SCHEMES:
        return otlp_request(records, observed_ns=observed_ns).SerializeToString()
    return ndjson(records)


def content_type(scheme: str) -> str:
    return PROTOBUF if scheme in OTLP_SCHEMES else NDJSON


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every credential replaced by ``…`` (an error message may quote a URL)."""
    for secret in secrets:
        if secret and len(secret) >= 3:
            text = text.replace(secret, "…")
    return text
