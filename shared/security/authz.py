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

Members' pushed feeds are :mod:`shared.security.feeds`, the state index members' snapshots are answered from
:mod:`shared.security.state_index`, the minting of member credentials for admins (``zattera.teams.issue``,
with :attr:`Authz.issuer`) :mod:`shared.security.member_issue`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.applogs import env_of_stream
from shared.connection import Connection
from shared.jetstream import is_delete_marker
from shared.provisioning import recorded_replicas
from shared.security.accounts import AUTHZ_PREFIX
from shared.security.authority import RoleIssuer
from shared.security.callers import REQUEST_INFO_HEADER, Caller, answerable, caller
from shared.security.permissions import JS, object_stream
from shared.security.state_index import StateIndex, project_or_env
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX, SOURCES_STORE, STATE_PREFIX, STATE_STREAM
from shared.teams import (
    DEPLOYER,
    MEMBER_READS_CLUSTER,
    OWNER,
    TEAMS_BUCKET,
    TEAMS_FEED_SUBJECT,
    TOKEN_USER_PREFIX,
    Member,
    Token,
    User,
    may_read,
    may_write,
    token_key,
    user_key,
    value_project,
)
from shared.watches import WatchSpec

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


@dataclass(eq=False)
class Authz:
    """The checks and handlers; ``members_account``: the public key of ``MEMBERS``; ``issuer``: the member role's
    issuer (None: no credentials are minted here); ``admins_account``: who may ask for one (``OPERATORS``)."""

    conn: Connection
    members_account: str
    _: KW_ONLY
    issuer: RoleIssuer | None = None
    admins_account: str = ""
    now: Callable[[], float] = time.time
    """The authorising path's clock (tokens' expiry, feeds' rechecks)."""

    def __post_init__(self) -> None:
        self._kv: KeyValue | None = None
        self._projects: dict[str, str] = {}
        """State key → its project, as last seen readable (a pushed delete has no value to tell it)."""
        self._known: dict[str, tuple[int, str]] = {}
        """State key → (revision, its project or ``env:<id>``) as last decoded: a member's snapshot read decodes
        only the values that changed since the last read (issue 39 item 4: the read's cost)."""
        self._index = StateIndex(self.conn)

    async def start(self) -> None:
        self._kv = await ensure_teams_bucket(self.conn)
        await self._index.start()

    async def stop(self) -> None:
        await self._index.stop()

    # ------------------------------------------------------------------------------------------ state index

    async def _stream_last_seq(self) -> int:
        """The state stream's newest sequence: one small direct get (the last message of any key)."""
        body = json.dumps({"last_by_subj": f"{STATE_PREFIX}>"}).encode()
        answer = await self.conn.nc.request(f"{DIRECT_GET}{STATE_STREAM}", body, timeout=READ_TIMEOUT)
        headers = answer.headers or {}
        return 0 if headers.get("Status") else int(headers.get("Nats-Sequence", 0) or 0)

    async def _answer_from_index(self, msg: Msg, who: Caller | None) -> bool:
        """A member's whole-state snapshot (the CLI's ``multi_last``) from the index, filtered, in JetStream's
        batch form; False when the index cannot answer (not running, or behind the stream for READ_TIMEOUT)."""
        if not self._index.running:
            return False
        member, last = await asyncio.gather(self._caller_member(who), self._stream_last_seq())
        nc = self.conn.nc
        if isinstance(member, str):
            await nc.publish(msg.reply, b"", headers=_status("404", f"not authorised: {member}"))
            return True
        if not await self._index.reaches(last, READ_TIMEOUT):
            return False
        for key, (_, data, headers, project) in self._index.in_order():
            kind = key.split(".", 1)[0]
            if member.admin or kind in MEMBER_READS_CLUSTER:
                allowed = True
            else:
                found = self._index.project(key, project)
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
            why = token.usable(self.now())
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
            msg = await self.conn.js.get_last_msg(STATE_STREAM, subject, direct=True)
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

    async def visible_state(self, member: Member, msg: Msg) -> bool:
        """Whether a change of the state (as a watch delivers it) may be pushed to ``member``; a delete is
        visible when the key was, as last seen (the index's tombstone keeps its project)."""
        if member.admin:
            return True
        key = msg.subject.removeprefix(STATE_PREFIX)
        kind = key.split(".", 1)[0]
        if kind in MEMBER_READS_CLUSTER:
            return True
        data = None if is_delete_marker(msg.headers) else msg.data
        if not data:
            indexed = self._index.get(key)
            project = self._index.project(key, indexed[3]) if indexed else self._projects.get(key, "")
            return bool(member.role(project))
        project = value_project(key, data, {})
        if not project and kind in ENV_REFERRING:
            project = value_project(key, data, await self._env_projects((key, data)))
        if project:
            self._projects[key] = project
        return bool(project and member.role(project))

    # ----------------------------------------------------------------------------------------------- reads

    async def _ask(self, api: str, body: bytes, headers: dict[str, str] | None, *, batch: bool) -> list[Msg]:
        """JetStream's answer(s) to a read, as the control credential gets them (a batch: up to its status)."""
        nc = self.conn.nc
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

    async def stream_allowed(self, member: Member, stream: str) -> bool:
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
        nc = self.conn.nc
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
            if isinstance(member, str) or not await self.stream_allowed(member, stream):
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
        nc = self.conn.nc
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
                project = project_or_env(key, None if is_delete_marker(headers) else answer.data)
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
            await self.conn.nc.publish(msg.reply, json.dumps(reply).encode())

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
        # A member pulls no consumer (its permissions allow none): what it follows is pushed (shared.security.feeds).
        return f"not authorised: team members follow through {TEAMS_FEED_SUBJECT} (docs/teams.md)"


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
