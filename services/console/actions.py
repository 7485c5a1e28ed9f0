"""What a console admin can do: each action is the same fenced write the CLI makes (shared/), decided on the
console's state view and committed by its unfenced writer; a concurrent write refuses it and it is decided
again. Every refusal is an :class:`ActionRefused` whose message names the bad field."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared import jobs as J
from shared import keys as K
from shared.appconfig import ConfigError, check_name, check_secret_value
from shared.clock import RealClock
from shared.deploy import Deployer, DeployError
from shared.errors import ZatteraError
from shared.events import EventPublisher, event_for_env, node_change_event
from shared.natsio import Connection
from shared.retry import Attempt, RetriesExhausted, commit_with_retry
from shared.scaling import ScaleRequest, scaled
from shared.secret_edits import set_secret_edit
from shared.snapshots.dispatch import (
    NodeOperationFailed,
    RecordNotWritten,
    RestoreRefused,
    SnapshotBusy,
    SnapshotDispatcher,
)
from shared.state.feed import StateView
from shared.tasks import cancel_and_wait
from shared.txn import Writer

log = logging.getLogger(__name__)

QUICK_ANSWER = 1.0
"""How long a restore is waited for before the answer is "started" (its refusals come sooner than this)."""
NODE_CHANGES = ("cordon", "uncordon", "drain")


class ActionRefused(ZatteraError):
    pass


class Actions:
    def __init__(self, conn: Connection, view: StateView, writer: Writer, snapshots: SnapshotDispatcher) -> None:
        self._conn = conn
        self._view = view
        self._writer = writer
        self._events = EventPublisher(conn)
        self._snapshots = snapshots
        self._background: set[asyncio.Task[object]] = set()

    async def close(self) -> None:
        """End the snapshots and restores still followed (their records say where they stopped)."""
        await cancel_and_wait(*self._background)

    def _follow(self, task: asyncio.Task[object], what: str) -> None:
        def done(finished: asyncio.Task[object]) -> None:
            self._background.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                log.warning("console: %s failed: %s", what, finished.exception())

        self._background.add(task)
        task.add_done_callback(done)

    def _deployer(self, user: str) -> Deployer:
        return Deployer(self._writer, created_by=f"console:{user}")

    async def _commit_edit(self, what: str, edit: Callable[[], Message | None]) -> Message | None:
        def decide() -> Attempt[Message | None]:
            edited = edit()
            return Attempt(None if edited is None else self._writer.txn().put(edited), edited)

        try:
            return await commit_with_retry(self._writer, decide, clock=RealClock(), contended=what)
        except RetriesExhausted as exc:
            raise ActionRefused(str(exc)) from None

    async def rollback(self, user: str, env_id: str, to_release_id: str) -> pb.Deployment:
        try:
            return await self._deployer(user).rollback(env_id, to_release_id=to_release_id)
        except DeployError as exc:
            raise ActionRefused(str(exc)) from None

    async def scale(self, user: str, env_id: str, request: ScaleRequest) -> pb.Environment:
        problem = request.problem()
        if problem:
            raise ActionRefused(problem)

        def edit() -> pb.Environment:
            env = self._view.env(env_id)
            if env is None:
                raise ActionRefused(f"env {env_id!r} not found")
            try:
                new = scaled(env, request)
            except ValueError as exc:
                raise ActionRefused(str(exc)) from None
            new.meta.updated_at.FromNanoseconds(time.time_ns())
            return new

        new = await self._commit_edit(f"env {env_id}", edit)
        assert isinstance(new, pb.Environment)
        bounds = new.service.replicas
        message = f"scaled to {new.effective_replicas} replica(s) (min {bounds.min}, max {bounds.max})"
        await self._events.publish(event_for_env(new, "env.scaled", message, fields={"actor": f"console:{user}"}))
        return new

    async def change_node(self, user: str, node_id: str, change: str) -> pb.Node | None:
        """Cordon, uncordon or drain a node, as ``zattera nodes cordon|uncordon|drain``."""
        if change not in NODE_CHANGES:
            raise ActionRefused(f"change {change!r}: must be one of {', '.join(NODE_CHANGES)}")
        decided_on: list[tuple[pb.Node, int]] = []

        def edit() -> pb.Node | None:
            node = self._view.node(node_id)
            if node is None:
                raise ActionRefused(f"node {node_id!r} not found")
            decided_on[:] = [(node, self._view.rev(K.node(node_id)))]
            edited = pb.Node()
            edited.CopyFrom(node)
            if change == "cordon":
                if node.status in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED):
                    return None
                edited.schedulable = False
            elif change == "uncordon":
                if node.status == pb.NODE_STATUS_DOWN:
                    raise ActionRefused(f"node {node_id} is down: it cannot be uncordoned until it heartbeats again")
                edited.status = pb.NODE_STATUS_ALIVE
                edited.schedulable = True
            else:
                edited.status = pb.NODE_STATUS_DRAINING
                edited.schedulable = False
            return edited

        edited = await self._commit_edit(f"node {node_id}", edit)
        if isinstance(edited, pb.Node):
            before, revision = decided_on[0]
            event = node_change_event(before, edited, time.time(), actor=f"console:{user}", revision=revision)
            if event is not None:
                await self._events.publish(event)
            return edited
        return None

    async def set_secret(self, user: str, env_id: str, name: str, value: str) -> str:
        """Seal ``value`` to the cluster key and roll it out; returns the deployment id ("" = staged). The
        value is never logged, returned or put in an error."""
        try:
            check_name(f"secrets.{name}", name)
            checked = check_secret_value(name, value.encode())
            done = await self._deployer(user).reconfigure(env_id, set_secret_edit(self._view, name, checked))
        except (ConfigError, DeployError) as exc:
            raise ActionRefused(str(exc)) from None
        return done.deployment.meta.id if done.deployment is not None else ""

    async def cancel_job(self, user: str, env_id: str, job_id: str) -> None:
        """Ask a pending or running job of the env to stop, as ``zattera jobs cancel`` does."""
        job = self._view.get(K.JOB, job_id)
        if not isinstance(job, pb.Job) or job.environment_id != env_id:
            raise ActionRefused(f"job {job_id!r} not found in env {env_id}")
        if not J.is_active(job):
            raise ActionRefused(f"job {job_id} already ended ({J.status_name(job.status)})")
        try:
            await J.request_cancel(self._view, self._writer, job_id, f"canceled by console:{user}")
        except J.CancelCrossed as exc:
            raise ActionRefused(str(exc)) from None

    async def take_snapshot(self, user: str, volume_id: str) -> str:
        """Start a snapshot of the volume on its node (the RUNNING record is written first); returns its id.
        The record moves to COMPLETE or FAILED in the background."""
        volume = self._view.volume(volume_id)
        if volume is None:
            raise ActionRefused(f"volume {volume_id!r} not found")
        try:
            task = await self._snapshots.start_snapshot(volume, self._writer)
        except (SnapshotBusy, RecordNotWritten, RestoreRefused) as exc:
            raise ActionRefused(str(exc)) from None
        self._follow(task, f"snapshot of volume {volume_id} (by {user})")
        running = [
            s for s in self._view.snapshots() if s.volume_id == volume_id and s.status == pb.SNAPSHOT_STATUS_RUNNING
        ]
        return running[-1].meta.id if running else ""

    async def restore(self, user: str, volume_id: str, snapshot_id: str) -> bool:
        """Rebuild the volume from a COMPLETE snapshot; True when it finished within :data:`QUICK_ANSWER`,
        False when it goes on in the background (the volume shows RESTORING meanwhile)."""
        task = asyncio.create_task(self._snapshots.restore(volume_id, snapshot_id, self._writer))
        done, _ = await asyncio.wait({task}, timeout=QUICK_ANSWER)
        if not done:
            self._follow(task, f"restore of volume {volume_id} from {snapshot_id} (by {user})")
            return False
        try:
            task.result()
        except (RestoreRefused, SnapshotBusy, NodeOperationFailed) as exc:
            raise ActionRefused(str(exc)) from None
        return True
