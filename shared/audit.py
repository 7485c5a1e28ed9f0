"""The audit log: who wrote what to the cluster's desired state, when, from where (docs/audit.md).

Every write an operator makes — through the CLI, the console or (when one exists) a webhook — is recorded as
one JSON entry in the ``ZATTERA_AUDIT`` stream (append-only: ``deny_delete``, ``deny_purge``; its own
``max_age``, 90 days unless ``ZATTERA_AUDIT_MAX_AGE`` said otherwise at the cluster's init) on
``zattera.audit.<source>``. Who records it depends on where the identity can be trusted:

- a secured cluster's CLI: the relay of the operators' state writes (:mod:`shared.security.relay`, control),
  with the identity the server set on the request (``Nats-Request-Info``): ``verified`` true. What the CLI
  claims (``Zattera-Audit-User``, ``Zattera-Action``, ``Zattera-Request-Id`` headers) is kept as claims,
  never as the identity;
- an open cluster's CLI: the CLI itself (:class:`AuditedWriter`), with the OS user and host it runs as:
  ``verified`` false (nothing on an open cluster authenticates anybody);
- the console: the console (:class:`AuditedWriter`, one per request) with the logged-in user: ``verified``
  true (the console's own login; its writes use the control credential and cross no relay).

An entry names keys and operations, never a value: a sealed secret's key name is there, its value is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import nats.errors
from nats.js.errors import NotFoundError

from shared.connection import Connection
from shared.ids import new_id
from shared.state.feed import StateView
from shared.subjects import AUDIT_STREAM, AUDIT_SUBJECT_PREFIX
from shared.txn import Txn, TxnError, Writer

log = logging.getLogger(__name__)

USER_HEADER = "Zattera-Audit-User"
"""The CLI's claim of who runs it (``user@host``): recorded as ``claimed_user``, never as the identity."""
ACTION_HEADER = "Zattera-Action"
"""The command that wrote (``env set``): recorded as ``action`` with ``action_claimed`` true."""
REQUEST_ID_HEADER = "Zattera-Request-Id"
"""One id per CLI command (every write it makes carries it): ``request_id``."""
CLAIM_HEADERS = (USER_HEADER, ACTION_HEADER, REQUEST_ID_HEADER)
MAX_CLAIM = 200
"""Claims are cut to this many characters (they are the client's words)."""
SOURCES = ("cli", "console", "webhook")
PUBLISH_TIMEOUT = 2.0
ENTRY_VERSION = 1


def audit_subject(source: str) -> str:
    return f"{AUDIT_SUBJECT_PREFIX}{source}"


@dataclass(frozen=True)
class KeyWrite:
    key: str
    op: str
    """``put`` or ``delete``."""


@dataclass(frozen=True)
class AuditEntry:
    """One audited write (one key, or one atomic batch of keys). JSON on the wire (docs/wire-contract.md)."""

    source: str
    user: str
    verified: bool
    keys: tuple[KeyWrite, ...]
    outcome: str
    """``ok``, or why not: ``refused: …``, ``conflict: …``, ``error: …``, ``unconfirmed``."""
    verified_by: str = ""
    """``nats-credential`` (secured CLI), ``console-login`` (console), "" (a claim)."""
    credential: dict[str, str] = field(default_factory=dict)
    """Secured cluster: the server-set ``account``, ``user_key``, ``issuer_key``, ``name``."""
    claimed_user: str = ""
    action: str = ""
    action_claimed: bool = False
    address: str = ""
    request_id: str = ""
    seq: int = 0
    """The state stream's sequence of the write (0: not stored or not known)."""
    id: str = field(default_factory=new_id)
    time_ns: int = field(default_factory=time.time_ns)
    v: int = ENTRY_VERSION

    @property
    def operation(self) -> str:
        if len(self.keys) > 1:
            return "batch"
        return self.keys[0].op if self.keys else ""

    @property
    def time(self) -> str:
        return datetime.fromtimestamp(self.time_ns / 1e9, tz=UTC).isoformat(timespec="milliseconds")

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["keys"] = [asdict(k) for k in self.keys]
        body["operation"] = self.operation
        body["time"] = self.time
        return body

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> AuditEntry:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("an audit entry is a JSON object")
        keys = tuple(KeyWrite(str(k.get("key", "")), str(k.get("op", ""))) for k in body.get("keys") or [])
        return cls(
            source=str(body.get("source", "")),
            user=str(body.get("user", "")),
            verified=bool(body.get("verified")),
            keys=keys,
            outcome=str(body.get("outcome", "")),
            verified_by=str(body.get("verified_by", "")),
            credential={str(k): str(v) for k, v in (body.get("credential") or {}).items()},
            claimed_user=str(body.get("claimed_user", "")),
            action=str(body.get("action", "")),
            action_claimed=bool(body.get("action_claimed")),
            address=str(body.get("address", "")),
            request_id=str(body.get("request_id", "")),
            seq=int(body.get("seq") or 0),
            id=str(body.get("id", "")),
            time_ns=int(body.get("time_ns") or 0),
            v=int(body.get("v") or ENTRY_VERSION),
        )


def claim(value: str) -> str:
    """A client's header value as recorded: printable, cut to :data:`MAX_CLAIM`."""
    return "".join(c for c in value if c.isprintable())[:MAX_CLAIM]


def local_user() -> str:
    """Who runs this process as the open cluster's CLI claims it: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


class AuditLog:
    """Appends entries to ``ZATTERA_AUDIT``. A failure is logged, never raised: the write it describes has
    happened (or not) already, and is told to its writer either way."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.failures = 0

    async def record(self, entry: AuditEntry) -> None:
        try:
            await self._conn.js.publish(
                audit_subject(entry.source),
                entry.to_json(),
                stream=AUDIT_STREAM,
                timeout=PUBLISH_TIMEOUT,
                headers={"Nats-Msg-Id": entry.id},
            )
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            self.failures += 1
            log.warning("audit: entry %s (%s by %s) not recorded: %s", entry.id, entry.outcome, entry.user, exc)


@dataclass(frozen=True)
class Auditor:
    """Who a writer acts for, stamped on each entry it records (everything but the keys and outcome)."""

    source: str
    user: str
    verified: bool
    verified_by: str = ""
    action: str = ""
    action_claimed: bool = False
    address: str = ""
    request_id: str = field(default_factory=new_id)
    credential: dict[str, str] = field(default_factory=dict)
    claimed_user: str = ""

    def entry(self, keys: Sequence[KeyWrite], outcome: str, seq: int = 0) -> AuditEntry:
        return AuditEntry(keys=tuple(keys), outcome=outcome, seq=seq, **asdict(self))


def txn_keys(txn: Txn) -> list[KeyWrite]:
    return [KeyWrite(op.key, "delete" if op.is_delete else "put") for op in txn.ops]


def outcome_of(error: BaseException | None) -> str:
    if error is None:
        return "ok"
    kind = "conflict" if "Conflict" in type(error).__name__ else "error"
    return f"{kind}: {error}"


class AuditedWriter(Writer):
    """A writer that records each transaction it commits (after its outcome is known) as an audit entry of
    ``auditor``; with ``log`` None it records nothing (a secured CLI: the relay records)."""

    def __init__(self, conn: Connection, view: StateView, auditor: Auditor, audit: AuditLog | None) -> None:
        super().__init__(conn, view)
        self.auditor = auditor
        self._audit = audit

    def for_auditor(self, auditor: Auditor) -> AuditedWriter:
        return AuditedWriter(self._conn, self._view, auditor, self._audit)

    async def commit_many(self, txns: Sequence[Txn]) -> list[TxnError | None]:
        try:
            results = await super().commit_many(txns)
        except Exception as exc:
            await self._record([(t, exc) for t in txns if t])
            raise
        await self._record([(t, r) for t, r in zip(txns, results, strict=True) if t])
        return results

    async def _record(self, outcomes: list[tuple[Txn, BaseException | None]]) -> None:
        if self._audit is None or not outcomes:
            return
        entries = [self.auditor.entry(txn_keys(txn), outcome_of(error)) for txn, error in outcomes]
        await asyncio.gather(*(self._audit.record(e) for e in entries))


def with_action(auditor: Auditor, action: str) -> Auditor:
    return replace(auditor, action=action)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_LIMIT = 100


def parse_since(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``7d`` → seconds; a ValueError saying what is expected otherwise."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError("expected a duration like 30m, 2h or 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def select(entries: Sequence[AuditEntry], *, user: str = "", limit: int = DEFAULT_LIMIT) -> list[AuditEntry]:
    """Newest first, only ``user``'s (its name, or its credential's public key) when given, at most
    ``limit`` (0: all)."""
    chosen = [e for e in reversed(entries) if not user or user in (e.user, e.credential.get("user_key"))]
    return chosen[:limit] if limit else chosen


async def read_entries(
    conn: Connection,
    *,
    since_ns: int = 0,
    scan: int = 10_000,
    idle: float = 1.0,
) -> list[AuditEntry]:
    """The stored entries, oldest first: from ``since_ns`` (0: the newest ``scan``), read through a watch
    control opens (``zattera.watch.open``: an operator credential creates no consumer)."""
    from shared.watches import WatchSpec
    from shared.watches import follow as follow_watch

    try:
        info = await conn.js.stream_info(AUDIT_STREAM)
    except NotFoundError:
        return []
    end = info.state.last_seq
    if info.state.messages == 0 or end == 0:
        return []
    if since_ns:
        spec = WatchSpec(AUDIT_STREAM, (f"{AUDIT_SUBJECT_PREFIX}>",), "by_start_time", start_time_ns=since_ns)
    else:
        start = max(1, end - scan + 1)
        spec = WatchSpec(AUDIT_STREAM, (f"{AUDIT_SUBJECT_PREFIX}>",), "by_start_sequence", start_seq=start)
    sub = await follow_watch(conn, spec)
    found: list[AuditEntry] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle)
            except TimeoutError:
                break  # nothing stored after the last one read
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                found.append(AuditEntry.from_json(msg.data))
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= end:
                break
    finally:
        await sub.unsubscribe()
    return found
