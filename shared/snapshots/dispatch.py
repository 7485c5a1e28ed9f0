"""SnapshotDispatcher: the control side of volume snapshots over NATS (snapshots, restores, pruning).

``start_snapshot`` writes the RUNNING record FIRST, then asks the volume's node on
``zattera.agent.<node>.snapshot`` and follows its progress messages in the background, ending in
COMPLETE (manifest key, logical bytes, uploaded bytes = bytes newly stored) or FAILED with the reason.
Every failure after the record exists (node missing, no agent answering, pre-hook, upload) therefore
leaves a FAILED record that moves the schedule's baseline on: no failure wedges the schedule.

At most one snapshot of a volume runs at a time (:class:`SnapshotBusy`). Prune is serialized against
snapshots (a shared/exclusive lock: snapshots share, prune is exclusive, and prune defers while the view
shows a RUNNING snapshot this dispatcher is not driving), so a running snapshot never loses a chunk it
deduplicated against; the agent's GC grace period additionally protects chunks it just uploaded.

Network deadlines (first reply, silence between progress messages) are real-time I/O timeouts; record
ages (``updated_at`` touches for the stuck-record reaper) come from the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import NotFound
from shared.addons.spec import platform_pre_hook
from shared.clock import Clock, stamp
from shared.connection import Connection
from shared.records import new_meta
from shared.retry import Attempt, RetriesExhausted, commit_with_retry, decide_again
from shared.settings import Settings, settings
from shared.snapshots.guards import (
    SNAPSHOT_KEY_ENV,
    NodeOperationFailed,
    RecordNotWritten,
    RestoreRefused,
    SnapshotBusy,
    SnapshotKeyMismatch,
    describe_key,
    holder_assignment,
    key_fingerprint,
    snapshot_target,
    volume_mounted,
)
from shared.snapshots.locking import SharedExclusiveLock
from shared.snapshots.store import MANIFESTS, SnapshotStore
from shared.state.feed import StateView
from shared.subjects import agent_subject
from shared.telemetry import inject, span
from shared.txn import Deposed, TxnError, Writer

log = logging.getLogger(__name__)


FIRST_REPLY_TIMEOUT = 10.0


IDLE_TIMEOUT = 60.0  # agents re-send progress every 5 s; a minute of silence means the node is gone


TOUCH_EVERY = 600.0  # how often a followed RUNNING record's updated_at is refreshed


PRUNE_TIMEOUT = 900.0


@dataclass
class _Run:
    volume_id: str
    last_progress: float
    last_touch: float


ProgressFn = Callable[[cpb.SnapshotProgress], Awaitable[None]]


@dataclass(eq=False)
class SnapshotDispatcher:
    conn: Connection
    view: StateView
    clock: Clock
    _: KW_ONLY
    target: cpb.SnapshotTarget = field(default_factory=cpb.SnapshotTarget)
    first_reply_timeout: float = FIRST_REPLY_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    touch_every: float = TOUCH_EVERY
    prune_timeout: float = PRUNE_TIMEOUT
    gc_lock: SharedExclusiveLock = field(init=False, default_factory=SharedExclusiveLock)
    _runs: dict[str, _Run] = field(init=False, default_factory=dict)
    _busy_volumes: set[str] = field(init=False, default_factory=set)

    # ------------------------------------------------------------------ queries

    def volume_busy(self, volume_id: str) -> bool:
        if volume_id in self._busy_volumes:
            return True
        return any(s.volume_id == volume_id and s.status == pb.SNAPSHOT_STATUS_RUNNING for s in self.view.snapshots())

    def running_snapshot(self, volume_id: str) -> str:
        """The id of the snapshot of ``volume_id`` this dispatcher is driving ("" when none)."""
        return next((snapshot_id for snapshot_id, run in self._runs.items() if run.volume_id == volume_id), "")

    def last_progress(self, snapshot_id: str) -> float | None:
        run = self._runs.get(snapshot_id)
        return run.last_progress if run else None

    # ------------------------------------------------------------------ snapshot

    async def start_snapshot(self, volume: pb.Volume, writer: Writer) -> asyncio.Task[pb.VolumeSnapshot]:
        """Write the RUNNING record and dispatch; the returned task ends with the final record."""
        volume_id = volume.meta.id
        if self.volume_busy(volume_id):
            raise SnapshotBusy(f"a snapshot of volume {volume_id} is already running")
        self._check_key_matches_store()
        now = self.clock.now()
        record = pb.VolumeSnapshot(
            volume_id=volume_id, status=pb.SNAPSHOT_STATUS_RUNNING, key_fingerprint=key_fingerprint(self.target)
        )
        new_meta(record.meta, now)
        self._busy_volumes.add(volume_id)
        try:
            await writer.commit(writer.txn("snapshot.start").create(record))
        except Deposed:
            self._busy_volumes.discard(volume_id)
            raise
        except TxnError as exc:
            self._busy_volumes.discard(volume_id)
            raise RecordNotWritten(f"RUNNING record for volume {volume_id} not written: {exc}") from exc
        self._runs[record.meta.id] = _Run(volume_id, now, now)
        return asyncio.create_task(self._complete(volume, record, writer))

    def _check_key_matches_store(self) -> None:
        """Refuse a snapshot sealed differently from the newest COMPLETE one of any volume (they share chunks)."""
        complete = [r for r in self.view.snapshots() if r.status == pb.SNAPSHOT_STATUS_COMPLETE]
        if not complete:
            return
        newest = max(complete, key=lambda r: (r.meta.created_at.ToNanoseconds(), r.meta.id))
        ours = key_fingerprint(self.target)
        if newest.key_fingerprint != ours:
            raise SnapshotKeyMismatch(
                f"the snapshot store is sealed with {describe_key(newest.key_fingerprint)} (snapshot {newest.meta.id}) "
                f"but this process has {describe_key(ours)}: set {SNAPSHOT_KEY_ENV} to the cluster's snapshot key"
            )

    async def snapshot(self, volume: pb.Volume, writer: Writer) -> pb.VolumeSnapshot:
        """The manual path: dispatch and wait for the final record."""
        return await (await self.start_snapshot(volume, writer))

    async def _complete(self, volume: pb.Volume, record: pb.VolumeSnapshot, writer: Writer) -> pb.VolumeSnapshot:
        snapshot_id = record.meta.id
        final = pb.VolumeSnapshot()
        final.CopyFrom(record)
        try:
            async with self.gc_lock.shared():
                try:
                    done = await self._snapshot_on_node(volume, record, writer)
                    final.status = pb.SNAPSHOT_STATUS_COMPLETE
                    final.manifest_key = done.manifest_key or snapshot_id
                    final.logical_size_bytes = done.bytes_total
                    final.uploaded_bytes = done.bytes_done
                except Exception as exc:
                    final.status = pb.SNAPSHOT_STATUS_FAILED
                    final.error = str(exc) or type(exc).__name__
                    log.warning("snapshot %s of volume %s failed: %s", snapshot_id, volume.meta.id, final.error)
                await self._write_final(final, writer)
        finally:
            self._runs.pop(snapshot_id, None)
            self._busy_volumes.discard(volume.meta.id)
        return final

    async def _snapshot_on_node(
        self, volume: pb.Volume, record: pb.VolumeSnapshot, writer: Writer
    ) -> cpb.SnapshotProgress:
        node_id = volume.node_id
        if self.view.node(node_id) is None:
            raise NodeOperationFailed(f"volume node {node_id} not found")
        request = cpb.SnapshotVolumeRequest(
            volume=volume,
            snapshot=record,
            # a policy's own hook, else the platform's (a Redis add-on's BGSAVE: shared/addons/spec.py)
            pre_hook_command=volume.snapshot_policy.pre_hook
            or platform_pre_hook(self.view.env(volume.environment_id), volume),
            pre_hook_container_id=holder_assignment(self.view, volume),
            target=self.target,
        )

        async def on_progress(_: cpb.SnapshotProgress) -> None:
            await self._touch(record.meta.id, writer)

        with span("snapshot.dispatch", volume=volume.meta.id, snapshot=record.meta.id, node=node_id):
            return await self._follow(agent_subject(node_id, "snapshot"), request.SerializeToString(), on_progress)

    async def _touch(self, snapshot_id: str, writer: Writer) -> None:
        """Note progress; now and then refresh the record's updated_at so any leader sees it is alive."""
        run = self._runs.get(snapshot_id)
        if run is None:
            return
        now = self.clock.now()
        run.last_progress = now
        if now - run.last_touch < self.touch_every:
            return
        current = self.view.snapshot(snapshot_id)
        if current is None or current.status != pb.SNAPSHOT_STATUS_RUNNING:
            return
        touched = pb.VolumeSnapshot()
        touched.CopyFrom(current)
        stamp(touched.meta.updated_at, now)
        run.last_touch = now
        with contextlib.suppress(TxnError):
            await writer.commit(writer.txn("snapshot.touch").put(touched))

    async def _write_final(self, final: pb.VolumeSnapshot, writer: Writer) -> None:
        """Write the outcome over whatever the record is now (the reaper may have failed it meanwhile);
        a record deleted meanwhile stays deleted (its manifest is then an orphan for the next prune)."""

        def decide() -> Attempt[None]:
            if self.view.snapshot(final.meta.id) is None:
                return Attempt(None, None)
            stamp(final.meta.updated_at, self.clock.now())
            return Attempt(writer.txn("snapshot.finish").put(final), None)

        try:
            await commit_with_retry(
                writer, decide, clock=self.clock, contended=f"snapshot {final.meta.id}", landed=decide_again
            )
        except Deposed:
            raise
        except TxnError as exc:
            log.error("snapshot %s: final status not recorded (%s); the reaper will fail it", final.meta.id, exc)

    # ------------------------------------------------------------------ progress protocol

    async def _follow(self, subject: str, payload: bytes, on_progress: ProgressFn) -> cpb.SnapshotProgress:
        """Send one request and read its progress stream until ``done`` (returned) or ``error`` (raised)."""
        nc = self.conn.nc
        inbox = nc.new_inbox()
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def receive(msg: Msg) -> None:
            await queue.put(msg)

        sub = await nc.subscribe(inbox, cb=receive)
        try:
            await nc.publish(subject, payload, reply=inbox, headers=inject({}))
            timeout = self.first_reply_timeout
            last_seq = 0
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    what = "did not answer" if not last_seq else "stopped reporting progress"
                    raise NodeOperationFailed(f"node agent on {subject} {what} within {timeout:.0f}s") from None
                if msg.headers and msg.headers.get("Status") == "503":
                    raise NodeOperationFailed(f"no agent answering on {subject}")
                progress = cpb.SnapshotProgress.FromString(msg.data)
                timeout = self.idle_timeout
                if progress.sequence and progress.sequence <= last_seq:
                    continue  # a heartbeat overtaken by a newer message
                last_seq = progress.sequence or last_seq + 1
                if progress.error or progress.phase == "error":
                    raise NodeOperationFailed(progress.error or "node reported an error")
                if progress.phase == "done":
                    return progress
                await on_progress(progress)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # ------------------------------------------------------------------ prune

    async def prune(self, volume: pb.Volume, snapshot_ids: list[str]) -> cpb.PruneSnapshotsResponse:
        """Delete the dead snapshots' manifests and collect unreferenced chunks (of every volume: chunks are shared).

        Runs exclusively of this dispatcher's snapshots; defers (deleting nothing) while another process's
        snapshot is RUNNING. Manifests whose record no longer exists (a failed earlier prune, a record
        deleted while its snapshot finished) are pruned too, so nothing pins chunks forever.
        """
        async with self.gc_lock.exclusive():
            await self.view.wait_fresh()
            # Our own RUNNING snapshots are waiting for the shared lock and have not touched the store yet.
            foreign = [
                s.meta.id
                for s in self.view.snapshots()
                if s.status == pb.SNAPSHOT_STATUS_RUNNING and s.meta.id not in self._runs
            ]
            if foreign:
                return cpb.PruneSnapshotsResponse(error=f"deferred: snapshots running ({', '.join(foreign)})")
            dead = sorted(set(snapshot_ids) | await self._orphan_manifests())
            node_id = self._prune_node(volume)
            if not node_id:
                return cpb.PruneSnapshotsResponse(error="no ALIVE node to run the prune")
            request = cpb.PruneSnapshotsRequest(volume=volume, snapshot_ids=dead, target=self.target)
            with span("snapshot.prune.dispatch", volume=volume.meta.id, node=node_id, dead=len(dead)):
                try:
                    reply = await self.conn.nc.request(
                        agent_subject(node_id, "prune"),
                        request.SerializeToString(),
                        timeout=self.prune_timeout,
                        headers=inject({}),
                    )
                except NoRespondersError:
                    return cpb.PruneSnapshotsResponse(error=f"no agent answering on node {node_id}")
                except (NatsTimeoutError, TimeoutError):
                    return cpb.PruneSnapshotsResponse(error=f"prune on node {node_id} timed out")
            return cpb.PruneSnapshotsResponse.FromString(reply.data)

    async def _orphan_manifests(self) -> set[str]:
        store = await SnapshotStore.open(self.conn.js, self.target)
        cut = len(store.prefix + MANIFESTS)
        return {m.name[cut:] for m in await store.list(MANIFESTS) if self.view.snapshot(m.name[cut:]) is None}

    def _prune_node(self, volume: pb.Volume) -> str:
        """The volume's node when ALIVE, else any ALIVE node (the GC is global, not per volume)."""
        node = self.view.node(volume.node_id)
        if node is not None and node.status == pb.NODE_STATUS_ALIVE:
            return volume.node_id
        alive = [n.meta.id for n in self.view.nodes() if n.status == pb.NODE_STATUS_ALIVE]
        return alive[0] if alive else ""

    # ------------------------------------------------------------------ restore

    async def restore(self, volume_id: str, snapshot_id: str, writer: Writer) -> None:
        """Rebuild the volume from a COMPLETE snapshot; refused while the volume is mounted or restoring.

        The volume is RESTORING meanwhile (``updated_at`` = when it entered RESTORING, refreshed every
        ``touch_every`` while the node reports progress), then ACTIVE on success or back to its previous
        status on failure (a NODE_LOST volume stays NODE_LOST). While RESTORING no
        replica is placed on it and no lease is granted; if this process dies mid-restore, the snapshot
        scheduler's reaper ends the RESTORING state after ``restore_timeout`` without a touch.
        """
        volume = self.view.volume(volume_id)
        snapshot = self.view.snapshot(snapshot_id)
        if volume is None:
            raise NotFound(f"volume {volume_id} not found", field="volume_id")
        if snapshot is None or snapshot.status != pb.SNAPSHOT_STATUS_COMPLETE:
            raise RestoreRefused(f"snapshot {snapshot_id} is not COMPLETE")
        if snapshot.key_fingerprint != key_fingerprint(self.target):
            raise SnapshotKeyMismatch(
                f"snapshot {snapshot_id} is sealed with {describe_key(snapshot.key_fingerprint)} but this process has "
                f"{describe_key(key_fingerprint(self.target))}: set {SNAPSHOT_KEY_ENV} to the key it was taken with"
            )
        if volume_id in self._busy_volumes:
            raise SnapshotBusy(f"volume {volume_id} has an operation running")
        self._busy_volumes.add(volume_id)
        try:
            volume = await self._enter_restoring(volume_id, writer)
            previous = volume.status
            request = cpb.RestoreVolumeRequest(
                volume=volume,
                manifest_key=snapshot.manifest_key or snapshot_id,
                snapshot_id=snapshot_id,
                target=self.target,
            )
            last_touch = self.clock.now()

            async def touch(_: cpb.SnapshotProgress) -> None:
                nonlocal last_touch
                now = self.clock.now()
                if now - last_touch >= self.touch_every:
                    last_touch = now
                    await self._touch_restoring(volume_id, writer)

            try:
                async with self.gc_lock.shared():
                    with span("snapshot.restore.dispatch", volume=volume_id, snapshot=snapshot_id):
                        await self._follow(agent_subject(volume.node_id, "restore"), request.SerializeToString(), touch)
            except BaseException:
                await self._set_volume_status(volume_id, previous, writer)
                raise
            await self._set_volume_status(volume_id, pb.VOLUME_STATUS_ACTIVE, writer)
        finally:
            self._busy_volumes.discard(volume_id)

    async def _enter_restoring(self, volume_id: str, writer: Writer) -> pb.Volume:
        """Set RESTORING after re-checking, on the revision written, that the volume is neither mounted nor
        already restoring; returns the volume as it was before."""

        def to_restoring(volume: pb.Volume, now: float) -> None:
            if volume.status == pb.VOLUME_STATUS_RESTORING:
                raise SnapshotBusy(f"volume {volume_id} is already being restored")
            if volume_mounted(self.view, volume, now):
                raise RestoreRefused(f"volume {volume_id} is mounted; stop its service before restoring")
            volume.status = pb.VOLUME_STATUS_RESTORING

        before = await self._update_volume(volume_id, to_restoring, writer)
        if before is None:
            raise RestoreRefused(f"volume {volume_id} not found")
        return before

    async def _touch_restoring(self, volume_id: str, writer: Writer) -> None:
        """Refresh a RESTORING volume's ``updated_at``: the restore is alive, the reaper must wait."""
        current = self.view.volume(volume_id)
        if current is None or current.status != pb.VOLUME_STATUS_RESTORING:
            return
        touched = pb.Volume()
        touched.CopyFrom(current)
        stamp(touched.meta.updated_at, self.clock.now())
        with contextlib.suppress(TxnError):
            await writer.commit(writer.txn("volume.restore.touch").put(touched))

    async def _set_volume_status(self, volume_id: str, status: pb.VolumeStatus.ValueType, writer: Writer) -> None:
        def set_status(volume: pb.Volume, _: float) -> None:
            volume.status = status

        await self._update_volume(volume_id, set_status, writer)

    async def _update_volume(
        self, volume_id: str, change: Callable[[pb.Volume, float], None], writer: Writer
    ) -> pb.Volume | None:
        """Write ``change`` (which may refuse by raising) applied to the volume as the view has it now, stamped
        now; re-read and decide again when a concurrent write (the scheduler's lease renewal, a policy change,
        the reaper) lands first. Returns the volume as it was before; None when it does not exist."""

        def decide() -> Attempt[pb.Volume | None]:
            current = self.view.volume(volume_id)
            if current is None:
                return Attempt(None, None)
            now = self.clock.now()
            updated = pb.Volume()
            updated.CopyFrom(current)
            change(updated, now)
            stamp(updated.meta.updated_at, now)
            return Attempt(writer.txn("volume.restore").put(updated), current)

        try:
            return await commit_with_retry(
                writer, decide, clock=self.clock, contended=f"volume {volume_id}", landed=decide_again
            )
        except RetriesExhausted:
            raise NodeOperationFailed(f"volume {volume_id} kept changing; its status was not written") from None


def operator_dispatcher(
    conn: Connection, view: StateView, clock: Clock, cfg: Settings | None = None
) -> SnapshotDispatcher:
    """The dispatcher of an operator's snapshots and restores (CLI, web console): the cluster's snapshot key
    from the settings; a restore touches its RESTORING volume at least thrice per reaper timeout
    (``restore_timeout``), so a live one is never reaped."""
    cfg = cfg or settings()
    touch_every = min(TOUCH_EVERY, cfg.restore_timeout / 3)
    return SnapshotDispatcher(conn, view, clock, target=snapshot_target(cfg), touch_every=touch_every)
