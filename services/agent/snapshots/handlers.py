"""The agent side of snapshot dispatch: request handlers on ``zattera.agent.<node>.snapshot``,
``.restore`` and ``.prune``.

Snapshot and restore stream :class:`SnapshotProgress` messages to the request's reply subject, each with a
per-operation ``sequence``, re-sent at least every ``heartbeat`` seconds so the dispatcher can tell a slow
operation from a dead one; the last message has phase ``done`` or ``error``. Prune answers with one
:class:`PruneSnapshotsResponse`.

Volumes live at ``<volumes_root>/<volume id>`` (the id: names of two envs could collide). A request whose
volume or snapshot ids are not plain ids (:func:`shared.ids.is_safe_id`: no ``..``, ``/`` or absolute
path), whose target names an impossible
bucket or a prefix over :data:`MAX_PREFIX` bytes, or that does not decode, is refused before any file or
object is touched: snapshot and restore answer one ``error`` progress message, prune a response with
``error`` set. (Ids, bucket and prefix end up in NATS subjects: unbounded, one request could push a
subject past the server's 4 KiB control line, and the server then drops the agent's connection.)

The pre-hook runs whenever the policy sets one: by default
``/bin/sh -c <command>`` in the volume directory with ``ZATTERA_VOLUME_DIR`` and ``ZATTERA_ASSIGNMENT_ID``
set; a runtime that execs inside its instances injects ``hook_runner``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.snapshots.chunking import ChunkParams
from services.agent.snapshots.engine import DEFAULT_GC_GRACE, SnapshotEngine
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.ids import is_safe_id, unsafe_id
from shared.snapshots.locking import SharedExclusiveLock
from shared.snapshots.store import SnapshotStore
from shared.subjects import agent_subject, is_direct_request
from shared.subprocesses import run_shell
from shared.telemetry import span

log = logging.getLogger(__name__)

HEARTBEAT = 5.0
HOOK_TIMEOUT = 600.0
MAX_PREFIX = 256

M = TypeVar("M", bound=Message)
V = TypeVar("V", cpb.SnapshotVolumeRequest, cpb.RestoreVolumeRequest)
HookRunner = Callable[[str, str, Path], Awaitable[None]]
"""``hook_runner(command, assignment_id, volume_dir)``: raise to abort the snapshot."""


class PreHookError(ZatteraError):
    pass


class BadRequest(ZatteraError, ValueError):
    """A request the agent refuses before touching anything: undecodable, or an id that is not a plain id."""


def decode(cls: type[M], data: bytes) -> M:
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise BadRequest(f"bad request: {exc}") from None


def checked_id(what: str, value: str) -> str:
    if not is_safe_id(value):
        raise BadRequest(f"bad request: {unsafe_id(what, value)}")
    return value


def checked_target(target: cpb.SnapshotTarget) -> cpb.SnapshotTarget:
    """The target, if its bucket name is one NATS could hold and its prefix is bounded."""
    if target.object_store and not is_safe_id(target.object_store):
        raise BadRequest(f"bad request: object store {target.object_store[:64]!r} is not a bucket name")
    if len(target.prefix.encode()) > MAX_PREFIX:
        raise BadRequest(f"bad request: prefix is longer than {MAX_PREFIX} bytes")
    return target


def volume_dir(volumes_root: Path, volume: pb.Volume) -> Path:
    """``<volumes_root>/<volume id>``; :class:`BadRequest` when the id could name a path outside it."""
    return volumes_root / checked_id("volume id", volume.meta.id)


async def run_hook_in_shell(command: str, assignment_id: str, directory: Path) -> None:
    env = dict(os.environ, ZATTERA_VOLUME_DIR=str(directory), ZATTERA_ASSIGNMENT_ID=assignment_id)
    try:
        code = await run_shell(command, cwd=directory, env=env, timeout=HOOK_TIMEOUT)
    except TimeoutError:
        raise PreHookError(f"pre-hook timed out after {HOOK_TIMEOUT:.0f}s") from None
    if code != 0:
        raise PreHookError(f"pre-hook exited {code}")


class _ProgressStream:
    """Numbered progress messages to one reply subject, with a heartbeat re-sending the latest."""

    def __init__(self, conn: Connection, reply: str, snapshot_id: str, heartbeat: float) -> None:
        self._conn = conn
        self._reply = reply
        self._latest = cpb.SnapshotProgress(snapshot_id=snapshot_id)
        self._heartbeat = heartbeat
        self._beat: asyncio.Task[None] | None = None

    async def send(self, phase: str, *, done: int = 0, total: int = 0, error: str = "", manifest_key: str = "") -> None:
        latest = self._latest
        latest.phase, latest.bytes_done, latest.bytes_total = phase, done, total
        latest.error, latest.manifest_key = error, manifest_key
        latest.sequence += 1
        if self._reply:
            await self._conn.nc.publish(self._reply, latest.SerializeToString())
        if self._beat is None and phase not in ("done", "error"):
            self._beat = asyncio.create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat)
            self._latest.sequence += 1
            await self._conn.nc.publish(self._reply, self._latest.SerializeToString())

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        with contextlib.suppress(Exception):
            await self._conn.nc.flush(timeout=5)


@dataclass(frozen=True)
class _VolumeOperation(Generic[V]):
    """How a snapshot or a restore request is served (:meth:`SnapshotAgent._serve_volume_request`)."""

    kind: type[V]
    snapshot_id_of: Callable[[V], str]
    span: str
    failure: str
    """What failed, for the log: formatted with the ``snapshot`` and ``volume`` ids."""
    first_phase: str


_SNAPSHOT = _VolumeOperation(
    cpb.SnapshotVolumeRequest,
    lambda req: req.snapshot.meta.id,
    "snapshot.volume",
    "snapshot {snapshot} of volume {volume}",
    "scan",
)
_RESTORE = _VolumeOperation(
    cpb.RestoreVolumeRequest,
    # The snapshot id names the staging and retired directories beside the volume: checked like it.
    lambda req: req.manifest_key or req.snapshot_id,
    "snapshot.restore",
    "restore of {snapshot} into volume {volume}",
    "download",
)


@dataclass(eq=False)
class SnapshotAgent:
    """Serves one node's snapshot, restore and prune requests."""

    conn: Connection
    node_id: str
    volumes_root: Path
    _: KW_ONLY
    params: ChunkParams | None = None
    hook_runner: HookRunner = run_hook_in_shell
    gc_grace: float = DEFAULT_GC_GRACE
    heartbeat: float = HEARTBEAT
    gc_lock: SharedExclusiveLock = field(init=False, default_factory=SharedExclusiveLock)
    _volume_locks: dict[str, asyncio.Lock] = field(init=False, default_factory=dict)
    _subs: list[Subscription] = field(init=False, default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    async def start(self) -> None:
        handlers = {"snapshot": self._on_snapshot, "restore": self._on_restore, "prune": self._on_prune}
        for verb, handler in handlers.items():
            self._subs.append(await self.conn.nc.subscribe(agent_subject(self.node_id, verb), cb=self._spawn(handler)))
        await self.conn.nc.flush()

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, handler: Callable[[Msg], Coroutine[Any, Any, None]]) -> Callable[[Msg], Awaitable[None]]:
        async def callback(msg: Msg) -> None:
            if not is_direct_request(msg):
                log.warning("ignored a message on %s that is not a direct request (reply %r)", msg.subject, msg.reply)
                return
            task = asyncio.create_task(handler(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return callback

    async def _engine(self, target: cpb.SnapshotTarget) -> SnapshotEngine:
        return SnapshotEngine(await SnapshotStore.open(self.conn.js, target), params=self.params)

    def _volume_lock(self, volume_id: str) -> asyncio.Lock:
        return self._volume_locks.setdefault(volume_id, asyncio.Lock())

    async def _refuse(self, msg: Msg, error: str) -> None:
        log.warning("refused a request on %s: %s", msg.subject, error)
        if msg.reply:
            progress = cpb.SnapshotProgress(phase="error", error=error, sequence=1)
            await self.conn.nc.publish(msg.reply, progress.SerializeToString())

    async def _accept(self, msg: Msg, kind: type[V], snapshot_id_of: Callable[[V], str]) -> tuple[V, str, Path] | None:
        """The request of ``msg``, its snapshot id and its volume's directory, all checked; None when it is
        refused (answered with one ``error`` progress message)."""
        try:
            req = decode(kind, msg.data)
            snapshot_id = checked_id("snapshot id", snapshot_id_of(req))
            directory = volume_dir(self.volumes_root, req.volume)
            checked_target(req.target)
        except BadRequest as exc:
            await self._refuse(msg, str(exc))
            return None
        return req, snapshot_id, directory

    async def _serve_volume_request(
        self,
        msg: Msg,
        op: _VolumeOperation[V],
        work: Callable[[V, str, Path, _ProgressStream], Awaitable[tuple[int, int]]],
    ) -> None:
        """A snapshot or restore request (checked by :meth:`_accept`), its progress streamed: the operation's
        first phase at once, then ``work(request, snapshot id, volume directory, stream)`` under the volume's
        lock and a shared GC lock; ``done`` with the (bytes done, bytes total) it returns, or ``error``."""
        accepted = await self._accept(msg, op.kind, op.snapshot_id_of)
        if accepted is None:
            return
        req, snapshot_id, directory = accepted
        stream = _ProgressStream(self.conn, msg.reply, snapshot_id, self.heartbeat)
        try:
            with span(op.span, headers=msg.headers, volume=req.volume.meta.id, snapshot=snapshot_id):
                await stream.send(op.first_phase)
                async with self._volume_lock(req.volume.meta.id), self.gc_lock.shared():
                    done, total = await work(req, snapshot_id, directory, stream)
            await stream.send("done", done=done, total=total, manifest_key=snapshot_id)
        except Exception as exc:
            log.warning("%s failed: %s", op.failure.format(snapshot=snapshot_id, volume=req.volume.meta.id), exc)
            await stream.send("error", error=str(exc) or type(exc).__name__)
        finally:
            await stream.close()

    async def _on_snapshot(self, msg: Msg) -> None:
        await self._serve_volume_request(msg, _SNAPSHOT, self._snapshot)

    async def _snapshot(
        self, req: cpb.SnapshotVolumeRequest, snapshot_id: str, directory: Path, stream: _ProgressStream
    ) -> tuple[int, int]:
        if req.pre_hook_command:
            await stream.send("hooks")
            await self.hook_runner(req.pre_hook_command, req.pre_hook_container_id, directory)
        engine = await self._engine(req.target)

        async def uploaded(scanned: int, stored: int) -> None:
            await stream.send("upload", done=stored, total=scanned)

        result = await engine.snapshot(
            directory, snapshot_id, created_at_unix=req.snapshot.meta.created_at.seconds, progress=uploaded
        )
        return result.uploaded_bytes, result.tar_bytes

    async def _on_restore(self, msg: Msg) -> None:
        await self._serve_volume_request(msg, _RESTORE, self._restore)

    async def _restore(
        self, req: cpb.RestoreVolumeRequest, snapshot_id: str, directory: Path, stream: _ProgressStream
    ) -> tuple[int, int]:
        engine = await self._engine(req.target)

        async def downloaded(done: int, total: int) -> None:
            await stream.send("download", done=done, total=total)

        size = await engine.restore_replacing(snapshot_id, directory, progress=downloaded)
        return size, size

    async def _on_prune(self, msg: Msg) -> None:
        response = cpb.PruneSnapshotsResponse()
        try:
            req = decode(cpb.PruneSnapshotsRequest, msg.data)
            checked_target(req.target)
            for dead in req.snapshot_ids:
                checked_id("snapshot id", dead)
            with span("snapshot.prune", headers=msg.headers, dead=len(req.snapshot_ids)):
                async with self.gc_lock.exclusive():
                    engine = await self._engine(req.target)
                    result = await engine.prune(req.snapshot_ids, grace=self.gc_grace)
            response.deleted_manifests = result.deleted_manifests
            response.deleted_chunks = result.deleted_chunks
        except Exception as exc:
            log.warning("prune failed: %s", exc)
            response.error = str(exc) or type(exc).__name__
        if msg.reply:
            await self.conn.nc.publish(msg.reply, response.SerializeToString())


async def serve_snapshot_requests(agent: SnapshotAgent) -> None:
    """Serve ``agent``'s snapshot/restore/prune requests until cancelled."""
    await agent.start()
    try:
        await asyncio.Event().wait()
    finally:
        await agent.stop()
