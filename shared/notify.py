"""Notifications (docs/notifications.md): which events a channel receives, the message a person reads, and
the signed HTTP request that carries it. Pure: the delivering loop is services/secrets/notify.py.

A delivery is a POST of a JSON body with ``Zattera-Event-Id`` (the event's id: a receiver drops a repeat,
delivery being at least once), ``Zattera-Timestamp`` (Unix seconds) and ``Zattera-Signature: v1=<hex>``,
the HMAC-SHA256 of ``<timestamp>.<body>`` keyed by the channel's signing secret.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.names import label_problem

FORMATS = ("generic", "slack", "discord")
DEFAULT_EVENTS = (
    "deploy.failed",
    "deploy.rolled_back",
    "certificate.failed",
    "node.down",
    "job.failed",
    "backup.failed",
    "volume.node_lost",
    "volume.restore_failed",
    "volume.offsite_failed",
    "notify.failing",
)
"""What a channel receives when ``--events`` is not given: what someone must act on."""
TEST_KIND = "notify.test"
"""``zattera notify test NAME``: delivered to the channel its ``channel`` field names, whatever its filter."""
FAILING_KIND = "notify.failing"
RECOVERED_KIND = "notify.recovered"

EVENT_ID_HEADER = "Zattera-Event-Id"
TIMESTAMP_HEADER = "Zattera-Timestamp"
SIGNATURE_HEADER = "Zattera-Signature"

_KIND = re.compile(r"^[a-z0-9_*]+(\.[a-z0-9_*]+)*$")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a channel (None: it can)."""
    return label_problem(name, "channel")


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot receive notifications (None: it can)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return f"{shown_url(url)!r} is not an http:// or https:// URL"
    if parsed.username or parsed.password:
        return "credentials in the URL are not supported (the signature authenticates deliveries)"
    return None


def kinds_problem(kinds: Iterable[str]) -> str | None:
    for kind in kinds:
        if not _KIND.match(kind):
            return f"{kind!r} is not an event kind or pattern (e.g. deploy.failed, deploy.*)"
    return None


def shown_url(url: str) -> str:
    """The URL as it may be shown: scheme, host and port; the path and query (a Slack or Discord webhook's
    token) as ``…``."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parsed.port}" if parsed.port else ""
    rest = "/…" if parsed.path.strip("/") or parsed.query else ""
    return f"{parsed.scheme}://{host}{port}{rest}"


def wanted(channel: pb.NotifyChannel, event: pb.Event) -> bool:
    """Whether ``channel`` delivers ``event``: a test event only to the channel it names; its own failure
    never to a failing channel; otherwise its kinds (patterns as in a shell: ``deploy.*``) and project."""
    name = channel.meta.id
    if event.kind == TEST_KIND:
        return event.fields.get("channel") == name
    if event.kind in (FAILING_KIND, RECOVERED_KIND) and event.fields.get("channel") == name:
        return False
    if channel.project_id and event.project_id != channel.project_id:
        return False
    kinds = list(channel.events) or list(DEFAULT_EVENTS)
    return any(fnmatch.fnmatchcase(event.kind, pattern) for pattern in kinds)


@dataclass(frozen=True)
class Names:
    """How the event's subjects are called (the loop resolves ids through its view)."""

    env: str = ""
    """``project/app/env`` ("" : no environment)."""
    project: str = ""
    node: str = ""


def headline(event: pb.Event, names: Names) -> str:
    """The first line a person reads on a phone: what happened, where."""
    where = names.env or names.project or (f"node {names.node}" if names.node else "the cluster")
    label = {"error": "FAILED", "warning": "WARNING"}.get(event.severity, "")
    lead = f"{label} " if label else ""
    return f"{lead}{event.kind} — {where}"


def link(console_url: str, event: pb.Event) -> str:
    """The console page of the event's subject ("" without a console address)."""
    if not console_url:
        return ""
    base = console_url.rstrip("/")
    if event.environment_id:
        return f"{base}/env/{event.environment_id}"
    if event.node_id:
        return f"{base}/nodes"
    return f"{base}/"


def body(channel: pb.NotifyChannel, event: pb.Event, names: Names) -> bytes:
    """The request body for the channel's format."""
    title = headline(event, names)
    url = link(channel.console_url, event)
    text = f"{title}\n{event.message}" + (f"\n{url}" if url else "")
    if channel.format == "slack":
        doc: Mapping[str, object] = {"text": text}
    elif channel.format == "discord":
        doc = {"content": text[:2000]}
    else:
        at = event.meta.created_at
        doc = {
            "id": event.meta.id,
            "kind": event.kind,
            "severity": event.severity,
            "at": at.ToJsonString() if event.meta.HasField("created_at") else "",
            "title": title,
            "message": event.message,
            "text": text,
            "link": url,
            "environment": names.env,
            "project": names.project,
            "node": names.node,
            "environment_id": event.environment_id,
            "project_id": event.project_id,
            "app_id": event.app_id,
            "node_id": event.node_id,
            "fields": dict(sorted(event.fields.items())),
            "channel": channel.meta.id,
        }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def signature(secret: str, timestamp: int, payload: bytes) -> str:
    """``v1=`` and the hex HMAC-SHA256 of ``<timestamp>.<payload>`` keyed by ``secret``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def headers(event_id: str, secret: str, timestamp: int, payload: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": "zattera-notify/1",
        EVENT_ID_HEADER: event_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(secret, timestamp, payload),
    }


def verify(secret: str, given: Mapping[str, str], payload: bytes, *, now: float, tolerance: float = 300.0) -> bool:
    """What a receiver does (docs/notifications.md): the signature matches and the timestamp is recent."""
    try:
        timestamp = int(given.get(TIMESTAMP_HEADER, ""))
    except ValueError:
        return False
    if abs(now - timestamp) > tolerance:
        return False
    return hmac.compare_digest(signature(secret, timestamp, payload), given.get(SIGNATURE_HEADER, ""))
