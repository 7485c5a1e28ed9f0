"""Object I/O for snapshots over the NATS object store ``zattera-snapshots`` (docs/wire-contract.md).

Keys: ``<prefix>chunks/<sha256 of the plaintext>`` and ``<prefix>manifests/<snapshot_id>``. Every object
is zstd-compressed then sealed (:mod:`shared.snapshots.crypto`). Objects are written as a single NATS
message whenever the server's payload limit allows (chunks are at most 4 MiB), which lets a read fetch
the one data message directly instead of creating a consumer per object.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime

import zstandard
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.errors import APIError, NotFoundError, ObjectNotFoundError
from nats.js.object_store import ObjectStore
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.errors import ZatteraError
from shared.jetstream import WRONG_LAST_SEQUENCE
from shared.objects import ObjectCorrupt, list_objects, read_object
from shared.snapshots.crypto import Sealer
from shared.subjects import SNAPSHOTS_STORE

CHUNKS = "chunks/"
MANIFESTS = "manifests/"
ZSTD_LEVEL = 1  # not the default 3: ~1.7x faster on text, similar ratio; decoding is level-agnostic
PAYLOAD_HEADROOM = 64 << 10  # protocol headers of a published message
SINGLE_MESSAGE_MAX = (4 << 20) + (256 << 10)  # a 4 MiB chunk after the worst zstd + seal expansion


class ObjectMissingError(ZatteraError):
    pass


@dataclass(frozen=True, slots=True)
class StoredObject:
    name: str
    size: int
    mtime: float  # epoch seconds of the upload (the uploader's clock)


def _mtime(info: ObjectInfo) -> float:
    if not info.mtime:
        return 0.0
    try:
        return datetime.fromisoformat(info.mtime.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


class SnapshotStore:
    """Sealed, compressed objects under one prefix of one object store."""

    def __init__(self, js: JetStreamContext, store: ObjectStore, *, bucket: str, prefix: str, sealer: Sealer) -> None:
        self._js = js
        self._store = store
        self._stream = f"OBJ_{bucket}"
        self._bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.sealer = sealer
        self._max_message = min(SINGLE_MESSAGE_MAX, max(128 << 10, js._nc.max_payload - PAYLOAD_HEADROOM))

    @classmethod
    async def open(cls, js: JetStreamContext, target: cpb.SnapshotTarget | None = None) -> SnapshotStore:
        target = target or cpb.SnapshotTarget()
        bucket = target.object_store or SNAPSHOTS_STORE
        store = await js.object_store(bucket)
        return cls(js, store, bucket=bucket, prefix=target.prefix, sealer=Sealer(target.data_key))

    def chunk_name(self, digest: str) -> str:
        return f"{self.prefix}{CHUNKS}{digest}"

    def manifest_name(self, snapshot_id: str) -> str:
        return f"{self.prefix}{MANIFESTS}{snapshot_id}"

    # ------------------------------------------------------------------ encoding

    def encode(self, plaintext: bytes) -> bytes:
        """zstd then seal: CPU-bound, releases the GIL (call from a worker thread for large data)."""
        return self.sealer.seal(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(plaintext))

    def encode_with_digest(self, plaintext: bytes) -> tuple[bytes, str]:
        """:meth:`encode` plus the object store digest of the stored bytes (both off the event loop)."""
        stored = self.encode(plaintext)
        return stored, "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(stored).digest()).decode()

    def decode(self, stored: bytes) -> bytes:
        return zstandard.ZstdDecompressor().decompress(self.sealer.open(stored))

    # ------------------------------------------------------------------ raw objects

    async def exists(self, name: str) -> bool:
        try:
            meta = await self._js.get_last_msg(self._stream, self._meta_subject(name), direct=True)
        except NotFoundError:
            return False
        return not json.loads(meta.data or b"{}").get("deleted")

    async def put(self, name: str, data: bytes) -> None:
        options = ObjectMetaOptions(max_chunk_size=min(max(len(data), 1), self._max_message))
        await self._store.put(name, data, meta=ObjectMeta(name=name, options=options))

    async def create(self, name: str, data: bytes, digest: str) -> bool:
        """Store a content-addressed object that should not exist yet; False if it appeared meanwhile.

        The object store layout (ADR-20) written directly: data message(s) on a fresh subject, then the
        meta message, which the server accepts only if no meta exists (expected sequence 0). Compared
        with ``ObjectStore.put`` this saves the meta lookup and the copies through a reader, and two
        snapshots racing to store the same chunk cannot leave unreferenced data behind.
        """
        nuid = self._js._nc._nuid.next().decode()
        chunk_subject = f"$O.{self._bucket}.C.{nuid}"
        parts = [data[i : i + self._max_message] for i in range(0, len(data), self._max_message)] or [b""]
        for part in parts:
            await self._js.publish(chunk_subject, part)
        info = ObjectInfo(
            name=name,
            bucket=self._bucket,
            nuid=nuid,
            size=len(data),
            chunks=len(parts),
            digest=digest,
            mtime=datetime.now(UTC).isoformat(),
            options=ObjectMetaOptions(max_chunk_size=self._max_message),
        )
        meta_subject = self._meta_subject(name)
        meta = json.dumps(info.as_dict()).encode()
        expected = 0  # no meta yet; a deleted object's tombstone meta is replaced at its sequence
        for _ in range(3):
            try:
                await self._js.publish(
                    meta_subject,
                    meta,
                    headers={"Nats-Rollup": "sub", "Nats-Expected-Last-Subject-Sequence": str(expected)},
                )
                return True
            except APIError as exc:
                if exc.err_code != WRONG_LAST_SEQUENCE:
                    await self._js.purge_stream(self._stream, subject=chunk_subject)
                    raise
            last = await self._js.get_last_msg(self._stream, meta_subject)
            if not json.loads(last.data or b"{}").get("deleted"):
                break
            expected = last.seq or 0
        await self._js.purge_stream(self._stream, subject=chunk_subject)
        return False

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self._bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def get(self, name: str) -> bytes:
        """Direct gets of the meta and each chunk (no per-object consumer), checked against the digest."""
        try:
            data = await read_object(self._js, self._bucket, name)
        except ObjectCorrupt as exc:
            raise ObjectMissingError(str(exc)) from exc
        if data is None:
            raise ObjectMissingError(name)
        return data

    async def delete(self, name: str) -> bool:
        try:
            await self._store.delete(name)
        except (ObjectNotFoundError, NotFoundError):
            return False
        return True

    async def list(self, under: str) -> list[StoredObject]:
        """Live objects whose name starts with ``prefix + under``."""
        start = self.prefix + under
        infos = await list_objects(self._js, self._bucket)
        return [
            StoredObject(i.name, i.size or 0, _mtime(i)) for i in infos if i.name.startswith(start) and not i.deleted
        ]

    # ------------------------------------------------------------------ typed helpers

    async def get_decoded(self, name: str) -> bytes:
        stored = await self.get(name)
        return await asyncio.to_thread(self.decode, stored)
