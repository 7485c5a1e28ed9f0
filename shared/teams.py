"""Teams (docs/teams.md): people, their per-project roles, and API tokens — and what each role may do.

Records live in the ``zattera-teams`` KV bucket (created by the join service, written by admins — the
operator credential —, read by control; members never read it):

* ``user.<name>`` → ``{"name", "admin", "user_key", "grants": {project_id: role}, "created_at"}``; ``user_key``
  is the public key of the member credential issued to that person (``zattera users add``): the authorising
  path takes the caller's identity from ``Nats-Request-Info`` (set by the server) and accepts it only when the
  name *and* key match the record, so removing the user (or re-issuing its credential) revokes the old one.
* ``token.<name>`` → ``{"name", "project_id", "role", "user_key", "sha256", "expires_at", "created_at",
  "created_by", "revoked"}``: an API token. The token string is shown once; only ``sha256(token)`` and the
  public key of the credential it wraps are stored. A revoked, expired or removed token is refused at the next
  request (the record is read at every request).

The decisions are pure functions of the record and the keys' values: :func:`may_write`, :func:`may_read`. Loading and
saving the records is :mod:`shared.teams_store`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import Message

from shared import keys as K
from shared.errors import ZatteraError

TEAMS_BUCKET = "zattera-teams"
TEAMS_STREAM = f"KV_{TEAMS_BUCKET}"
TEAMS_ISSUE_SUBJECT = "zattera.teams.issue"
"""An admin asks control for a member credential (``{"name"}`` → ``{"creds", "user_key"}``): the member role's
signing key never leaves the control side."""
TEAMS_FEED_SUBJECT = "zattera.teams.feed"
"""A member opens a pushed feed of a stream (``{"id", "stream", "subjects", "deliver", "start_seq"}`` →
``{"subject"}`` or ``{"error"}``): the authorising path follows the stream with its own consumer and publishes
the messages the caller may read on :func:`push_subject` (docs/teams.md)."""
TEAMS_FEED_KEEP_SUBJECT = "zattera.teams.feedkeep"
"""``{"id"}`` every :data:`FEED_KEEPALIVE` seconds while the member reads (``{"id", "close": true}`` at the end);
every join service gets it, the one holding the feed acts."""
PUSH_PREFIX = "zattera.push."
FEED_KEEPALIVE = 5.0
FEED_IDLE = 20.0
"""A feed without a keepalive for this long is closed by control (its reader is gone)."""
FEED_HEARTBEAT = 5.0
"""Control publishes a heartbeat this often on an idle feed; a reader that hears nothing for three reopens it."""
FEED_RECHECK = 1.0
"""While a feed delivers, the caller's record is read again at most this often: a removed user or grant, or a
revoked token, stops it within a second of its next message (and at its next keepalive in any case)."""
FEED_SUBJECT_HEADER = "Zattera-Subject"
FEED_SEQ_HEADER = "Zattera-Seq"
FEED_PENDING_HEADER = "Zattera-Pending"
FEED_STATUS_HEADER = "Zattera-Feed"
"""On a status message instead of a stream message: ``caught-up``, ``heartbeat`` or ``end: <why>``."""
FEED_CAUGHT_UP = "caught-up"
FEED_HEARTBEAT_STATUS = "heartbeat"


def push_subject(user_key: str, feed_id: str) -> str:
    """Where a member's feed arrives: only the holder of ``user_key`` may subscribe to it (its role template)."""
    return f"{PUSH_PREFIX}{user_key}.{feed_id}"


OWNER = "owner"
DEPLOYER = "deployer"
VIEWER = "viewer"
ROLES = (OWNER, DEPLOYER, VIEWER)
ADMIN = "admin"
TOKEN_PREFIX = "ztk1_"
TOKEN_USER_PREFIX = "token:"
"""The NATS user name of a token's credential (``token:<name>``): the audit log names tokens by it."""
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_TTL = re.compile(r"^([1-9][0-9]{0,4})([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

PROJECT_KINDS = frozenset(
    {
        K.PROJECT,
        K.APP,
        K.ENV,
        K.RELEASE,
        K.DEPLOYMENT,
        K.BUILD,
        K.JOB,
        K.DOMAIN,
        K.SECRET,
        K.VOLUME,
        K.ASSIGNMENT,
        K.NOTIFY_CHANNEL,
        K.LOG_DRAIN,
        K.VIP,
        K.GIT_HOOK,
        K.GIT_DEPLOY,
    }
)
"""Kinds whose value names a project (``project_id``, or an environment that does)."""

DEPLOYER_WRITES = frozenset({K.ENV, K.RELEASE, K.DEPLOYMENT, K.BUILD, K.JOB, K.SECRET})
"""What a deployer writes: deploy (build, release, deployment), rollback and scale (env, deployment), config
(env vars on the env, secrets), run (job). Only changes to an existing environment: creating or deleting
projects, apps and environments, domains, volumes, hooks and channels is an owner's."""
DEPLOYER_DELETES = frozenset({K.SECRET, K.JOB})
MEMBER_READS_CLUSTER = frozenset({K.SECRETS_KEY})
"""Cluster keys a member reads: the secrets public key (``secrets set`` seals to it); nothing else."""


class TeamError(ZatteraError, ValueError):
    """A refused user, grant or token request; the message names the field."""


def check_name(name: str, what: str = "name") -> str:
    if not _NAME.match(name):
        raise TeamError(f"{what} {name!r}: use 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit")
    return name


def check_role(role: str) -> str:
    if role not in ROLES:
        raise TeamError(f"--role {role!r}: must be one of {', '.join(ROLES)}")
    return role


def parse_ttl(text: str) -> float:
    match = _TTL.match(text.strip())
    if not match:
        raise TeamError(f"--ttl {text!r}: a number and a unit s, m, h or d (e.g. 90d)")
    return int(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class User:
    name: str
    user_key: str = ""
    admin: bool = False
    grants: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "user_key": self.user_key,
                "admin": self.admin,
                "grants": self.grants,
                "created_at": self.created_at,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> User:
        doc = json.loads(data)
        return cls(
            str(doc["name"]),
            str(doc.get("user_key", "")),
            bool(doc.get("admin", False)),
            {str(k): str(v) for k, v in dict(doc.get("grants") or {}).items()},
            float(doc.get("created_at", 0.0)),
        )


@dataclass
class Token:
    name: str
    project_id: str
    role: str
    user_key: str
    sha256: str
    expires_at: float
    created_at: float = 0.0
    created_by: str = ""
    revoked: bool = False

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Token:
        doc = json.loads(data)
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})

    def public(self) -> dict[str, Any]:
        """What may be shown: never the hash."""
        return {k: v for k, v in self.__dict__.items() if k not in ("sha256", "user_key")}

    def usable(self, now: float) -> str:
        """ "" when usable, else why not."""
        if self.revoked:
            return f"token {self.name!r} is revoked"
        if now >= self.expires_at:
            return f"token {self.name!r} expired"
        return ""


def user_key(name: str) -> str:
    return f"user.{name}"


def token_key(name: str) -> str:
    return f"token.{name}"


def token_user_name(token_name: str) -> str:
    return TOKEN_USER_PREFIX + token_name


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str, stored_sha256: str) -> bool:
    return hmac.compare_digest(hash_token(token), stored_sha256)


def encode_token(creds_text: str) -> str:
    """The token string: the member credential it wraps (JWT + seed), so a CI job needs nothing else. A random
    nonce is folded in so two tokens never share a hash."""
    nonce = secrets.token_urlsafe(32)
    payload = json.dumps({"creds": creds_text, "nonce": nonce}).encode()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(payload).decode().rstrip("=")


def decode_token(token: str) -> str:
    """The credentials text a token wraps; :class:`TeamError` for anything else (never echoing the token)."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise TeamError(f"ZATTERA_TOKEN: not a Zattera API token (it starts with {TOKEN_PREFIX})")
    body = token[len(TOKEN_PREFIX) :]
    try:
        doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return str(doc["creds"])
    except (ValueError, KeyError, TypeError):
        raise TeamError("ZATTERA_TOKEN: malformed token") from None


@dataclass(frozen=True)
class Member:
    """Who asks, resolved on the control side from the server-set identity: its roles by project id."""

    name: str
    grants: dict[str, str]
    token: str = ""
    admin: bool = False
    """A cluster admin (``users add --admin``): every project and the cluster-wide actions (docs/teams.md)."""

    def role(self, project_id: str) -> str:
        return OWNER if self.admin and project_id else self.grants.get(project_id, "")


def project_of(kind: str, msg: Message, env_projects: dict[str, str]) -> str:
    """The project a value belongs to ("": none known). ``env_projects``: environment id → project id, for the
    kinds that name only an environment."""
    if kind == K.PROJECT:
        return str(getattr(msg.meta, "id", "")) if msg.HasField("meta") else ""  # type: ignore[attr-defined]
    project = str(getattr(msg, "project_id", "") or "")
    if project:
        return project
    env = str(getattr(msg, "environment_id", "") or "")
    return env_projects.get(env, "")


def decoded(key: str, data: bytes | None) -> tuple[str, Message | None]:
    kind = key.split(".", 1)[0]
    if not data or kind not in K.MESSAGE_TYPES:
        return kind, None
    try:
        return kind, K.decode(kind, data)
    except Exception:
        return kind, None


def value_project(key: str, data: bytes | None, env_projects: dict[str, str]) -> str:
    kind, msg = decoded(key, data)
    if kind not in PROJECT_KINDS or msg is None:
        return ""
    return project_of(kind, msg, env_projects)


def may_read(member: Member, key: str, data: bytes | None, env_projects: dict[str, str]) -> bool:
    """A member reads the keys of the projects it holds any role in, and :data:`MEMBER_READS_CLUSTER`."""
    kind = key.split(".", 1)[0]
    if kind in MEMBER_READS_CLUSTER or member.admin:
        return True
    project = value_project(key, data, env_projects)
    return bool(project) and bool(member.role(project))


def may_write(
    member: Member,
    key: str,
    new: bytes | None,
    old: bytes | None,
    env_projects: dict[str, str],
    *,
    delete: bool,
) -> str:
    """ "" when ``member`` may write ``key`` (``new``: the value written, ``old``: the value stored), else the
    one-line reason. Both the stored and the new value must be in a project the role allows the change in; an
    admin writes any key (the relay still refuses leases to everyone)."""
    if member.admin:
        return ""
    kind = key.split(".", 1)[0]
    if kind not in PROJECT_KINDS:
        return f"{key}: {kind} keys are cluster-wide: admins only"
    if kind == K.PROJECT and old is None:
        return f"{key}: creating a project is an admin's"
    projects: list[str] = []
    for value in (old, None if delete else new):
        if value:
            project = value_project(key, value, env_projects)
            if not project:
                return f"{key}: names no project: admins only"
            projects.append(project)
    if not projects:
        return f"{key}: names no project: admins only"
    for project in projects:
        role = member.role(project)
        if role == OWNER:
            continue
        if role == DEPLOYER:
            if delete and kind not in DEPLOYER_DELETES:
                return f"{key}: deleting a {kind} needs the owner role on project {project}"
            if not delete and kind not in DEPLOYER_WRITES:
                return f"{key}: writing a {kind} needs the owner role on project {project}"
            if kind == K.ENV and old is None:
                return f"{key}: creating an environment needs the owner role on project {project}"
            continue
        if role == VIEWER:
            return f"{key}: role viewer on project {project} may not write"
        return f"{key}: no role on project {project}"
    return ""


def now() -> float:
    return time.time()


# ------------------------------------------------------------------------------------- members' events

TEAMS_EVENTS_SUBJECT = "zattera.teams.events"
"""A member reads the events of its projects: ``{"start_seq", "subject", "limit"}`` → ``{"events": [{"seq",
"pending", "data" (base64 of ``Event``)}], "next_seq", "last_seq"}`` or ``{"error"}``; answered by the
authorising path."""
EVENTS_PAGE = 100
EVENTS_POLL = 0.5
"""How often a member's ``events -f`` asks for new events once caught up (seconds)."""


@dataclass(frozen=True)
class StreamSeq:
    stream: int


@dataclass(frozen=True)
class StreamPosition:
    """A pushed or paged message's place in its stream, shaped as nats-py's ``msg.metadata`` (``sequence.stream``,
    ``num_pending``): what watch readers read of it."""

    sequence: StreamSeq
    num_pending: int


@dataclass(frozen=True)
class EventMsg:
    """What ``zattera events`` reads of a watched message: the data and the stream sequence."""

    data: bytes
    seq: int
    pending: int

    @property
    def metadata(self) -> Any:
        return StreamPosition(StreamSeq(self.seq), self.pending)


class MemberEvents:
    """A member's events watch (the events stream cannot be filtered by project with a subject): pages of its
    projects' events asked from control (:data:`TEAMS_EVENTS_SUBJECT`), the part of a watch the CLI reads."""

    def __init__(self, nc: Any, subject: str, start_seq: int) -> None:
        self._nc = nc
        self._subject = subject
        self._next = max(start_seq, 1)
        self._buffer: list[EventMsg] = []

    async def _page(self) -> None:
        body = json.dumps({"start_seq": self._next, "subject": self._subject, "limit": EVENTS_PAGE}).encode()
        reply = await self._nc.request(TEAMS_EVENTS_SUBJECT, body, timeout=5.0)
        answer = json.loads(reply.data or b"{}")
        if answer.get("error"):
            raise TeamError(str(answer["error"]))
        for item in answer.get("events", []):
            self._buffer.append(EventMsg(base64.b64decode(item["data"]), int(item["seq"]), int(item.get("pending", 0))))
        self._next = max(self._next, int(answer.get("next_seq", self._next)))

    async def next_msg(self, timeout: float | None = None) -> EventMsg:
        """The next event of the caller's projects; :class:`TimeoutError` after ``timeout`` without one."""
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._buffer:
            await self._page()
            if self._buffer:
                break
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError
            await asyncio.sleep(EVENTS_POLL if deadline is None else min(EVENTS_POLL, max(0.0, deadline - loop.time())))
        return self._buffer.pop(0)

    async def unsubscribe(self) -> None:
        self._buffer.clear()
