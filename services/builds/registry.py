"""RegistrySweeper: reclaim image blobs no tag references any more (object store ``zattera-images``).

Mark and sweep: the marks are every blob an ``image.*`` key names (manifest and index bodies, child
manifests, configs, layers); every other blob written more than ``grace`` seconds ago is deleted. So
untagging an image frees exactly what it solely kept alive, shared layers survive, and orphans are
reclaimed too (which reference counts would miss): blobs of interrupted pushes, manifests pushed only by
digest.

Safety with concurrent pushes rests on the protocol in shared/registry.py: a push touches every blob
it uses before tagging, the sweeper re-reads a candidate just before deleting it and deletes with a
compare-and-set on that read. The sweep gives up on its marks once they are older than a third of the
grace period (a push is allowed as much between its touches and its tag).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.clock import Clock
from shared.connection import Connection
from shared.registry import BLOB_GRACE, BlobInfo, BlobStore, image_id
from shared.state.feed import StateView
from shared.subjects import IMAGES_STORE
from shared.txn import Writer

log = logging.getLogger(__name__)

MARK_CATCH_UP = 5.0
"""How long a sweep waits for the view to see every image tag written before it starts."""


def referenced_blobs(images: Iterable[pb.Image]) -> frozenset[str]:
    marks: set[str] = set()
    for image in images:
        marks.add(image.digest)
        marks.update(image.blob_digests)
        marks.update(image.manifest_digests)
        if image.config_digest:
            marks.add(image.config_digest)
    return frozenset(marks)


def collectable(blob: BlobInfo, referenced: frozenset[str], *, now: float, grace: float) -> bool:
    """Unreferenced and not written (or touched) within the grace period."""
    return blob.digest not in referenced and now - blob.written_at >= grace


@dataclass(frozen=True, slots=True)
class SweepReport:
    deleted: tuple[str, ...]
    skipped_recent: int
    freed_bytes: int


@dataclass(eq=False)
class RegistrySweeper:
    conn: Connection
    view: StateView
    clock: Clock
    _: KW_ONLY
    grace: float = BLOB_GRACE
    bucket: str = IMAGES_STORE

    def __post_init__(self) -> None:
        self._blobs = BlobStore(self.conn, self.bucket, clock=self.clock)

    async def untag(self, writer: Writer, repo: str, tag: str) -> bool:
        """Remove the tag ``repo:tag``; False when it does not exist (idempotent)."""
        key = K.image(image_id(repo, tag))
        if self.view.get(K.IMAGE, image_id(repo, tag)) is None:
            return False
        await writer.commit(writer.txn("untag").delete(key))
        return True

    async def untag_and_sweep(self, writer: Writer, repo: str, tag: str) -> SweepReport:
        await self.untag(writer, repo, tag)
        return await self.collect()

    async def collect(self) -> SweepReport:
        """Delete every unreferenced blob older than the grace period."""
        await self.view.catch_up(MARK_CATCH_UP)  # marks must include every tag written before the sweep
        marked_at = self.clock.now()
        referenced = referenced_blobs(self.view.images())
        listed = await self._blobs.list()
        deleted: list[str] = []
        freed = 0
        recent = 0
        for listed_blob in listed:
            if listed_blob.digest in referenced:
                continue
            if self.clock.now() - marked_at > self.grace / 3:
                log.info("registry sweep: marks grew old; the rest waits for the next sweep")
                break
            blob = await self._blobs.stat(listed_blob.digest)
            if blob is None:
                continue
            if not collectable(blob, referenced, now=self.clock.now(), grace=self.grace):
                recent += 1
                continue
            if await self._blobs.delete_if_unchanged(blob):
                deleted.append(blob.digest)
                freed += blob.size
        if deleted:
            log.info("registry sweep: deleted %d blobs (%d bytes)", len(deleted), freed)
        return SweepReport(tuple(deleted), recent, freed)
