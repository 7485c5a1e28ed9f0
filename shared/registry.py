"""The image store ("registry"): blobs by digest in object store ``zattera-images``, tags as ``image.*`` keys.

Builders push with :func:`push_image`; agents pull with :func:`fetch_image`. Blobs are OCI content:
layers, configs, image manifests and, for several platforms, an image index. A tag is an
``Image`` under ``image.<image_id(repo, tag)>`` naming the manifest (or index) digest and every blob it
keeps alive. The registry sweeper (services/builds/registry.py) deletes blobs no tag references.

Why pushes are safe against a concurrent sweep (DESIGN: never collect a blob written in the last N
minutes). Every blob carries a "written at" time in its object metadata. A push writes or *touches*
every blob it uses (a compare-and-set of the object's metadata message), then writes the tag, and
re-touches when it took longer than a third of the grace period. The sweeper re-reads a candidate's
metadata just before deleting, skips it when it was written within the grace period, and deletes with
a compare-and-set on that same metadata message. So a blob a push is using is either seen as recent,
or the push's touch and the sweeper's delete race on one revision and exactly one wins (a push whose
touch loses uploads the blob again).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from nats.js.api import ObjectMeta
from nats.js.errors import APIError, NotFoundError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import Clock, RealClock, stamp
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.jetstream import WRONG_LAST_SEQUENCE, read_state_key
from shared.objects import ObjectCorrupt, list_objects, read_object
from shared.subjects import IMAGES_STORE, STATE_PREFIX, STATE_STREAM

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"

BLOB_GRACE = 15 * 60.0
"""A blob written or touched within this many seconds is never collected."""

WRITTEN_AT_HEADER = "Zattera-Written-At"
_DIGEST_RE = re.compile(r"^sha256:[0-9a-fA-F]{64}$")


class RegistryError(ZatteraError):
    pass


class InvalidDigest(RegistryError):
    pass


class BlobUnknown(RegistryError):
    pass


class ManifestUnknown(RegistryError):
    pass


class PlatformUnknown(RegistryError):
    pass


# ---------------------------------------------------------------------------------------- digests and refs


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def parse_digest(text: str) -> str:
    """A valid ``sha256:<64 hex>`` digest, lower-cased; anything else raises :class:`InvalidDigest`."""
    if not _DIGEST_RE.match(text):
        raise InvalidDigest(f"invalid digest {text!r}")
    return text.lower()


def image_id(repo: str, tag: str) -> str:
    """The deterministic id of a tag's ``image.<id>`` key (repo and tag are case-insensitive)."""
    return hashlib.sha256(f"{repo.lower()}:{tag.lower()}".encode()).hexdigest()[:32]


def repository(project_id: str, app_id: str, registry_addr: str = "") -> str:
    """OCI repository names are lower case; ids are upper-case ULIDs, so the whole name is lowered."""
    name = f"{project_id}/{app_id}"
    return (f"{registry_addr}/{name}" if registry_addr else name).lower()


@dataclass(frozen=True, slots=True)
class ImageRef:
    registry: str
    repo: str
    tag: str = ""
    digest: str = ""


def parse_ref(ref: str) -> ImageRef:
    """``[registry/]repo[:tag][@digest]``; the registry is a first component with a dot, a colon or
    ``localhost`` (the Docker rule). Repo and tag are lower-cased."""
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    registry = ""
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, name = first, rest
    return ImageRef(registry=registry, repo=name.lower(), tag=tag.lower(), digest=digest.lower())


# ---------------------------------------------------------------------------------------- blob store


@dataclass(frozen=True, slots=True)
class BlobInfo:
    digest: str
    size: int
    written_at: float
    revision: int
    """Stream sequence of the blob's metadata message: what a compare-and-set expects."""
    nuid: str
    meta: dict[str, Any]


def _written_at(meta: dict[str, Any]) -> float:
    headers = meta.get("headers") or {}
    value = headers.get(WRITTEN_AT_HEADER)
    if isinstance(value, list):
        value = value[0] if value else None
    if value:
        return float(value)
    mtime = meta.get("mtime") or ""
    try:
        return datetime.fromisoformat(str(mtime).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


class BlobStore:
    """Content-addressed blobs in a NATS object store (images or sources), with written-at times and
    compare-and-set touch/delete on the object's metadata message."""

    def __init__(self, conn: Connection, bucket: str = IMAGES_STORE, *, clock: Clock | None = None) -> None:
        self._conn = conn
        self.bucket = bucket
        self._stream = f"OBJ_{bucket}"
        self.clock: Clock = clock or RealClock()

    def _meta_subject(self, name: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    async def stat(self, digest: str) -> BlobInfo | None:
        try:
            msg = await self._conn.js.get_last_msg(self._stream, self._meta_subject(digest))
        except NotFoundError:
            return None
        meta: dict[str, Any] = json.loads(msg.data or b"{}")
        if meta.get("deleted"):
            return None
        return BlobInfo(
            digest=digest,
            size=int(meta.get("size") or 0),
            written_at=_written_at(meta),
            revision=int(msg.seq or 0),
            nuid=str(meta.get("nuid") or ""),
            meta=meta,
        )

    async def has(self, digest: str) -> bool:
        return await self.stat(digest) is not None

    async def put(self, data: bytes, *, digest: str | None = None) -> str:
        """Store ``data`` under its digest, or touch it when present; returns the digest."""
        actual = digest_of(data)
        if digest is not None and parse_digest(digest) != actual:
            raise RegistryError(f"digest mismatch: expected {digest}, content is {actual}")
        while True:
            info = await self.stat(actual)
            if info is None:
                store = await self._conn.js.object_store(self.bucket)
                meta = ObjectMeta(name=actual, headers={WRITTEN_AT_HEADER: [repr(self.clock.now())]})
                await store.put(actual, data, meta=meta)
                return actual
            if await self.touch(info):
                return actual

    async def touch(self, info: BlobInfo) -> bool:
        """Mark the blob as just written; False when it changed since ``info`` (re-read and retry)."""
        meta = dict(info.meta)
        headers = dict(meta.get("headers") or {})
        headers[WRITTEN_AT_HEADER] = [repr(self.clock.now())]
        meta["headers"] = headers
        return await self._replace_meta(info, meta)

    async def delete_if_unchanged(self, info: BlobInfo) -> bool:
        """Delete the blob unless its metadata changed since ``info`` (a push touched or rewrote it)."""
        meta = dict(info.meta)
        meta.update(deleted=True, size=0, chunks=0, digest="", mtime="")
        if not await self._replace_meta(info, meta):
            return False
        if info.nuid:
            await self._conn.js.purge_stream(self._stream, subject=f"$O.{self.bucket}.C.{info.nuid}")
        return True

    async def _replace_meta(self, info: BlobInfo, meta: dict[str, Any]) -> bool:
        headers = {"Nats-Rollup": "sub", "Nats-Expected-Last-Subject-Sequence": str(info.revision)}
        try:
            await self._conn.js.publish(
                self._meta_subject(info.digest), json.dumps(meta).encode(), headers=headers, stream=self._stream
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise
        return True

    async def get(self, digest: str) -> bytes:
        try:
            data = await read_object(self._conn.js, self.bucket, parse_digest(digest))
        except ObjectCorrupt as exc:
            raise BlobUnknown(f"blob unreadable: {exc}") from exc
        if data is None:
            raise BlobUnknown(f"blob unknown: {digest}")
        return data

    async def list(self) -> list[BlobInfo]:
        """Every present blob (written-at as listed; :meth:`stat` again before acting on one)."""
        infos = await list_objects(self._conn.js, self.bucket)
        blobs = []
        for info in infos:
            meta = {"headers": info.headers or {}, "mtime": info.mtime}
            blobs.append(
                BlobInfo(
                    digest=info.name,
                    size=int(info.size or 0),
                    written_at=_written_at(meta),
                    revision=0,
                    nuid=info.nuid,
                    meta=meta,
                )
            )
        return blobs


# ---------------------------------------------------------------------------------------- images


@dataclass(frozen=True, slots=True)
class PlatformImage:
    """What a builder produced for one platform: the image config and the layers (compressed tars)."""

    platform: str
    config: bytes
    layers: Sequence[bytes]


@dataclass(frozen=True, slots=True)
class FetchedImage:
    digest: str
    """The digest the ref resolved to (the index for a multi-platform image)."""
    manifest_digest: str
    platform: str
    config: bytes
    layers: list[bytes]


def _descriptor(media_type: str, data: bytes, **extra: object) -> dict[str, object]:
    return {"mediaType": media_type, "digest": digest_of(data), "size": len(data), **extra}


def _canonical(doc: dict[str, object]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def image_manifest(config: bytes, layers: Sequence[bytes]) -> bytes:
    return _canonical(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": _descriptor(OCI_CONFIG, config),
            "layers": [_descriptor(OCI_LAYER, layer) for layer in layers],
        }
    )


def image_index(children: Sequence[tuple[str, bytes]]) -> bytes:
    """An index over (platform, manifest body) pairs."""
    manifests = []
    for platform, body in children:
        os_name, _, arch = platform.partition("/")
        manifests.append(_descriptor(OCI_MANIFEST, body, platform={"os": os_name, "architecture": arch}))
    return _canonical({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests})


def resolve_platform(index_body: bytes, platform: str) -> str:
    """The child manifest digest of an index for ``platform`` (``os/arch``)."""
    doc = json.loads(index_body)
    for child in doc.get("manifests", []):
        p = child.get("platform") or {}
        if f"{p.get('os', '')}/{p.get('architecture', '')}" == platform:
            return str(child["digest"])
    raise PlatformUnknown(f"no manifest for platform {platform!r}")


def index_platforms(index_body: bytes) -> list[str]:
    doc = json.loads(index_body)
    platforms = []
    for child in doc.get("manifests", []):
        p = child.get("platform") or {}
        platforms.append(f"{p.get('os', '')}/{p.get('architecture', '')}")
    return sorted(platforms)


async def put_image_record(conn: Connection, image: pb.Image) -> None:
    """Write a tag (last writer wins, as a registry tag push)."""
    await conn.js.publish(STATE_PREFIX + K.key_of(image), K.encode(image), stream=STATE_STREAM, timeout=5.0)


async def push_image(
    conn: Connection,
    *,
    repo: str,
    tag: str,
    images: Sequence[PlatformImage],
    build_id: str = "",
    clock: Clock | None = None,
    grace: float = BLOB_GRACE,
) -> pb.Image:
    """Push one image (an index when there are several platforms) and tag it ``repo:tag``."""
    if not images:
        raise RegistryError("an image needs at least one platform")
    blobs = BlobStore(conn, IMAGES_STORE, clock=clock)
    started = blobs.clock.now()
    written: list[bytes] = []
    children: list[tuple[str, bytes]] = []
    config_digest = ""
    for image in images:
        manifest = image_manifest(image.config, image.layers)
        written.extend([image.config, *image.layers, manifest])
        children.append((image.platform, manifest))
        config_digest = config_digest or digest_of(image.config)
    if len(children) == 1:
        top, media_type = children[0][1], OCI_MANIFEST
    else:
        top, media_type = image_index(children), OCI_INDEX
        written.append(top)
    unique = list(dict.fromkeys(written))
    for data in unique:
        await blobs.put(data)
    if blobs.clock.now() - started > grace / 3:
        # A slow push re-touches its blobs so none of them looks older than the grace period to a sweep
        # that has not yet seen the tag.
        for data in unique:
            await blobs.put(data)
    record = pb.Image(
        repo=repo.lower(),
        tag=tag.lower(),
        digest=digest_of(top),
        media_type=media_type,
        config_digest=config_digest,
        blob_digests=[digest_of(d) for d in unique],
        manifest_digests=[digest_of(body) for _, body in children] if len(children) > 1 else [],
        platforms=sorted(i.platform for i in images),
        size_bytes=sum(len(d) for d in unique),
        build_id=build_id,
    )
    record.meta.id = image_id(repo, tag)
    stamp(record.meta.created_at, blobs.clock.now())
    await put_image_record(conn, record)
    return record


async def lookup_tag(conn: Connection, repo: str, tag: str) -> pb.Image | None:
    last = await read_state_key(conn.js, K.image(image_id(repo, tag)))
    return None if last.data is None else pb.Image.FromString(last.data)


async def fetch_image(conn: Connection, ref: str, *, platform: str = "") -> FetchedImage:
    """Resolve ``ref`` (tag or digest) and fetch the manifest, config and layers for ``platform``.

    A multi-platform image needs a platform (``""`` takes its first child).
    """
    parsed = parse_ref(ref)
    digest = parsed.digest
    if not digest:
        record = await lookup_tag(conn, parsed.repo, parsed.tag or "latest")
        if record is None:
            raise ManifestUnknown(f"manifest unknown: {parsed.repo}:{parsed.tag or 'latest'}")
        digest = record.digest
    blobs = BlobStore(conn, IMAGES_STORE)
    try:
        body = await blobs.get(digest)
    except BlobUnknown as exc:
        raise ManifestUnknown(f"manifest unknown: {digest}") from exc
    doc = json.loads(body)
    manifest_digest = digest
    chosen = platform
    if doc.get("mediaType") == OCI_INDEX or "manifests" in doc:
        children = doc.get("manifests", [])
        if not children:
            raise ManifestUnknown(f"empty index {digest}")
        if platform:
            manifest_digest = resolve_platform(body, platform)
        else:
            manifest_digest = str(children[0]["digest"])
            p = children[0].get("platform") or {}
            chosen = f"{p.get('os', '')}/{p.get('architecture', '')}"
        doc = json.loads(await blobs.get(manifest_digest))
    config = await blobs.get(doc["config"]["digest"])
    layers = [await blobs.get(layer["digest"]) for layer in doc.get("layers", [])]
    return FetchedImage(digest=digest, manifest_digest=manifest_digest, platform=chosen, config=config, layers=layers)
