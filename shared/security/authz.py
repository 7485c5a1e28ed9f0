"""The authorising path of team members (docs/teams.md): the control side of the ``MEMBERS`` account.

A member's credential (a person's, or the one an API token wraps) carries only its identity: user public key
and name, which the server sets in ``Nats-Request-Info`` on every request through an import. Here, with the
control credential, every such request is checked against the caller's record in ``zattera-teams``
(:mod:`shared.teams`, read at each request: a removed user or a revoked token is refused at its next
request) before anything is written or answered:

* **state writes** arrive through the relay (:mod:`shared.security.relay` calls :meth:`Authz.check_write`):
  the stored and the new value must both be in a project whose role allows the change;
* **state reads** (``$JS.API.DIRECT.GET.KV_zattera-state…``, single or ``multi_last`` batch) and **stream
  infos** are renamed by the account's import to ``zattera.authz.<the API subject>``; :meth:`Authz.on_read`
  asks JetStream itself and passes on only the messages of the caller's projects (a refused key answers 404,
  like a missing one);
* **watches** (``zattera.watch.open``): a member may follow the log stream of an environment of its projects
  only (:meth:`Authz.authorize_watch`).

It also mints member credentials for admins (``zattera.teams.issue``): the member role's signing key stays
on the control side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import APP_LOGS_SUBJECT_PREFIX, env_of_stream
from shared.connection import Connection
from shared.jetstream import is_delete_marker
from shared.provisioning import recorded_replicas
from shared.security.accounts import AUTHZ_PREFIX
from shared.security.authority import RoleIssuer
from shared.security.callers import REQUEST_INFO_HEADER, Caller, answerable, caller
from shared.security.creds import creds_text
from shared.security.nkeyjwt import KeyKind, KeyPair
from shared.security.permissions import JS, object_stream
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX, SOURCES_STORE, STATE_PREFIX, STATE_STREAM
from shared.teams import (
    DEPLOYER,
    FEED_CAUGHT_UP,
    FEED_HEARTBEAT,
    FEED_HEARTBEAT_STATUS,
    FEED_IDLE,
    FEED_PENDING_HEADER,
    FEED_RECHECK,
    FEED_SEQ_HEADER,
    FEED_STATUS_HEADER,
    FEED_SUBJECT_HEADER,
    MEMBER_READS_CLUSTER,
    OWNER,
    PROJECT_KINDS,
    TEAMS_BUCKET,
    TEAMS_FEED_SUBJECT,
    TOKEN_USER_PREFIX,
    Member,
    Token,
    User,
    decoded,
    may_read,
    may_write,
    project_of,
    push_subject,
    token_key,
    user_key,
    value_project,
)
from shared.watches import STATE_WATCH, BadWatch, Watch, WatchSpec, WatchUnavailable, follow

log = logging.getLogger(__name__)

DIRECT_GET = f"{JS}.DIRECT.GET."
STREAM_INFO = f"{JS}.STREAM.INFO."
READ_TIMEOUT = 5.0
ADMIN_TIMEOUT = 60.0
"""An admin's cluster-wide request passed on (a node's removal waits for its NATS server's peer removal)."""
SOURCES_STREAM = object_stream(SOURCES_STORE)
ENV_REFERRING = frozenset({K.VIP, K.GIT_HOOK, K.GIT_DEPLOY})
EVENT_HEADERS = frozenset({"Nats-Msg-Id", "traceparent", "tracestate"})


def _status(code: str, description: str) -> dict[str, str]:
    return {"Status": code, "Description": description}


def api_error(description: str, code: int = 403) -> bytes:
    return json.dumps({"error": {"code": code, "err_code": 0, "description": description}}).encode()


async def ensure_teams_bucket(conn: Connection) -> KeyValue:
    try:
        return await conn.js.key_value(TEAMS_BUCKET)
    except BucketNotFoundError:
        replicas = await recorded_replicas(conn.js)
        # Direct reads: admins list the records with one batch get (an operator creates no consumer).
        config = KeyValueConfig(bucket=TEAMS_BUCKET, history=1, replicas=replicas, direct=True)
        return await conn.js.create_key_value(config)


class Authz:
    """The checks and handlers; ``members_account``: the public key of ``MEMBERS``; ``issuer``: the member role's
    issuer (None: no credentials are minted here); ``admins_account``: who may ask for one (``OPERATORS``)."""

    def __init__(
        self,
        conn: Connection,
        members_account: str,
        *,
        issuer: RoleIssuer | None = None,
        admins_account: str = "",
        now: Callable[[], float] = time.time,
    ) -> None:
        self._conn = conn
        self.members_account = members_account
        self._issuer = issuer
        self._admins_account = admins_account
        self._now = now
        self._kv: KeyValue | None = None
        self._projects: dict[str, str] = {}
        """State key → its project, as last seen readable (a pushed delete has no value to tell it)."""
        self._feeds: dict[tuple[str, str], _Feed] = {}
        self._closing: set[asyncio.Future[None]] = set()
        self._known: dict[str, tuple[int, str]] = {}
        self._index: dict[str, tuple[int, bytes, dict[str, str], str]] = {}
        """State key → (revision, value, the headers a direct get answers with, project or ``env:<id>``)."""
        self._applied = 0
        self._index_moved = asyncio.Event()
        self._index_watch: Watch | None = None
        """State key → (revision, its project or ``env:<id>``) as last decoded: a member's snapshot read decodes
        only the values that changed since the last read (issue 39 item 4: the read's cost)."""

    async def start(self) -> None:
        self._kv = await ensure_teams_bucket(self._conn)
        if self._index_watch is None:
            try:
                self._index_watch = await follow(self._conn, STATE_WATCH, self._on_index)
            except (BadWatch, WatchUnavailable, TimeoutError, nats.errors.Error) as exc:
                # Members' snapshot reads are then filtered from JetStream's answer (slower, same result).
                log.warning("authz: no state index (%s): members' snapshots are read from JetStream", exc)

    # ------------------------------------------------------------------------------------------ state index

    async def _on_index(self, msg: Msg) -> None:
        """One change of the state, as control's own watch delivers it: the index members' snapshots are
        answered from (item 4 of issue 39: no JetStream batch to receive and decode per request)."""
        seq = msg.metadata.sequence.stream
        key = msg.subject.removeprefix(STATE_PREFIX)
        deleted = is_delete_marker(msg.headers)
        previous = self._index.get(key)
        # A tombstone keeps the project of the value it replaced: a pushed delete is shown to whoever saw it.
        project = (previous[3] if previous else "") if deleted else _project_or_env(key, bytes(msg.data))
        headers = dict(msg.headers or {}) | {
            "Nats-Stream": STATE_STREAM,
            "Nats-Subject": msg.subject,
            "Nats-Sequence": str(seq),
        }
        self._index[key] = (seq, b"" if deleted else bytes(msg.data), headers, project)
        if seq > self._applied:
            self._applied = seq
            self._index_moved.set()
            self._index_moved = asyncio.Event()

    async def _stream_last_seq(self) -> int:
        """The state stream's newest sequence: one small direct get (the last message of any key)."""
        body = json.dumps({"last_by_subj": f"{STATE_PREFIX}>"}).encode()
        answer = await self._conn.nc.request(f"{DIRECT_GET}{STATE_STREAM}", body, timeout=READ_TIMEOUT)
        headers = answer.headers or {}
        return 0 if headers.get("Status") else int(headers.get("Nats-Sequence", 0) or 0)

    async def _index_reaches(self, seq: int) -> bool:
        """Wait (at most READ_TIMEOUT) until the index holds every change up to ``seq``: read-your-writes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READ_TIMEOUT
        while self._applied < seq:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._index_moved.wait(), left)
        return True

    def _index_project(self, key: str, project: str) -> str:
        if project.startswith("env:"):
            env = self._index.get(f"{K.ENV}.{project[4:]}")
            return env[3] if env is not None and not env[3].startswith("env:") else ""
        return project

    async def _answer_from_index(self, msg: Msg, who: Caller | None) -> bool:
        """A member's whole-state snapshot (the CLI's ``multi_last``) from the index, filtered, in JetStream's
        batch form; False when the index cannot answer (not running, or behind the stream for READ_TIMEOUT)."""
        if self._index_watch is None:
            return False
        member, last = await asyncio.gather(self._caller_member(who), self._stream_last_seq())
        nc = self._conn.nc
        if isinstance(member, str):
            await nc.publish(msg.reply, b"", headers=_status("404", f"not authorised: {member}"))
            return True
        if not await self._index_reaches(last):
            return False
        for key, (_, data, headers, project) in sorted(self._index.items(), key=lambda item: item[1][0]):
            kind = key.split(".", 1)[0]
            if member.admin or kind in MEMBER_READS_CLUSTER:
                allowed = True
            else:
                found = self._index_project(key, project)
                allowed = bool(found and member.role(found))
            if allowed:
                await nc.publish(msg.reply, data, headers=headers)
        await nc.publish(msg.reply, b"", headers=_status("204", "EOB"))
        return True

    async def _record(self, key: str) -> bytes | None:
        if self._kv is None:
            await self.start()
        assert self._kv is not None
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        return entry.value or None

    def is_member(self, who: Caller | None) -> bool:
        return who is not None and who.account == self.members_account

    async def member(self, who: Caller) -> Member | str:
        """The caller's grants, or why it is refused (unknown, removed, re-issued, revoked, expired)."""
        if who.name.startswith(TOKEN_USER_PREFIX):
            name = who.name[len(TOKEN_USER_PREFIX) :]
            raw = await self._record(token_key(name))
            if raw is None:
                return f"token {name!r} does not exist (removed?)"
            token = Token.from_json(raw)
            if token.user_key != who.user:
                return f"token {name!r} was re-issued: this credential is no longer valid"
            why = token.usable(self._now())
            if why:
                return why
            return Member(who.name, {token.project_id: token.role}, token=name)
        raw = await self._record(user_key(who.name))
        if raw is None:
            return f"user {who.name!r} does not exist (removed?)"
        user = User.from_json(raw)
        if user.user_key != who.user:
            return f"user {who.name!r}: this credential was replaced by a newer one"
        return Member(who.name, dict(user.grants), admin=user.admin)

    # ------------------------------------------------------------------------------------------ state values

    async def _stored(self, subject: str) -> bytes | None:
        try:
            msg = await self._conn.js.get_last_msg(STATE_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        if is_delete_marker(msg.headers) or not msg.data:
            return None
        return bytes(msg.data)

    async def _env_projects(self, *values: tuple[str, bytes | None]) -> dict[str, str]:
        """Environment id → project id for the values that name only an environment."""
        found: dict[str, str] = {}
        for key, data in values:
            if key.split(".", 1)[0] not in ENV_REFERRING or not data:
                continue
            try:
                env_id = str(getattr(K.decode(key.split(".", 1)[0], data), "environment_id", ""))
            except Exception:
                continue
            stored = await self._stored(f"{STATE_PREFIX}{K.env(env_id)}") if env_id else None
            if stored:
                found[env_id] = str(getattr(K.decode(K.ENV, stored), "project_id", ""))
        return found

    async def check_write(self, who: Caller, key_subject: str, data: bytes, headers: dict[str, str]) -> str:
        """ "" when the member may write ``key_subject`` (a ``$KV.zattera-state.<key>`` subject), else why not."""
        # The caller's record and the stored value, read at once (both are needed; each is one direct get).
        member, old = await asyncio.gather(self.member(who), self._stored(key_subject))
        if isinstance(member, str):
            return member
        key = key_subject.removeprefix(STATE_PREFIX)
        delete = bool(headers.get("KV-Operation"))
        new = None if delete else data
        envs = await self._env_projects((key, old), (key, new))
        return may_write(member, key, new, old, envs, delete=delete)

    # ----------------------------------------------------------------------------------------------- reads

    async def _ask(self, api: str, body: bytes, headers: dict[str, str] | None, *, batch: bool) -> list[Msg]:
        """JetStream's answer(s) to a read, as the control credential gets them (a batch: up to its status)."""
        nc = self._conn.nc
        inbox = nc.new_inbox()
        found: list[Msg] = []
        complete: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def collect(msg: Msg) -> None:
            found.append(msg)
            if (not batch or (msg.headers or {}).get("Status")) and not complete.done():
                complete.set_result(None)

        sub = await nc.subscribe(inbox, cb=collect)
        try:
            await nc.publish(api, body, reply=inbox, headers=headers or None)
            await asyncio.wait_for(complete, READ_TIMEOUT)
            return found
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _stream_allowed(self, member: Member, stream: str) -> bool:
        if member.admin:
            return True
        if stream in (STATE_STREAM, SOURCES_STREAM, EVENTS_STREAM):  # events: counts and kinds, no payload
            return True
        env_id = env_of_stream(stream)
        if not env_id:
            return False
        stored = await self._stored(f"{STATE_PREFIX}{K.env(env_id)}")
        return stored is not None and may_read(member, K.env(env_id), stored, {})

    def read_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """The handler of ``zattera.authz.>``: members' state reads and stream infos."""

        pending: set[asyncio.Task[None]] = set()

        async def answer(msg: Msg) -> None:
            api = msg.subject[len(AUTHZ_PREFIX) :]
            try:
                await self._answer_read(msg, caller(msg), api)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("authz: %s not answered: %s", api, exc)

        async def on_read(msg: Msg) -> None:
            if not answerable(msg):
                return
            # Each in its own task: one member's slow read holds up no other request.
            task = asyncio.ensure_future(answer(msg))
            pending.add(task)
            task.add_done_callback(pending.discard)

        return on_read

    async def _caller_member(self, who: Caller | None) -> Member | str:
        return await self.member(who) if who is not None and self.is_member(who) else "not a team member"

    async def _answer_read(self, msg: Msg, who: Caller | None, api: str) -> None:
        nc = self._conn.nc
        if api.startswith(DIRECT_GET) and api[len(DIRECT_GET) :].split(".", 1)[0] == STATE_STREAM:
            await self._answer_state_read(msg, who, api)
            return
        member = await self._caller_member(who)
        if api.startswith(EVENTS_SUBJECT_PREFIX):
            why = member if isinstance(member, str) else _event_refusal(member, msg.data)
            if why:
                await nc.publish(msg.reply, api_error(f"not authorised: {why}"))
                return
            kept = {k: v for k, v in (msg.headers or {}).items() if k in EVENT_HEADERS}
            answer = await nc.request(api, msg.data, timeout=READ_TIMEOUT, headers=kept or None)
            await nc.publish(msg.reply, answer.data, headers=answer.headers)
            return
        if api.startswith(STREAM_INFO):
            stream = api[len(STREAM_INFO) :]
            if isinstance(member, str) or not await self._stream_allowed(member, stream):
                why = member if isinstance(member, str) else f"stream {stream} is not readable with your grants"
                await nc.publish(msg.reply, api_error(f"not authorised: {why}"))
                return
            answer = await nc.request(api, msg.data, timeout=READ_TIMEOUT)
            await nc.publish(msg.reply, answer.data, headers=answer.headers)
            return
        stream = api[len(DIRECT_GET) :].split(".", 1)[0] if api.startswith(DIRECT_GET) else ""
        admin = not isinstance(member, str) and member.admin
        if stream and (admin or (stream == SOURCES_STREAM and not isinstance(member, str))):
            # Content-addressed source archives for every member; any stream for an admin.
            for answer in await self._ask(api, msg.data, None, batch=_is_batch(msg.data)):
                await nc.publish(msg.reply, answer.data, headers=answer.headers)
            return
        if not stream:  # a cluster-wide action (MEMBER_ADMIN_SUBJECTS): admins only, passed on as control
            if not admin:
                why = member if isinstance(member, str) else f"{api}: cluster-wide, admins only"
                await nc.publish(msg.reply, api_error(f"not authorised: {why}"))
                return
            kept = {k: v for k, v in (msg.headers or {}).items() if k != REQUEST_INFO_HEADER}
            answer = await nc.request(api, msg.data, timeout=ADMIN_TIMEOUT, headers=kept or None)
            await nc.publish(msg.reply, answer.data, headers=answer.headers)
            return
        why = member if isinstance(member, str) else f"{api}: not an authorised read"
        await nc.publish(msg.reply, b"", headers=_status("404", f"not authorised: {why}"))

    async def _answer_state_read(self, msg: Msg, who: Caller | None, api: str) -> None:
        """A state read: JetStream's answer and the caller's record are fetched at once, then filtered (a
        whole-state snapshot: answered from the index when it can)."""
        nc = self._conn.nc
        batch = _is_batch(msg.data)
        whole = batch and api == f"{DIRECT_GET}{STATE_STREAM}" and _whole_state(msg.data)
        if whole and await self._answer_from_index(msg, who):
            return
        member, answers = await asyncio.gather(self._caller_member(who), self._ask(api, msg.data, None, batch=batch))
        if isinstance(member, str):
            await nc.publish(msg.reply, b"", headers=_status("404", f"not authorised: {member}"))
            return
        # Each value decoded once: its project, or the environment it names (resolved below).
        projects: list[tuple[Msg, str, str]] = []  # (answer, key, project or "env:<id>")
        envs: dict[str, str] = {}
        for answer in answers:
            headers = answer.headers or {}
            if headers.get("Status"):
                projects.append((answer, "", ""))
                continue
            key = headers.get("Nats-Subject", "").removeprefix(STATE_PREFIX)
            seq = int(headers.get("Nats-Sequence", 0) or 0)
            known = self._known.get(key)
            if known is not None and known[0] == seq and seq:
                project = known[1]  # this very revision was decoded before: no need to decode it again
            else:
                project = _project_or_env(key, None if is_delete_marker(headers) else answer.data)
                self._known[key] = (seq, project)
            if key.startswith(f"{K.ENV}."):
                envs[key.removeprefix(f"{K.ENV}.")] = project
            projects.append((answer, key, project))
        for answer, key, project in projects:
            if key:
                if project.startswith("env:"):
                    env_id = project[4:]
                    if env_id not in envs:
                        envs |= await self._env_projects((key, answer.data))
                    project = envs.get(env_id, "")
                allowed = (
                    member.admin
                    or key.split(".", 1)[0] in MEMBER_READS_CLUSTER
                    or bool(project and member.role(project))
                )
                if allowed and project:
                    self._projects[key] = project
                if not allowed:
                    if not batch:
                        await nc.publish(msg.reply, b"", headers=_status("404", "Message Not Found"))
                    continue
            await nc.publish(msg.reply, answer.data, headers=answer.headers)

    # ----------------------------------------------------------------------------------------------- events

    def events_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.events``: a page of the caller's projects' events (shared.teams.MemberEvents)."""

        async def on_events(msg: Msg) -> None:
            if not answerable(msg):
                return
            member = await self._caller_member(caller(msg))
            try:
                reply = await self._events_page(member, msg.data)
            except (TimeoutError, nats.errors.Error, ValueError, KeyError, TypeError) as exc:
                reply = {"error": f"events not read: {exc or type(exc).__name__}"}
            await self._conn.nc.publish(msg.reply, json.dumps(reply).encode())

        return on_events

    async def _events_page(self, member: Member | str, body: bytes) -> dict[str, object]:
        if isinstance(member, str):
            return {"error": f"not authorised: {member}"}
        request = json.loads(body or b"{}")
        start = max(int(request.get("start_seq", 1)), 1)
        subject = str(request.get("subject") or f"{EVENTS_SUBJECT_PREFIX}>")
        if not subject.startswith(EVENTS_SUBJECT_PREFIX) or " " in subject:
            return {"error": f"subject: under {EVENTS_SUBJECT_PREFIX}"}
        limit = min(max(int(request.get("limit", 100)), 1), 256)
        get = json.dumps({"seq": start, "batch": limit, "next_by_subj": subject}).encode()
        answers = await self._ask(f"{DIRECT_GET}{EVENTS_STREAM}", get, None, batch=True)
        events: list[dict[str, object]] = []
        next_seq, last_seq = start, 0
        for answer in answers:
            headers = answer.headers or {}
            if headers.get("Status"):
                continue
            seq = int(headers.get("Nats-Sequence", 0))
            next_seq = max(next_seq, seq + 1)
            try:
                project = pb.Event.FromString(answer.data).project_id
            except Exception:
                continue
            if member.admin or member.role(project):
                pending = int(headers.get("Nats-Num-Pending", 0) or 0)
                events.append({"seq": seq, "pending": pending, "data": base64.b64encode(answer.data).decode()})
        return {"events": events, "next_seq": next_seq, "last_seq": max(last_seq, next_seq - 1)}

    # ---------------------------------------------------------------------------------------------- watches

    async def authorize_watch(self, msg: Msg, spec: WatchSpec) -> str:
        """ "" for callers other than members; a member may follow its projects' environments' logs only."""
        who = caller(msg)
        if who is None or not self.is_member(who):
            return ""
        # A member pulls no consumer (its permissions allow none): what it follows is pushed (:meth:`feed_handler`).
        return f"not authorised: team members follow through {TEAMS_FEED_SUBJECT} (docs/teams.md)"

    # ------------------------------------------------------------------------------------------------ feeds

    def feed_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.feed``: open a pushed feed of a stream for a member (docs/teams.md, "Feeds")."""

        async def on_feed(msg: Msg) -> None:
            if not answerable(msg):
                return
            try:
                reply = await self._open_feed(caller(msg), msg.data)
            except (BadWatch, WatchUnavailable) as exc:
                reply = {"error": str(exc)}
            except (TimeoutError, nats.errors.Error) as exc:
                reply = {"error": f"feed not opened: {exc or type(exc).__name__}"}
            await self._conn.nc.publish(msg.reply, json.dumps(reply).encode())

        return on_feed

    def keep_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.feedkeep`` (every join service gets it): a reader's keepalive or close of its feed."""

        async def on_keep(msg: Msg) -> None:
            who = caller(msg)
            try:
                request = json.loads(msg.data or b"{}")
                feed_id = str(request.get("id", ""))
            except (ValueError, AttributeError):
                return
            feed = self._feeds.get((who.user, feed_id)) if who is not None and self.is_member(who) else None
            if feed is None:
                return
            if request.get("close"):
                await self._end_feed(feed, "")
                return
            feed.kept = time.monotonic()
            await self._recheck(feed, force=True)

        return on_keep

    async def _open_feed(self, who: Caller | None, body: bytes) -> dict[str, str]:
        if who is None or not self.is_member(who):
            raise BadWatch("not authorised: feeds are for team members (others open watches)")
        member = await self.member(who)
        if isinstance(member, str):
            raise BadWatch(f"not authorised: {member}")
        try:
            feed_id = str(json.loads(body or b"{}").get("id", ""))
        except (ValueError, AttributeError):
            feed_id = ""
        if not FEED_ID.match(feed_id):
            raise BadWatch("id: 1-40 of a-z, A-Z, 0-9, '-', '_'")
        spec = WatchSpec.from_json(body)
        if spec.stream not in (STATE_STREAM, EVENTS_STREAM):
            env_id = env_of_stream(spec.stream)
            logs = bool(env_id) and all(s.startswith(f"{APP_LOGS_SUBJECT_PREFIX}{env_id}.") for s in spec.subjects)
            if not member.admin and not (logs and await self._stream_allowed(member, spec.stream)):
                raise BadWatch(
                    f"not authorised: stream {spec.stream}: team members follow the state, their projects' "
                    "events and their environments' logs"
                )
        old = self._feeds.pop((who.user, feed_id), None)
        if old is not None:
            await self._end_feed(old, "")
        feed = _Feed(who, member, push_subject(who.user, feed_id), spec.stream, checked=self._now())
        self._feeds[(who.user, feed_id)] = feed
        try:
            if spec.stream in (STATE_STREAM, EVENTS_STREAM):
                # Filtered message by message: control follows the stream and re-publishes what passes.
                feed.watch = await follow(self._conn, spec, partial(self._forward, feed))
            else:
                # A log stream (or, for an admin, any other stream): nothing to filter, so JetStream pushes it
                # straight to the member's subject (no hop through control; the subject, sequence and pending
                # count travel as in any delivery). Gone 30 s after the member stops listening, or at its end.
                config = spec.consumer_config(f"feed-{uuid.uuid4().hex[:20]}")
                config.deliver_subject = feed.subject
                config.idle_heartbeat = FEED_HEARTBEAT
                info = await self._conn.js.add_consumer(spec.stream, config)
                feed.consumer = str(info.name)
                if not info.num_pending:
                    await self._status(feed, FEED_CAUGHT_UP)
        except BaseException:
            self._feeds.pop((who.user, feed_id), None)
            raise
        feed.task = asyncio.ensure_future(self._tend(feed))
        return {"subject": feed.subject}

    async def _recheck(self, feed: _Feed, *, force: bool = False) -> bool:
        """The caller's record read again (at most every FEED_RECHECK s unless forced); False: the feed ended."""
        now = self._now()
        if not force and now - feed.checked < FEED_RECHECK:
            return True
        feed.checked = now
        member = await self.member(feed.who)
        if isinstance(member, str):
            await self._end_feed(feed, f"not authorised: {member}")
            return False
        feed.member = member
        if feed.stream not in (STATE_STREAM, EVENTS_STREAM) and not await self._stream_allowed(member, feed.stream):
            await self._end_feed(feed, f"not authorised: stream {feed.stream} is not readable with your grants")
            return False
        return True

    async def _visible(self, feed: _Feed, msg: Msg) -> bool:
        member = feed.member
        if member.admin:
            return True
        if feed.stream == EVENTS_STREAM:
            try:
                return bool(member.role(pb.Event.FromString(msg.data).project_id))
            except Exception:
                return False
        if feed.stream != STATE_STREAM:
            return True  # a log stream of a granted environment (checked when opened and at each recheck)
        key = msg.subject.removeprefix(STATE_PREFIX)
        kind = key.split(".", 1)[0]
        if kind in MEMBER_READS_CLUSTER:
            return True
        data = None if is_delete_marker(msg.headers) else msg.data
        if not data:  # a delete: visible when the key was, as last seen (the index's tombstone keeps its project)
            indexed = self._index.get(key)
            project = self._index_project(key, indexed[3]) if indexed else self._projects.get(key, "")
            return bool(member.role(project))
        project = value_project(key, data, {})
        if not project and kind in ENV_REFERRING:
            project = value_project(key, data, await self._env_projects((key, data)))
        if project:
            self._projects[key] = project
        return bool(project and member.role(project))

    async def _forward(self, feed: _Feed, msg: Msg) -> None:
        if feed.ended or not await self._recheck(feed):
            return
        if not await self._visible(feed, msg):
            return
        meta = msg.metadata
        headers = dict(msg.headers or {}) | {
            FEED_SUBJECT_HEADER: msg.subject,
            FEED_SEQ_HEADER: str(meta.sequence.stream),
            FEED_PENDING_HEADER: str(meta.num_pending),
        }
        feed.sent = time.monotonic()
        await self._conn.nc.publish(feed.subject, msg.data, headers=headers)

    async def _status(self, feed: _Feed, status: str) -> None:
        feed.sent = time.monotonic()
        await self._conn.nc.publish(feed.subject, b"", headers={FEED_STATUS_HEADER: status})

    async def _tend(self, feed: _Feed) -> None:
        """Tells the reader once the stored messages are all sent, then heartbeats; ends a forgotten feed."""
        with contextlib.suppress(nats.errors.Error):
            if feed.watch is not None:
                await feed.watch.caught_up.wait()
                await self._status(feed, FEED_CAUGHT_UP)
            while not feed.ended:
                await asyncio.sleep(FEED_HEARTBEAT)
                if time.monotonic() - feed.kept > FEED_IDLE:
                    await self._end_feed(feed, "no keepalive")
                    return
                if feed.watch is not None and time.monotonic() - feed.sent >= FEED_HEARTBEAT:
                    await self._status(feed, FEED_HEARTBEAT_STATUS)  # a pushed consumer has JetStream's own

    async def _end_feed(self, feed: _Feed, why: str) -> None:
        if feed.ended:
            return
        feed.ended = True
        if self._feeds.get((feed.who.user, feed.subject.rsplit(".", 1)[-1])) is feed:
            del self._feeds[(feed.who.user, feed.subject.rsplit(".", 1)[-1])]
        if why:
            with contextlib.suppress(nats.errors.Error):
                await self._status(feed, f"end: {why}")
        if feed.watch is not None:
            watch, feed.watch = feed.watch, None
            # In a task of its own: this may run inside the watch's own callback.
            closing = asyncio.ensure_future(watch.unsubscribe())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if feed.consumer:
            closing = asyncio.ensure_future(self._delete_consumer(feed.stream, feed.consumer))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if feed.task is not None and feed.task is not asyncio.current_task():
            feed.task.cancel()

    async def _delete_consumer(self, stream: str, name: str) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await self._conn.js.delete_consumer(stream, name)

    async def stop(self) -> None:
        for feed in list(self._feeds.values()):
            await self._end_feed(feed, "")
        watch, self._index_watch = self._index_watch, None
        if watch is not None:
            await watch.unsubscribe()

    # ---------------------------------------------------------------------------------------------- issuing

    def issue_handler(self) -> Callable[[Msg], Awaitable[None]]:
        """``zattera.teams.issue``: a member credential named ``name``, for an admin (operator) or control."""

        async def on_issue(msg: Msg) -> None:
            if not answerable(msg):
                return
            who = caller(msg)
            reply: dict[str, str]
            if self._issuer is None:
                reply = {"error": "no member signing key on this control service"}
            elif who is not None and who.account != self._admins_account:
                reply = {"error": "not authorised: only admins issue member credentials"}
            else:
                try:
                    name = str(json.loads(msg.data or b"{}").get("name", ""))
                except (ValueError, AttributeError):
                    name = ""
                if not name or " " in name:
                    reply = {"error": "name: required"}
                else:
                    user = KeyPair.generate(KeyKind.USER)
                    creds = creds_text(self._issuer.user_jwt(name, user.public_key), user.seed)
                    reply = {"creds": creds, "user_key": user.public_key}
            await self._conn.nc.publish(msg.reply, json.dumps(reply).encode())

        return on_issue


@dataclass
class _Feed:
    """A member's pushed feed: the stream control follows for it and the subject only it may subscribe to."""

    who: Caller
    member: Member
    subject: str
    stream: str
    watch: Watch | None = None
    consumer: str = ""
    """A pushed consumer's name (a feed JetStream delivers itself)."""
    task: asyncio.Future[None] | None = None
    checked: float = 0.0
    """When the caller's record was last read (the authorising path's clock)."""
    kept: float = field(default_factory=time.monotonic)
    sent: float = field(default_factory=time.monotonic)
    ended: bool = False


FEED_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def _project_or_env(key: str, data: bytes | None) -> str:
    """A value's project, ``env:<id>`` for a value that names only its environment, "" for none."""
    kind, value = decoded(key, data)
    if value is None or kind not in PROJECT_KINDS:
        return ""
    project = project_of(kind, value, {})
    env_ref = str(getattr(value, "environment_id", "") or "")
    return project or (f"env:{env_ref}" if env_ref else "")


def _event_refusal(member: Member, data: bytes) -> str:
    """ "" when the member may announce this event: one of a project it may change (owner or deployer)."""
    try:
        event = pb.Event.FromString(data)
    except Exception:
        return "not an event"
    if not member.admin and member.role(event.project_id) not in (OWNER, DEPLOYER):
        return f"event {event.kind}: needs the owner or deployer role on its project"
    return ""


def _whole_state(body: bytes) -> bool:
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return False
    return bool(request == {"multi_last": [f"{STATE_PREFIX}>"]})


def _is_batch(body: bytes) -> bool:
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return False
    return isinstance(request, dict) and ("multi_last" in request or "batch" in request)
