"""What each role may publish and subscribe to: the whole authorization model, enforced by nats-server.

Every user is signed by a *scoped* signing key of its role, held by its role's account (``ZATTERA`` for
control, ``AGENTS``, ``PROXIES``, ``OPERATORS``: :mod:`shared.security.accounts`, which also derives each
account's imports from these tables): the server takes the permissions from the scope's template below,
never from the user JWT, so whoever holds a role's signing key (the join service holds only the agent ones)
can mint users of that role and nothing more. ``{{name()}}`` expands to the user's name (the node id of an
agent, the proxy id of a proxy) and ``{{subject()}}`` to the user's public key, the private inbox prefix.

Reads of the state bucket by agents are direct gets of the form that carries the subject in the API subject
itself, ``$JS.API.DIRECT.GET.<stream>.<subject>``, so a subject permission scopes them, plus pulls of the one
consumer control opens for the agent (``view-<node>``). The forms without a subject in it
(``$JS.API.STREAM.MSG.GET.<stream>``, ``$JS.API.DIRECT.GET.<stream>``) would read anything and are never
granted on the state bucket to agents or proxies; no role but control creates or deletes consumers (a
consumer's deliver subject could name any subject of ``ZATTERA``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.applogs import APP_LOGS_SUBJECT_PREFIX
from shared.certs import CHANGED_SUBJECT as CERTS_CHANGED_SUBJECT
from shared.certs import KEYS_OPEN_SUBJECT as CERT_KEYS_OPEN_SUBJECT
from shared.console_users import USERS_BUCKET
from shared.secrets import ROTATE_SUBJECT, open_subject
from shared.subjects import (
    ACTIVATE_SUBJECT,
    BUILD_EVENTS_STREAM,
    BUILD_LOGS_STREAM,
    CLUSTER_REPLICAS_SUBJECT,
    EVENTS_STREAM,
    EVENTS_SUBJECT_PREFIX,
    IMAGES_STORE,
    LIVE_PREFIX,
    LIVE_STREAM,
    ROUTES_GET_SUBJECT,
    ROUTES_SNAPSHOT_SUBJECT,
    ROUTES_STREAM,
    SNAPSHOTS_STORE,
    SOURCES_STORE,
    STATE_PREFIX,
    STATE_STREAM,
    agent_subject,
    build_events_subject,
)
from shared.teams import (
    PUSH_PREFIX,
    TEAMS_BUCKET,
    TEAMS_EVENTS_SUBJECT,
    TEAMS_FEED_KEEP_SUBJECT,
    TEAMS_FEED_SUBJECT,
    TEAMS_ISSUE_SUBJECT,
)
from shared.watches import WATCH_OPEN_SUBJECT

JOIN_SUBJECT = "zattera.join"
JOIN_ISSUE_SUBJECT = "zattera.join.issue"
JOIN_REMOVE_SUBJECT = "zattera.join.remove"
"""``zattera nodes remove``: peer-remove a machine's NATS server and revoke its credentials (operator)."""
JOIN_REMOVE_VIA_PREFIX = "zattera.join.remove.via."
"""``<prefix><node>``: a removal handed to that server machine's join service (control only): a machine never
removes itself (revoking its own credentials would cut the connection doing it), and the first machine's
seats are retired by its own join service (it records them in its data dir)."""
JOIN_BUCKET = "zattera-join"
JOIN_STREAM = f"KV_{JOIN_BUCKET}"
VIEW_OPEN_SUBJECT = "zattera.view.open"
"""An agent asks control to (re)create its view consumer; control reads the node from ``Nats-Request-Info``."""

NAME = "{{name()}}"
INBOX = "_INBOX.{{subject()}}.>"
JS = "$JS.API"
NANOS = 1_000_000_000


class Role(StrEnum):
    CONTROL = "control"
    OPERATOR = "operator"
    AGENT = "agent"
    BUILDER = "builder"  # an agent that also runs builds and pushes their images
    PROXY = "proxy"
    MEMBER = "member"  # a person or API token of a team (docs/teams.md): every read and write is authorised


@dataclass(frozen=True)
class Permissions:
    pub_allow: tuple[str, ...] = ()
    pub_deny: tuple[str, ...] = ()
    sub_allow: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    # Publishing to the reply subject of a request this user received: at most `max` messages within `ttl`.
    response_max: int = 0
    response_ttl: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def claims(self) -> dict[str, Any]:
        """The ``UserPermissionLimits`` JSON of a user JWT or of a scoped signing key template."""
        body: dict[str, Any] = {
            "pub": _allow_deny(self.pub_allow, self.pub_deny),
            "sub": _allow_deny(self.sub_allow, self.sub_deny),
            "subs": -1,
            "data": -1,
            "payload": -1,
            **self.extra,
        }
        if self.response_max:
            body["resp"] = {"max": self.response_max, "ttl": int(self.response_ttl * NANOS)}
        return body

    def union(self, other: Permissions) -> Permissions:
        return Permissions(
            pub_allow=self.pub_allow + other.pub_allow,
            pub_deny=self.pub_deny + other.pub_deny,
            sub_allow=self.sub_allow + other.sub_allow,
            sub_deny=self.sub_deny + other.sub_deny,
            response_max=max(self.response_max, other.response_max),
            response_ttl=max(self.response_ttl, other.response_ttl),
        )


def _allow_deny(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
    body: dict[str, list[str]] = {}
    if allow:
        body["allow"] = list(allow)
    if deny:
        body["deny"] = list(deny)
    return body


def object_stream(store: str) -> str:
    return f"OBJ_{store}"


def read_key(stream: str, subject: str) -> str:
    """Direct get of the last message of ``subject`` (one KV key, or a wildcard of keys)."""
    return f"{JS}.DIRECT.GET.{stream}.{subject}"


def _message_gets(stream: str) -> tuple[str, ...]:
    """Read any message of ``stream`` by its sequence or subject (message and direct gets), with no consumer."""
    return (
        f"{JS}.STREAM.INFO.{stream}",
        f"{JS}.STREAM.MSG.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}.>",
    )


def read_whole_stream(stream: str) -> tuple[str, ...]:
    """Everything needed to read any message of ``stream`` (for streams a role may read entirely): message
    gets, and pulls of the watch consumers control opens (``zattera.watch.open``, :mod:`shared.watches`) —
    no consumer of its own (a consumer's deliver subject could name a lease key)."""
    return (*_message_gets(stream), f"{JS}.CONSUMER.INFO.{stream}.*", pull(stream, "*"))


def read_object_store(store: str) -> tuple[str, ...]:
    """Read objects with message gets only (``shared.objects``; nats-py's put and delete look the meta up with
    ``STREAM.MSG.GET``): no consumer, so no deliver subject to steer, nothing but this store's messages."""
    return _message_gets(object_stream(store))


def view_consumer(node: str) -> str:
    """The durable pull consumer of an agent's state keys, created by control (``zattera.view.open``)."""
    return f"view-{node}"


def pull(stream: str, consumer: str) -> str:
    """Fetch messages of a consumer someone else created (the pull request names it in the subject)."""
    return f"{JS}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def write_object_store(store: str) -> tuple[str, ...]:
    """Put objects: chunk and meta messages, plus the purge of a replaced object's old chunks."""
    return (f"$O.{store}.C.>", f"$O.{store}.M.>", f"{JS}.STREAM.PURGE.{object_stream(store)}")


CONTROL = Permissions(pub_allow=(">",), sub_allow=(">",))
"""The services: everything in the ZATTERA account, which holds only this project's subjects."""

OPERATOR = Permissions(
    pub_allow=(
        f"{STATE_PREFIX}>",
        f"{EVENTS_SUBJECT_PREFIX}>",
        ROUTES_GET_SUBJECT,
        JOIN_ISSUE_SUBJECT,
        JOIN_REMOVE_SUBJECT,
        CLUSTER_REPLICAS_SUBJECT,  # `zattera cluster replicas N`
        WATCH_OPEN_SUBJECT,  # its watches: pull consumers control creates (it creates none)
        ROTATE_SUBJECT,  # `zattera secrets rotate-key`
        f"$KV.{USERS_BUCKET}.>",  # `zattera console add-user|remove-user` (the console creates the bucket)
        f"$KV.{TEAMS_BUCKET}.>",  # `zattera users|grants|tokens` (docs/teams.md; the join service creates it)
        TEAMS_ISSUE_SUBJECT,  # a member credential for `zattera users add` / `tokens create`
        # `zattera volumes snapshot` / `restore` ask the volume's node directly (progress comes to the inbox).
        agent_subject("*", "snapshot"),
        agent_subject("*", "restore"),
        # `zattera addons psql`: a session to a database's node, carried over NATS (shared/addons/tunnel.py).
        agent_subject("*", "psql"),
        agent_subject("*", "psql.*"),
        f"{JS}.INFO",
        f"{JS}.STREAM.NAMES",
        f"{JS}.STREAM.LIST",
        *read_whole_stream(STATE_STREAM),
        *read_whole_stream(LIVE_STREAM),
        *read_whole_stream(EVENTS_STREAM),
        *read_whole_stream(ROUTES_STREAM),
        *read_whole_stream(BUILD_LOGS_STREAM),
        *read_whole_stream(BUILD_EVENTS_STREAM),
        *read_whole_stream(object_stream(SOURCES_STORE)),
        *read_whole_stream(object_stream(IMAGES_STORE)),
        *read_whole_stream(object_stream(SNAPSHOTS_STORE)),
        *write_object_store(SOURCES_STORE),
        # `zattera restore` writes a backup's images and volume snapshots back (docs/backup.md); the operator
        # already writes the state that names them.
        *write_object_store(IMAGES_STORE),
        *write_object_store(SNAPSHOTS_STORE),
        # `zattera logs`: instance logs are one stream per environment (ZATTERA_LOGS_<env>, docs/logs.md) and a
        # permission cannot match a name prefix, so the operator reads every stream of the account (it reads
        # each of the others whole already).
        *read_whole_stream("*"),
    ),
    # Leases fence the leader loops: a lease written by anyone else would depose a leader or forge a term.
    pub_deny=(f"{STATE_PREFIX}lease.>",),
    sub_allow=(INBOX, f"{EVENTS_SUBJECT_PREFIX}>", "zattera.builds.>", ROUTES_SNAPSHOT_SUBJECT),
)
"""The CLI: desired state, events, logs, routes, sources upload, join tokens, volume snapshot and restore
requests to agents, a backup's images and snapshots on restore. No leases, no consumers, no stream admin, no
build or prune requests."""

_STATE_OWN = {
    "assignments": f"{STATE_PREFIX}assignment.{NAME}.*",
    "observed": f"{STATE_PREFIX}observed.{NAME}.*",
    "node": f"{STATE_PREFIX}node.{NAME}",
}
AGENT_STATE_READS = {
    **{kind: key for kind, key in _STATE_OWN.items() if kind != "node"},
    # Every node record (read-only): its mesh peers' keys, addresses and endpoints (services/agent/mesh.py).
    "nodes": f"{STATE_PREFIX}node.*",
    # What its assignments run: the image ref and service spec (command, ports, health check, volumes)…
    "releases": f"{STATE_PREFIX}release.*",
    # …the volumes of its stateful assignments (an instance starts only under a lease naming it)…
    "volumes": f"{STATE_PREFIX}volume.*",
}
"""State keys an agent reads (direct get and filtered watch), all read-only but its observed and node keys.

Releases and volumes are not per-node keys, so an agent reads all of them, not only those of its
assignments: subject permissions cannot follow a reference, and a per-node copy would have to be kept by
the control plane. They are specs (image ref, command, ports, health checks, volume mounts, placement,
provenance; volume pinning and leases), not secrets; SECURITY.md's threat model says what that exposes."""

AGENT = Permissions(
    pub_allow=(
        _STATE_OWN["observed"],
        _STATE_OWN["node"],
        f"{LIVE_PREFIX}node.{NAME}",
        # Its instances' secrets, sealed to its own key; the subject names the node, so no other may ask.
        open_subject(NAME),
        # Its instances' output (docs/logs.md); the subject names the env, which a permission cannot follow.
        f"{APP_LOGS_SUBJECT_PREFIX}*.*",
        f"{JS}.INFO",
        f"{JS}.STREAM.NAMES",  # nats-py's object store reads look the stream up by subject (names only)
        f"{JS}.STREAM.INFO.{STATE_STREAM}",
        f"{JS}.STREAM.INFO.{LIVE_STREAM}",
        *(read_key(STATE_STREAM, subject) for subject in AGENT_STATE_READS.values()),
        # …and image tags (tag → digest) to resolve a release's image ref that names a tag.
        read_key(STATE_STREAM, f"{STATE_PREFIX}image.*"),
        # Its watch: pulls from the consumer control created for it (no consumer of its own: a consumer's
        # deliver subject could point anywhere in the ZATTERA account).
        VIEW_OPEN_SUBJECT,
        pull(STATE_STREAM, view_consumer(NAME)),
        *read_object_store(IMAGES_STORE),
        *read_object_store(SOURCES_STORE),
        *read_object_store(SNAPSHOTS_STORE),
        # Snapshot chunks and manifests; the purge is nats-py's object delete (prune, GC) and the clean-up of
        # a chunk upload that lost a race. It could purge the whole store, which its rollup rights on every
        # chunk and manifest subject could already destroy (SECURITY.md, threat model).
        *write_object_store(SNAPSHOTS_STORE),
        # Its private-network forwarder follows the routes and wakes cold envs, as a proxy (docs/networking.md).
        ROUTES_GET_SUBJECT,
        ACTIVATE_SUBJECT,
    ),
    sub_allow=(INBOX, f"zattera.agent.{NAME}.>", ROUTES_SNAPSHOT_SUBJECT),
    # Snapshot, restore and build requests stream progress to the requester's reply subject for a while.
    response_max=1_000_000,
    response_ttl=24 * 3600.0,
)
"""A node agent: writes its own keys only; reads its own keys, the releases and volumes its assignments
need, image tags, the stores it runs from; answers the requests addressed to its node."""

BUILDER = AGENT.union(
    Permissions(
        pub_allow=(
            # Its own builds' events: the last token names its node, and the dispatcher takes a build's events
            # only from the node it assigned the build to (the build logs are written by the dispatcher).
            build_events_subject("*", NAME),
            f"{STATE_PREFIX}image.*",
            *write_object_store(IMAGES_STORE),
        )
    )
)
"""An agent allowed to build: also build events under its own node id, and image pushes (blobs and tags)."""

PROXY = Permissions(
    pub_allow=(
        ROUTES_GET_SUBJECT,
        ACTIVATE_SUBJECT,
        f"{LIVE_PREFIX}proxy.{NAME}",
        f"{JS}.INFO",
        # Certificates (docs/certificates.md): every servable key, sealed to the proxy's in-memory key…
        CERT_KEYS_OPEN_SUBJECT,
        # …and the HTTP-01 answers it serves, read by direct get (a proxy creates no consumer).
        read_key(LIVE_STREAM, f"{LIVE_PREFIX}acme.*"),
    ),
    sub_allow=(INBOX, ROUTES_SNAPSHOT_SUBJECT, CERTS_CHANGED_SUBJECT),
)
"""An ingress proxy: route snapshots, activation requests, its own heartbeat, certificates and HTTP-01
answers (never the ACME account key)."""

MEMBER_ADMIN_SUBJECTS = (
    JOIN_ISSUE_SUBJECT,  # `zattera nodes join-token`
    JOIN_REMOVE_SUBJECT,  # `zattera nodes remove`
    CLUSTER_REPLICAS_SUBJECT,  # `zattera cluster replicas N`
    ROTATE_SUBJECT,  # `zattera secrets rotate-key` (the cluster key)
    TEAMS_ISSUE_SUBJECT,  # `zattera users add` / `tokens create`
    f"$KV.{TEAMS_BUCKET}.>",  # `zattera users|grants|tokens`
    f"$KV.{USERS_BUCKET}.>",  # `zattera console add-user|remove-user`
    f"{JS}.STREAM.NAMES",
    f"{JS}.STREAM.LIST",
)
"""The cluster-wide subjects a member may publish: its import renames them to ``zattera.authz.…`` and the
authorising path passes them on only for an **admin** user (``users add --admin``), read at every request;
anyone else is answered ``not authorised`` (docs/teams.md)."""

MEMBER = Permissions(
    pub_allow=(
        # Writes go through the relay, which checks the caller's grant for the key's project (docs/teams.md).
        f"{STATE_PREFIX}>",
        f"{JS}.INFO",
        # Renamed by the MEMBERS account's import to ``zattera.authz.…``: the authorising path answers them with
        # what the caller's grants let it read (shared/security/authz.py): the state's keys of its projects, the
        # sources store, and every stream for an admin.
        f"{JS}.STREAM.INFO.*",
        f"{JS}.DIRECT.GET.*",
        f"{JS}.DIRECT.GET.*.>",
        # The events its commands announce (renamed too: the event's project must be one it may change)…
        f"{EVENTS_SUBJECT_PREFIX}>",
        # …and its projects' events, a page at a time (the stream cannot be filtered by project).
        TEAMS_EVENTS_SUBJECT,
        # What it follows (state changes, events, logs) is pushed by the authorising path after the check, on
        # ``zattera.push.<its user key>.<feed>`` (below): a member pulls no consumer at all, so no drain's,
        # agent's view or other durable consumer is within its reach, whatever its name.
        TEAMS_FEED_SUBJECT,
        TEAMS_FEED_KEEP_SUBJECT,
        WATCH_OPEN_SUBJECT,  # answered: members follow through the feed
        # `zattera deploy DIR` uploads its source (content-addressed; deploying it is what the grant checks).
        *read_object_store(SOURCES_STORE),
        *write_object_store(SOURCES_STORE),
        *MEMBER_ADMIN_SUBJECTS,
    ),
    # No leases (the relay refuses them too).
    pub_deny=(f"{STATE_PREFIX}lease.>",),
    sub_allow=(INBOX, f"{PUSH_PREFIX}{{{{subject()}}}}.>"),
)
"""A team member or API token: its identity only. Everything it may publish is either checked on the control
side against its grants (state writes by the relay; reads, stream infos, feeds and the admins' cluster-wide
subjects by the authorising path) or a content-addressed source upload; it subscribes to its inbox and its own
pushed feeds only."""

JOIN = Permissions(pub_allow=(JOIN_SUBJECT,), sub_allow=("_INBOX.>",), extra={"bearer_token": True})
"""The public join sentinel (account JOIN, which sees nothing of ZATTERA but the imported join service)."""

ROLE_PERMISSIONS: dict[Role, Permissions] = {
    Role.CONTROL: CONTROL,
    Role.OPERATOR: OPERATOR,
    Role.AGENT: AGENT,
    Role.BUILDER: BUILDER,
    Role.PROXY: PROXY,
    Role.MEMBER: MEMBER,
}
