"""The snapshot engine: snapshot a directory into the object store, restore it, garbage-collect.

Snapshot pipeline: a worker thread walks the volume as a deterministic tar stream, cuts it
with FastCDC and hashes each chunk (both release the GIL); the event loop records every chunk in the
manifest and, for chunks the store does not hold yet, compresses + seals them in worker threads and
uploads up to ``concurrency`` at a time. The manifest is written only after every chunk is stored.

GC safety (never delete a chunk a running snapshot still needs): a chunk is
collected only when no manifest references it AND it is older than ``grace``. An in-flight snapshot's
fresh uploads are therefore never collected. Chunks an in-flight snapshot found already stored (dedup)
are protected by serialization instead: the agent runs prune exclusively of its snapshots and the
control-side dispatcher never prunes while a snapshot is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import queue
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from services.agent.snapshots.chunking import ChunkParams, chunks
from services.agent.snapshots.manifest import ChunkRef, Manifest
from services.agent.snapshots.tarstream import TarStream, extract
from shared.errors import ZatteraError
from shared.snapshots.store import CHUNKS, MANIFESTS, ObjectMissingError, SnapshotStore

DEFAULT_GC_GRACE = 3600.0
PROGRESS_EVERY = 1.0  # seconds between progress reports while nothing new is uploaded

Progress = Callable[[int, int], Awaitable[None]]
"""``progress(bytes_scanned, bytes_uploaded)``: tar bytes read so far, plaintext bytes newly stored."""


class SnapshotError(ZatteraError):
    pass


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    snapshot_id: str
    tar_bytes: int
    uploaded_bytes: int  # plaintext bytes of chunks this snapshot stored (0 when everything deduplicated)
    chunk_count: int
    new_chunks: int


@dataclass(frozen=True, slots=True)
class PruneResult:
    deleted_manifests: int
    deleted_chunks: int
    kept_young_chunks: int  # unreferenced but inside the grace period


_DONE = object()


class _ChunkFeed:
    """Runs the tar → FastCDC → SHA-256 producer in a thread, handing (digest, data) to the event loop."""

    def __init__(self, root: Path, params: ChunkParams, depth: int) -> None:
        self._root = root
        self._params = params
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=depth)
        self._loop = asyncio.get_running_loop()
        self._stop = threading.Event()
        self.scanned = 0
        self._thread = threading.Thread(target=self._produce, name="snapshot-chunker", daemon=True)
        self._thread.start()

    def _hand_over(self, item: object) -> None:
        future = asyncio.run_coroutine_threadsafe(self._queue.put(item), self._loop)
        while not self._stop.is_set():
            try:
                future.result(timeout=0.5)
                return
            except TimeoutError:
                continue
        future.cancel()

    def _produce(self) -> None:
        try:
            with TarStream(self._root) as stream:
                for data in chunks(stream, self._params):  # type: ignore[arg-type]
                    if self._stop.is_set():
                        return
                    self._hand_over((hashlib.sha256(data).hexdigest(), data))
            self._hand_over(_DONE)
        except BaseException as exc:  # surfaced to the awaiting side
            self._hand_over(exc)

    async def next(self) -> tuple[str, bytes] | None:
        item = await self._queue.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise SnapshotError(f"reading the volume failed: {item}") from item
        digest, data = cast(tuple[str, bytes], item)
        self.scanned += len(data)
        return digest, data

    def close(self) -> None:
        self._stop.set()


class SnapshotEngine:
    def __init__(self, store: SnapshotStore, *, params: ChunkParams | None = None, concurrency: int = 8) -> None:
        self.store = store
        self.params = params or ChunkParams()
        self.concurrency = concurrency

    # ------------------------------------------------------------------ snapshot

    async def snapshot(
        self, root: Path, snapshot_id: str, *, created_at_unix: int = 0, progress: Progress | None = None
    ) -> SnapshotResult:
        if not await asyncio.to_thread(root.is_dir):
            raise SnapshotError(f"volume directory {root} does not exist")
        manifest = Manifest(created_at_unix=created_at_unix)
        slots = asyncio.Semaphore(self.concurrency)
        claimed: set[str] = set()  # digests this snapshot already handled (a chunk may repeat in one stream)
        uploads: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []
        counters = {"uploaded": 0, "new": 0}
        last_report = time.monotonic()

        async def report() -> None:
            nonlocal last_report
            last_report = time.monotonic()
            if progress is not None:
                await progress(feed.scanned, counters["uploaded"])

        async def store_chunk(digest: str, data: bytes) -> None:
            try:
                name = self.store.chunk_name(digest)
                if await self.store.exists(name):
                    return
                stored, digest_b64 = await asyncio.to_thread(self.store.encode_with_digest, data)
                if not await self.store.create(name, stored, digest_b64):
                    return  # another snapshot stored the same chunk a moment ago
                counters["uploaded"] += len(data)
                counters["new"] += 1
                await report()
            except BaseException as exc:
                failures.append(exc)
            finally:
                slots.release()

        feed = _ChunkFeed(root, self.params, depth=self.concurrency * 2)
        try:
            await report()
            while (item := await feed.next()) is not None:
                if failures:
                    break
                digest, data = item
                manifest.chunks.append(ChunkRef(digest, len(data)))
                manifest.tar_bytes += len(data)
                if digest not in claimed:
                    claimed.add(digest)
                    await slots.acquire()
                    task = asyncio.create_task(store_chunk(digest, data))
                    uploads.add(task)
                    task.add_done_callback(uploads.discard)
                if time.monotonic() - last_report >= PROGRESS_EVERY:
                    await report()
            if uploads:
                await asyncio.gather(*uploads)
        finally:
            feed.close()
            for task in uploads:
                task.cancel()
        if failures:
            raise SnapshotError(f"storing a chunk failed: {failures[0]}") from failures[0]
        encoded = await asyncio.to_thread(self.store.encode, manifest.to_json())
        await self.store.put(self.store.manifest_name(snapshot_id), encoded)
        await report()
        return SnapshotResult(
            snapshot_id=snapshot_id,
            tar_bytes=manifest.tar_bytes,
            uploaded_bytes=counters["uploaded"],
            chunk_count=len(manifest.chunks),
            new_chunks=counters["new"],
        )

    async def manifest(self, snapshot_id: str) -> Manifest:
        data = await self.store.get_decoded(self.store.manifest_name(snapshot_id))
        return Manifest.from_json(data)

    # ------------------------------------------------------------------ restore

    async def restore(self, snapshot_id: str, dest: Path, *, progress: Progress | None = None) -> int:
        """Extract the snapshot into ``dest`` (merging into what is there); returns the tar bytes."""
        manifest = await self.manifest(snapshot_id)
        pipe = _ChunkPipe(depth=self.concurrency * 2)
        extractor = asyncio.create_task(asyncio.to_thread(extract, pipe, dest))  # type: ignore[arg-type]
        fetches = self._fetch_in_order(manifest.chunks)
        done = 0
        try:
            for fetch in fetches:
                chunk = await fetch
                if extractor.done():
                    break
                await asyncio.to_thread(pipe.put, chunk)
                done += len(chunk)
                if progress is not None:
                    await progress(done, manifest.tar_bytes)
            pipe.put(None)
            await extractor
        finally:
            fetches.close()
            pipe.abort()
            if not extractor.done():
                extractor.cancel()
        return done

    def _fetch_in_order(self, refs: list[ChunkRef]) -> Generator[asyncio.Task[bytes], None, None]:
        """Tasks fetching the chunks in manifest order, at most ``concurrency`` ahead of the consumer."""
        window: list[asyncio.Task[bytes]] = []
        pending = iter(refs)

        def refill() -> None:
            while len(window) < self.concurrency:
                ref = next(pending, None)
                if ref is None:
                    return
                window.append(asyncio.create_task(self._fetch_chunk(ref)))

        try:
            refill()
            while window:
                yield window.pop(0)
                refill()
        finally:
            for task in window:
                task.cancel()

    async def _fetch_chunk(self, ref: ChunkRef) -> bytes:
        try:
            data = await self.store.get_decoded(self.store.chunk_name(ref.hash))
        except ObjectMissingError as exc:
            raise SnapshotError(f"chunk {ref.hash} is missing from the store") from exc
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.hash:
            raise SnapshotError(f"chunk {ref.hash} does not match its hash")
        return data

    async def restore_replacing(self, snapshot_id: str, volume_dir: Path, *, progress: Progress | None = None) -> int:
        """Rebuild ``volume_dir`` exactly as the snapshot: extract beside it, then swap.

        A failed restore leaves the volume as it was; a successful one leaves no stray files behind
        (never merged into the live directory).
        """
        parent = volume_dir.parent
        staging = parent / f".{volume_dir.name}.restore-{snapshot_id}"
        retired = parent / f".{volume_dir.name}.replaced-{snapshot_id}"
        await asyncio.to_thread(_clear, parent, staging, retired)
        try:
            size = await self.restore(snapshot_id, staging, progress=progress)
        except BaseException:
            await asyncio.to_thread(_clear, parent, staging)
            raise
        await asyncio.to_thread(_swap_in, staging, volume_dir, retired)
        return size

    # ------------------------------------------------------------------ prune / GC

    async def prune(
        self, dead_ids: Iterable[str], *, now: float | None = None, grace: float = DEFAULT_GC_GRACE
    ) -> PruneResult:
        """Delete the dead snapshots' manifests, then every chunk no manifest references (after ``grace``).

        Any unreadable manifest aborts the collection before anything is deleted: losing a chunk of a
        snapshot we cannot read is worse than keeping garbage.
        """
        now = time.time() if now is None else now
        deleted_manifests = 0
        for snapshot_id in dead_ids:
            deleted_manifests += await self.store.delete(self.store.manifest_name(snapshot_id))
        live: set[str] = set()
        names = [m.name for m in await self.store.list(MANIFESTS)]
        for start in range(0, len(names), self.concurrency):
            batch = names[start : start + self.concurrency]
            for data in await asyncio.gather(*(self.store.get_decoded(n) for n in batch)):
                live |= Manifest.from_json(data).hashes()
        cut = len(self.store.prefix + CHUNKS)
        deleted = young = 0
        for obj in await self.store.list(CHUNKS):
            if obj.name[cut:] in live:
                continue
            if now - obj.mtime < grace:
                young += 1
                continue
            deleted += await self.store.delete(obj.name)
        return PruneResult(deleted_manifests, deleted, young)


def _clear(parent: Path, *leftovers: Path) -> None:
    parent.mkdir(parents=True, exist_ok=True)
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_in(staging: Path, volume_dir: Path, retired: Path) -> None:
    if volume_dir.exists():
        os.rename(volume_dir, retired)
    os.rename(staging, volume_dir)
    shutil.rmtree(retired, ignore_errors=True)


class _ChunkPipe:
    """A blocking reader over chunks handed in by the event loop (feeds the tar extractor thread)."""

    def __init__(self, depth: int) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._current = memoryview(b"")
        self._eof = False
        self._aborted = threading.Event()

    def put(self, chunk: bytes | None) -> None:
        while not self._aborted.is_set():
            try:
                self._queue.put(chunk, timeout=0.5)
                return
            except queue.Full:
                continue

    def abort(self) -> None:
        self._aborted.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            if not self._current:
                if self._eof:
                    break
                chunk = self._queue.get()
                if chunk is None:
                    self._eof = True
                    break
                self._current = memoryview(chunk)
            take = len(self._current) if size < 0 else min(size - len(out), len(self._current))
            out += self._current[:take]
            self._current = self._current[take:]
        return bytes(out)
