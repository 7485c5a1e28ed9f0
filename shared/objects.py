"""Object store reads with direct gets only: no consumer, so a credential that may not create consumers
(agents: SECURITY.md) reads objects, and nothing of the read can be steered elsewhere.

nats-py's ``ObjectStore.get`` and ``list`` create a push consumer per call. The object store layout is part of
the NATS ADR-20 contract: the meta message ``$O.<bucket>.M.<base64url(name)>`` (last one wins; rolled up on
each write) names the chunks' subject ``$O.<bucket>.C.<nuid>`` and their count; the chunks are read one by one
with ``next_by_subj`` from the previous sequence, and checked against the meta's SHA-256 digest.
"""

from __future__ import annotations

import base64
import hashlib
import json

from nats.js import JetStreamContext
from nats.js.api import ObjectInfo
from nats.js.errors import NotFoundError

from shared.errors import ZatteraError


class ObjectCorrupt(ZatteraError):
    """The chunks read do not match the object's recorded size or digest."""


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


async def object_info(js: JetStreamContext, bucket: str, name: str) -> ObjectInfo | None:
    """The object's meta, or None when it does not exist or was deleted."""
    try:
        msg = await js.get_last_msg(object_stream(bucket), meta_subject(bucket, name), direct=True)
    except NotFoundError:
        return None
    info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
    return None if info.deleted else info


async def read_object(js: JetStreamContext, bucket: str, name: str) -> bytes | None:
    """The object's bytes, or None when it does not exist; raises :class:`ObjectCorrupt` on a mismatch."""
    info = await object_info(js, bucket, name)
    if info is None:
        return None
    stream, chunks = object_stream(bucket), f"$O.{bucket}.C.{info.nuid}"
    parts: list[bytes] = []
    seq = 0
    for _ in range(info.chunks or 0):
        try:
            msg = await js.get_msg(stream, seq=seq + 1, subject=chunks, next=True, direct=True)
        except NotFoundError:
            raise ObjectCorrupt(f"{bucket}/{name}: {len(parts)} of {info.chunks} chunks present") from None
        parts.append(msg.data or b"")
        seq = msg.seq or seq + 1
    data = b"".join(parts)
    digest = "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if len(data) != (info.size or 0) or (info.digest and info.digest != digest):
        raise ObjectCorrupt(f"{bucket}/{name}: stored size or digest mismatch")
    return data


async def list_objects(js: JetStreamContext, bucket: str) -> list[ObjectInfo]:
    """Every live object's meta, walking the meta subjects by sequence."""
    stream, metas = object_stream(bucket), f"$O.{bucket}.M.>"
    latest: dict[str, ObjectInfo] = {}
    seq = 0
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq + 1, subject=metas, next=True, direct=True)
        except NotFoundError:
            break
        info = ObjectInfo.from_response(json.loads(msg.data or b"{}"))
        latest[info.name] = info
        seq = msg.seq or seq + 1
    return [info for info in latest.values() if not info.deleted]
