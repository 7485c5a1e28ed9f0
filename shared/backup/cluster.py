"""A cluster's contents read at one point for a backup, and written back by a restore.

* The state bucket and the console users' bucket: the last value of every key by ONE ``DIRECT.GET``
  batch (:func:`shared.directget.last_per_subject`: one point in the stream's history, answered without a
  consumer, so the operator credential of a secured cluster may read it); a bucket too large for one batch
  (or one that allows no direct reads, as the console users' bucket) is read by an ordered consumer until
  it has seen every message (the bucket at the last one).
* The object stores (sources, images): every live object, its bytes checked against its digest.
* Restoring writes keys as they were, except what belonged to the old machines: nodes, assignments and
  what nodes observed, and leases are left out, and volumes are pinned to a node of the new cluster
  (:mod:`shared.backup.volumes` brings their data back from the snapshot the backup carries).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.js.api import ObjectMeta
from nats.js.errors import NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, PermissionDenied
from shared.console_users import USERS_BUCKET, users_bucket
from shared.directget import TooManySubjects, last_per_subject
from shared.jetstream import is_delete_marker
from shared.objects import list_objects, read_object
from shared.secrets import CLUSTER_KEY
from shared.subjects import STATE_BUCKET

READ_TIMEOUT = 10.0
LEFT_BEHIND = frozenset({K.NODE, K.ASSIGNMENT, K.OBSERVED, K.LEASE})
"""State kinds that belong to the machines and terms of the old cluster: never restored."""
PUBLISHED_KEY = f"{K.SECRETS_KEY}.{CLUSTER_KEY}"
"""The secrets service's published key: a cluster's secrets service has started once it is there."""
OWN_KINDS = frozenset({K.PROJECT, K.APP, K.ENV, K.RELEASE, K.SECRET, K.DOMAIN, K.VOLUME, K.JOB, K.BUILD})
"""What an operator put in a cluster: a cluster holding any of them is not empty."""


@dataclass(frozen=True)
class BucketCopy:
    revision: int
    """The stream sequence of the newest message read (the copy is the bucket at that revision)."""
    values: dict[str, bytes]

    def to_json(self) -> bytes:
        encoded = {k: base64.b64encode(v).decode() for k, v in sorted(self.values.items())}
        return json.dumps({"revision": self.revision, "keys": encoded}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BucketCopy:
        doc = json.loads(data)
        return cls(int(doc["revision"]), {k: base64.b64decode(v) for k, v in doc["keys"].items()})


def _prefix(bucket: str) -> str:
    return f"$KV.{bucket}."


async def read_bucket(conn: Connection, bucket: str) -> BucketCopy:
    """Every live key of a KV bucket at one revision (an absent bucket: empty)."""
    stream, prefix = f"KV_{bucket}", _prefix(bucket)
    try:
        info = await conn.js.stream_info(stream)
    except NotFoundError:
        return BucketCopy(0, {})
    if not info.state.messages:
        return BucketCopy(int(info.state.last_seq or 0), {})
    if not info.config.allow_direct:
        return await _read_by_gets(conn, bucket)
    try:
        msgs = await last_per_subject(conn.nc, stream, prefix + ">", READ_TIMEOUT)
    except TooManySubjects:
        return await _read_by_gets(conn, bucket)
    values: dict[str, bytes] = {}
    revision = 0
    for msg in msgs:
        headers = msg.headers or {}
        revision = max(revision, int(headers.get("Nats-Sequence", 0)))
        if not is_delete_marker(headers) and msg.data:
            values[headers.get("Nats-Subject", "")[len(prefix) :]] = bytes(msg.data)
    return BucketCopy(revision, values)


async def _read_by_gets(conn: Connection, bucket: str) -> BucketCopy:
    """Every live key of a bucket that allows no direct read (or has too many keys for one batch): its
    subjects as the stream lists them, then one message get each. No consumer: an operator's credential may
    not create one (a secured cluster), and nats-py's watcher may end before its first key on a loaded
    machine."""
    stream, prefix = f"KV_{bucket}", _prefix(bucket)
    info = await conn.js.stream_info(stream, subjects_filter=prefix + ">")
    values: dict[str, bytes] = {}
    revision = 0
    for subject in sorted(info.state.subjects or {}):
        try:
            msg = await conn.js.get_last_msg(stream, subject)
        except NotFoundError:
            continue  # deleted meanwhile
        revision = max(revision, int(msg.seq or 0))
        if not is_delete_marker(msg.headers or {}) and msg.data:
            values[subject[len(prefix) :]] = bytes(msg.data)
    return BucketCopy(revision, values)


async def read_state(conn: Connection) -> BucketCopy:
    return await read_bucket(conn, STATE_BUCKET)


async def read_console_users(conn: Connection) -> BucketCopy:
    return await read_bucket(conn, USERS_BUCKET)


@dataclass(frozen=True)
class StoredObject:
    name: str
    data: bytes
    description: str
    headers: dict[str, str]


async def read_store(conn: Connection, bucket: str) -> list[StoredObject]:
    """Every live object of an object store (an absent store: none)."""
    try:
        infos = await list_objects(conn.js, bucket)
    except NotFoundError:
        return []
    found: list[StoredObject] = []
    for info in infos:
        data = await read_object(conn.js, bucket, info.name)
        if data is not None:
            headers = {k: (v[0] if isinstance(v, list) else str(v)) for k, v in (info.headers or {}).items()}
            found.append(StoredObject(info.name, data, info.description or "", headers))
    return found


async def write_object(conn: Connection, bucket: str, obj: StoredObject) -> None:
    store = await conn.js.object_store(bucket)
    meta = ObjectMeta(name=obj.name, description=obj.description or None, headers=obj.headers or None)
    await store.put(obj.name, obj.data, meta=meta)


def kind_of(key: str) -> str:
    return key.partition(".")[0]


def is_empty(state: BucketCopy) -> bool:
    """No project, app, env, release, secret, domain, volume, job or build: what a fresh cluster holds."""
    return not any(kind_of(k) in OWN_KINDS for k in state.values)


def restorable(
    state: BucketCopy, *, carried: frozenset[str] | None = None, homes: dict[str, str] | None = None
) -> list[tuple[str, bytes]]:
    """The keys a restore writes, in order: the old machines' keys left out, volumes pinned to their node in
    this cluster (``homes``: volume id → node; unpinned when absent) and ACTIVE, snapshot records left out
    unless the backup carries their objects (``carried``: snapshot ids; None = keep every record),
    environments last (so the loops that place replicas see an env only with its releases, secrets, domains
    and volumes)."""
    out: list[tuple[str, bytes]] = []
    for key, data in state.values.items():
        kind = kind_of(key)
        if kind in LEFT_BEHIND:
            continue
        if kind == K.SNAPSHOT and carried is not None and key.partition(".")[2] not in carried:
            continue
        if kind == K.VOLUME:
            volume = pb.Volume.FromString(data)
            volume.node_id = (homes or {}).get(volume.meta.id, "")
            volume.status = pb.VOLUME_STATUS_ACTIVE
            volume.ClearField("lease")
            data = volume.SerializeToString()
        out.append((key, data))
    out.sort(key=lambda kv: (kind_of(kv[0]) == K.ENV, kv[0]))
    return out


async def users_bucket_ready(conn: Connection) -> bool:
    """The console users' bucket exists, or was created now (False: it is missing and this credential may
    not create it)."""
    try:
        await users_bucket(conn.js, create=True)
    except (nats.errors.Error, PermissionDenied):
        return False
    return True


async def write_bucket(conn: Connection, bucket: str, values: list[tuple[str, bytes]], *, parallel: int = 64) -> None:
    """Put every key of a KV bucket (each acknowledged), ``parallel`` puts in flight at once."""
    prefix = _prefix(bucket)
    limit = asyncio.Semaphore(parallel)

    async def put(key: str, data: bytes) -> None:
        async with limit:
            await conn.js.publish(prefix + key, data)

    await asyncio.gather(*(put(k, d) for k, d in values))


async def write_state(
    conn: Connection, values: list[tuple[str, bytes]], before_envs: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Put the state keys :func:`restorable` chose: every environment after everything else (and after
    ``before_envs``, which brings the volumes' data back before any replica of theirs can be placed)."""
    await write_bucket(conn, STATE_BUCKET, [kv for kv in values if kind_of(kv[0]) != K.ENV])
    if before_envs is not None:
        await before_envs()
    await write_bucket(conn, STATE_BUCKET, [kv for kv in values if kind_of(kv[0]) == K.ENV])
