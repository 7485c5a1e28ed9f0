"""Route snapshots on the wire: what a route builder encodes and a proxy decodes.

Wire format of a snapshot message (on ``zattera.routes.snapshot`` and in ``zattera.routes.get``
replies). The body is a serialized ``RouteSnapshot``, possibly compressed, possibly cut in chunks:

=========================== ==========================================================================
header                      meaning
=========================== ==========================================================================
``Zattera-Routes-Version``  the snapshot's version (decimal); on every message, so a receiver can drop
                            stale and duplicate snapshots without decoding them
``Zattera-Routes-Digest``   SHA-256 (hex) of the snapshot encoded *without* its version: equal content
                            ⇔ equal digest. Route builders compare it; chunks are grouped by it
``Content-Encoding``        ``zstd`` or ``gzip`` when the body (before chunking) is compressed; absent =
                            plain. Builders compress above :data:`COMPRESS_ABOVE` bytes (zstd level 3)
``Zattera-Routes-Chunk``    ``<index>/<count>`` (0-based) when the encoded body exceeds one message
                            (the server's max_payload less :data:`HEADER_ROOM`); absent = one message
``Zattera-Routes-Unchanged`` ``true`` on an empty ``zattera.routes.get`` reply: ``have_version`` is current
=========================== ==========================================================================

Chunks of one snapshot are published back to back, in index order, by one publisher; a receiver
concatenates the ``count`` bodies of one (version, digest) in index order, then decompresses and parses.
The ``ZATTERA_ROUTES`` stream keeps only the last message of the subject, so for a chunked snapshot it
holds only the last chunk: enough for a builder to learn the newest version and digest, never read as
a snapshot. Clients get the whole current snapshot from ``zattera.routes.get`` (replies use the same
messages, sent to the request's reply subject).
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zstandard
from google.protobuf.message import DecodeError
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.errors import ZatteraError

if TYPE_CHECKING:  # a reader of routes (the CLI's `status`) loads nothing of provisioning
    from shared.provisioning import ClusterIdentity

VERSION_HEADER = "Zattera-Routes-Version"


DIGEST_HEADER = "Zattera-Routes-Digest"


CHUNK_HEADER = "Zattera-Routes-Chunk"


UNCHANGED_HEADER = "Zattera-Routes-Unchanged"


ENCODING_HEADER = "Content-Encoding"


ZSTD = "zstd"


GZIP = "gzip"


COMPRESS_ABOVE = 64 * 1024
"""Snapshots larger than this (bytes, serialized) are zstd-compressed."""


HEADER_ROOM = 4096
"""Bytes of a message kept for headers when cutting chunks."""


MAX_SNAPSHOT_BYTES = 1 << 30
"""Decompression bound: a corrupt or hostile body cannot make a receiver allocate more."""


ZSTD_LEVEL = 3


class SnapshotDecodeError(ZatteraError, ValueError):
    """A snapshot message that cannot be decoded (bad header, chunk, compression or protobuf)."""


def content_digest(content: bytes) -> str:
    """Digest of a snapshot encoded without its version (see the module docstring)."""
    return hashlib.sha256(content).hexdigest()


@dataclass(frozen=True, slots=True)
class WireMessage:
    headers: dict[str, str]
    body: bytes


def encode_messages(
    snapshot: bytes, *, version: int, digest: str, max_message_bytes: int, compress_above: int = COMPRESS_ABOVE
) -> list[WireMessage]:
    """The messages carrying one serialized snapshot: compressed above ``compress_above`` bytes, then
    cut in chunks of at most ``max_message_bytes`` (body only). Deterministic: the same snapshot gives
    the same messages on every route replica."""
    headers = {VERSION_HEADER: str(version), DIGEST_HEADER: digest}
    body = snapshot
    if len(snapshot) > compress_above:
        body = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(snapshot)
        headers[ENCODING_HEADER] = ZSTD
    if len(body) <= max_message_bytes:
        return [WireMessage(headers, body)]
    count = -(-len(body) // max_message_bytes)
    return [
        WireMessage(
            {**headers, CHUNK_HEADER: f"{index}/{count}"},
            body[index * max_message_bytes : (index + 1) * max_message_bytes],
        )
        for index in range(count)
    ]


def message_version(headers: Mapping[str, str] | None) -> int | None:
    """The version a message announces, or None when it has no (valid) version header."""
    raw = (headers or {}).get(VERSION_HEADER)
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def decode_body(headers: Mapping[str, str] | None, body: bytes) -> cpb.RouteSnapshot:
    """A whole (reassembled) body → snapshot."""
    encoding = (headers or {}).get(ENCODING_HEADER, "")
    try:
        if encoding == ZSTD:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_SNAPSHOT_BYTES)
        elif encoding == GZIP:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            body = inflater.decompress(body, MAX_SNAPSHOT_BYTES)
            if inflater.unconsumed_tail:
                raise SnapshotDecodeError("gzip body exceeds the snapshot size bound")
        elif encoding:
            raise SnapshotDecodeError(f"unknown Content-Encoding {encoding!r}")
        snapshot = cpb.RouteSnapshot()
        snapshot.ParseFromString(body)
    except (zstandard.ZstdError, zlib.error, gzip.BadGzipFile, DecodeError) as exc:
        raise SnapshotDecodeError(str(exc)) from exc
    return snapshot


class SnapshotAssembler:
    """Turns snapshot messages, single or chunked, back into snapshots.

    Keeps the chunks of one snapshot at a time (the newest version started); an incomplete older set
    is dropped when a newer one starts, so memory stays bounded by one snapshot.
    """

    def __init__(self) -> None:
        self._key: tuple[int, str, int] | None = None
        self._parts: dict[int, bytes] = {}
        self._headers: Mapping[str, str] = {}

    def add(self, headers: Mapping[str, str] | None, body: bytes) -> cpb.RouteSnapshot | None:
        """Feed one message; returns the snapshot once complete. Raises :class:`SnapshotDecodeError`."""
        headers = headers or {}
        chunk = headers.get(CHUNK_HEADER)
        if chunk is None:
            return decode_body(headers, body)
        version = message_version(headers)
        index, count = _parse_chunk(chunk)
        if version is None:
            raise SnapshotDecodeError("chunk without a version")
        key = (version, headers.get(DIGEST_HEADER, ""), count)
        if key != self._key:
            if self._key is not None and version < self._key[0]:
                return None
            self._key, self._parts, self._headers = key, {}, headers
        self._parts[index] = body
        if len(self._parts) < count:
            return None
        whole = b"".join(self._parts[i] for i in range(count))
        self._key, self._parts = None, {}
        return decode_body(self._headers, whole)


def _parse_chunk(value: str) -> tuple[int, int]:
    index_text, _, count_text = value.partition("/")
    if not index_text.isdigit() or not count_text.isdigit():
        raise SnapshotDecodeError(f"bad {CHUNK_HEADER} header {value!r}")
    index, count = int(index_text), int(count_text)
    if not 0 <= index < count:
        raise SnapshotDecodeError(f"bad {CHUNK_HEADER} header {value!r}")
    return index, count


def identity_message(identity: ClusterIdentity) -> cpb.ClusterIdentity:
    """The wire form of a cluster identity."""
    return cpb.ClusterIdentity(id=identity.id, epoch=identity.epoch)


def same_cluster(a: cpb.ClusterIdentity, b: cpb.ClusterIdentity) -> bool:
    """Whether two snapshots' versions are comparable: built from the same cluster's state stream."""
    return a.id == b.id and a.epoch == b.epoch


def cluster_text(identity: cpb.ClusterIdentity) -> str:
    """How messages name a cluster: ``<id> (state since <epoch>)``; an unnamed one says so."""
    if not identity.id and not identity.epoch:
        return "an unnamed cluster"
    return f"cluster {identity.id or '(no id)'} (state since {identity.epoch or '?'})"
