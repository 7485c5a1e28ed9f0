"""The NATS connection: connect with bounded, patient JetStream requests, TLS and credentials, and the
errors a refused or unreachable cluster raises (ClusterUnavailable, NotAuthorized, PermissionDenied)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.errors import ZatteraError
from shared.subjects import JS_API_PREFIX
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


T = TypeVar("T")


_CRLF = b"\r\n"


_WHITESPACE = re.compile(r"\s")


def _parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's header parser with the same rules, minus its per-character Python loop.

    Every state-bucket message carries a few headers (expected revision, traceparent), and the
    original parser's ``any(c.isspace() for c in key)`` was a third of a view's apply time.
    """
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _WHITESPACE.search(key):
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


ORIGINAL_HEADER_PARSER = NATS.__dict__.get("_parse_header_lines")


if isinstance(ORIGINAL_HEADER_PARSER, staticmethod):
    NATS._parse_header_lines = staticmethod(_parse_header_lines)  # type: ignore[method-assign]


def split_urls(urls: str | list[str]) -> list[str]:
    if isinstance(urls, list):
        return urls
    return [u.strip() for u in urls.split(",") if u.strip()]


ConnectionListener = Callable[[], Awaitable[None]]


RETRY_PAUSE = 0.25


FIRST_ATTEMPT_TIMEOUT = 1.0
LONGEST_ATTEMPT_TIMEOUT = 2.0
"""Attempts wait 1 s, then 2 s each: a request sent during a leader election is never answered, so an
attempt waiting longer only delays the first one sent after the election (up to 9 s after the loss)."""


class ClusterUnavailable(ZatteraError, ConnectionError):
    """JetStream did not answer a request within the bounded wait: the message names what was waited for
    and the servers tried."""


class NotAuthorized(ZatteraError):
    """The server refused the connection's credential (none given to a secured server, an unknown, expired or
    revoked one): the message names the credential and the server's reason. Retrying the same credential
    cannot help, so :func:`connect` raises it at once."""


class PermissionDenied(ZatteraError):
    """The server refused a publish or subscribe of this credential (a permissions violation): the message
    names the credential and the subject it may not use. Raised at once instead of waiting for an answer
    that cannot come."""


_AUTH_REFUSALS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
    "authentication timeout",
)


_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"]+)\"?", re.IGNORECASE)


def describe_credential(creds: str | None) -> str:
    """How errors name a connection's credential: its file and the user it holds, or that there is none."""
    if not creds:
        return "no credential (none given: ZATTERA_NATS_CREDS, --creds of a context)"
    try:
        from shared.security.creds import read_user_jwt
        from shared.security.nkeyjwt import decode_claims

        claims = decode_claims(read_user_jwt(creds))
    except (OSError, ValueError, KeyError):
        return f"the credential {creds}"
    return f"the credential {creds} (user {claims.get('name', '?')!r}, {str(claims.get('sub', '?'))[:12]}…)"


def _auth_refusal(exc: BaseException) -> str | None:
    """The server's reason when ``exc`` is a refused credential (nats-py reports it as a plain error)."""
    text = str(exc).lower()
    return next((reason for reason in _AUTH_REFUSALS if reason in text), None)


def permission_violation(exc: BaseException) -> tuple[str, str] | None:
    """(``publish`` | ``subscribe``, subject lower-cased as nats-py reports it) of a permissions violation."""
    match = _VIOLATION.search(str(exc))
    if match is None:
        return None
    return ("publish" if match.group(1).lower() == "publish" else "subscribe"), match.group(2).lower()


def _unavailable_reply(msg: Msg) -> bool:
    """A JetStream API reply of ``503`` (no stream/meta leader yet: an election is under way)."""
    if b'"code":503' not in msg.data:
        return False
    try:
        return int(json.loads(msg.data).get("error", {}).get("code", 0)) == 503
    except (ValueError, AttributeError):
        return False


class PatientClient(NATS):
    """A client whose JetStream API requests ride out the loss of a server: a request that times out, finds
    no responder or gets ``503`` (a leader election), or whose server drops the connection while it waits,
    is sent again — to whichever server the client has reconnected to — until ``request_deadline``
    seconds have passed; then :class:`ClusterUnavailable`. A request to a stream whose leader just died gets
    no answer at all, even after the election, so attempts are short — 1 s, then 2 s each (a slow but live
    answer still arrives) — and the first one sent after the election is answered.
    Publishes (writes) are never repeated here: the writer (``shared.txn``) sends a single write again with the
    same ``Nats-Msg-Id`` within its commit timeout, and a write whose reply never came is the caller's to check
    (``shared.txn.CommitUnknown``)."""

    def __init__(self, request_deadline: float, credential: str = "") -> None:
        super().__init__()
        self.request_deadline = request_deadline
        self.credential = credential
        """What :class:`PermissionDenied` names (:func:`describe_credential`)."""
        self.denied: dict[str, str] = {}
        """Subject (lower-cased) → "publish"/"subscribe" that the server refused this connection."""

    def note_error(self, exc: BaseException) -> None:
        """An asynchronous error from the server: a permissions violation fails the request it concerns."""
        violation = permission_violation(exc)
        if violation is not None:
            self.denied[violation[1]] = violation[0]

    def _denial(self, subject: str) -> PermissionDenied | None:
        verb = self.denied.get(subject.lower())
        if verb is None:
            return None
        return PermissionDenied(
            f"NATS refused {self.credential or 'this connection'}: it may not {verb} to {subject} "
            "(permissions violation)"
        )

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        if not subject.startswith(JS_API_PREFIX):
            try:
                return await super().request(subject, payload, timeout, old_style, headers)
            except (nats.errors.TimeoutError, TimeoutError):
                if (denial := self._denial(subject)) is not None:
                    raise denial from None
                raise
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.request_deadline, timeout)
        tried: list[str] = []
        last = "no attempt"
        attempt_timeout = FIRST_ATTEMPT_TIMEOUT
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                what = subject[len(JS_API_PREFIX) :]
                raise ClusterUnavailable(
                    f"no answer from JetStream to {what} within {self.request_deadline:.0f}s ({last}); "
                    f"servers tried: {', '.join(tried) or 'none'}"
                )
            server = self.connected_url
            if server is not None and server.netloc not in tried:
                tried.append(server.netloc)
            reconnects = self.stats["reconnects"]
            attempt = asyncio.ensure_future(
                super().request(subject, payload, min(timeout, attempt_timeout, remaining), old_style, headers)
            )
            attempt_timeout = min(attempt_timeout * 2, LONGEST_ATTEMPT_TIMEOUT)
            try:
                msg = await self._unless_reconnected(attempt, reconnects, subject)
            except (nats.errors.TimeoutError, TimeoutError):
                last = "timed out"
                continue
            except (
                nats.errors.NoRespondersError,
                nats.errors.ConnectionReconnectingError,
                nats.errors.StaleConnectionError,
                nats.errors.OutboundBufferLimitError,
            ) as exc:
                last = str(exc) or type(exc).__name__
            else:
                if msg is None:
                    last = "connection lost"
                    continue
                if not _unavailable_reply(msg):
                    return msg
                last = "JetStream unavailable (503)"
            await asyncio.sleep(min(RETRY_PAUSE, max(0.0, deadline - loop.time())))

    async def _unless_reconnected(self, attempt: asyncio.Future[Msg], reconnects: int, subject: str) -> Msg | None:
        """The attempt's reply, or None as soon as the client has reconnected (the reply, if any, went to
        the server that was lost); :class:`PermissionDenied` as soon as the server refused the subject."""
        while True:
            if (denial := self._denial(subject)) is not None:
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, TimeoutError):
                    await attempt
                raise denial
            try:
                done, _ = await asyncio.wait({attempt}, timeout=0.1)
            except asyncio.CancelledError:  # the caller gave up (e.g. the CLI's snapshot answered first)
                attempt.cancel()
                raise
            if done:
                return attempt.result()
            if self.stats["reconnects"] != reconnects:
                attempt.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error, TimeoutError):
                    await attempt
                return None


@dataclass
class Connection:
    """A NATS connection plus reconnect listeners (the state view resyncs on reconnect)."""

    nc: NATS
    js: JetStreamContext
    _on_reconnect: list[ConnectionListener]
    _on_disconnect: list[ConnectionListener]
    closing: bool = False
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the connection closed for good without :meth:`close` (e.g. the server dropped it over a
    protocol error: nats-py then never reconnects). A process left like that is alive but deaf; its
    entry point exits instead, so that a supervisor restarts it."""

    def on_reconnect(self, cb: ConnectionListener) -> None:
        self._on_reconnect.append(cb)

    def on_disconnect(self, cb: ConnectionListener) -> None:
        self._on_disconnect.append(cb)

    async def close(self) -> None:
        self.closing = True
        if self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), timeout=2)
        except (TimeoutError, nats.errors.Error, OSError):
            await self.nc.close()


async def connect(
    urls: str | list[str],
    name: str = "zattera",
    *,
    connect_timeout: float = 5.0,
    creds: str | None = None,
    tls_ca: str | None = None,
    request_deadline: float = 0.0,
    fail_fast: bool = False,
) -> Connection:
    """Connect with unlimited reconnects; the returned connection drains on close.

    ``creds``: a NATS credentials file (secured clusters, see SECURITY.md); the connection then uses the
    private inbox prefix that the role permissions allow. ``tls_ca``: the CA that must have signed the
    server certificate (TLS listener). ``request_deadline`` > 0: JetStream API requests are retried across
    servers that long (:class:`PatientClient`), and fail at once with :class:`PermissionDenied` when the
    server refuses the subject. A refused credential raises :class:`NotAuthorized` at once; ``fail_fast``
    (a command line): once every server was tried and none answered, ConnectionError without waiting for
    ``connect_timeout`` twice (services keep trying: they are retried with backoff).
    """
    on_reconnect: list[ConnectionListener] = []
    on_disconnect: list[ConnectionListener] = []
    holder: list[Connection] = []
    servers = split_urls(urls)
    _websocket_ready(servers)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[Exception] = loop.create_future()
    failures: list[str] = []
    giving_up = False  # the first connect failed: nc.close() then calls the callbacks, which say nothing

    async def reconnected() -> None:
        log.info("nats reconnected", extra={"client": name})
        for cb in list(on_reconnect):
            await cb()

    async def disconnected() -> None:
        if giving_up or (holder and holder[0].closing):
            return
        log.warning("nats disconnected", extra={"client": name})
        for cb in list(on_disconnect):
            await cb()

    async def error(exc: Exception) -> None:
        log.debug("nats error: %s", exc)
        if isinstance(nc, PatientClient):
            nc.note_error(exc)
        if holder or refused.done():
            return
        reason = _auth_refusal(exc)
        if reason is not None:
            refused.set_result(NotAuthorized(f"NATS at {urls} refused {describe_credential(creds)}: {reason}"))
            return
        failures.append(str(exc) or type(exc).__name__)
        if fail_fast and len(failures) >= len(servers):
            refused.set_result(ConnectionError(f"no NATS server reachable at {urls} ({failures[-1]})"))

    async def closed() -> None:
        if holder and not holder[0].closing:
            log.error("nats connection closed for good", extra={"client": name})
            holder[0].lost.set()

    nc = PatientClient(request_deadline, describe_credential(creds)) if request_deadline > 0 else NATS()
    # nats-py retries the initial connect forever when reconnects are unlimited: bound it here and let
    # the caller decide how to back off.
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
            name=name,
            connect_timeout=max(1, int(connect_timeout)),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, used as float seconds
            allow_reconnect=True,
            reconnected_cb=reconnected,
            disconnected_cb=disconnected,
            closed_cb=closed,
            error_cb=error,
            pending_size=64 * 1024 * 1024,
            flush_timeout=10,
            **_security_options(creds, tls_ca),
        )
    )
    either: set[asyncio.Future[Any]] = {connecting, refused}
    try:
        await asyncio.wait(either, timeout=connect_timeout * 2, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        giving_up = True
        await cancel_and_wait(connecting)
        await nc.close()
        raise
    failed = connecting.exception() if connecting.done() else None
    if not connecting.done() or failed is not None:
        giving_up = True
        await cancel_and_wait(connecting)
        await nc.close()
        if refused.done():
            raise refused.result()
        if failed is not None:
            raise failed
        seen = f" ({failures[-1]})" if failures else ""
        raise ConnectionError(f"no NATS server reachable at {urls}{seen}") from None
    conn = Connection(nc=nc, js=nc.jetstream(timeout=10), _on_reconnect=on_reconnect, _on_disconnect=on_disconnect)
    holder.append(conn)
    return conn


def _websocket_ready(servers: list[str]) -> None:
    """Give nats-py's websocket transport aiohttp when a server URL needs it (the CLI imports nats-py without
    it: cli/main.py)."""
    if not any(server.split("://", 1)[0] in ("ws", "wss") for server in servers):
        return
    import aiohttp
    import multidict
    import nats.aio.transport as transport

    if getattr(transport, "aiohttp", None) is None:
        setattr(transport, "aiohttp", aiohttp)  # noqa: B010  # the names the transport reads at run time
        setattr(transport, "multidict", multidict)  # noqa: B010


def _security_options(creds: str | None, tls_ca: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if creds:
        from shared.security.creds import inbox_prefix

        options["user_credentials"] = creds
        options["inbox_prefix"] = inbox_prefix(creds)
    if tls_ca:
        options["tls"] = ssl.create_default_context(cafile=tls_ca)
    return options
