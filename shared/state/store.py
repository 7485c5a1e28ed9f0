"""StateStore: the pure, indexed, in-memory copy of the ``zattera-state`` bucket (no NATS).

What fills it is someone else's concern (:class:`shared.state.feed.StateView` follows the bucket; a test
applies messages directly); the store only applies entries and answers reads:

* Each value is decoded by kind (:mod:`shared.keys`); an undecodable value or key is logged with its key,
  counted in :attr:`StateStore.skipped` (per kind in ``skipped_by_kind`` and the ``zattera.view.skipped``
  metric) and skipped; the store keeps working. Garbage written over a valid value removes that value, so
  the store agrees with one filled afterwards.
* ``observed.<node>.<id>`` is joined into the matching assignment, so readers see
  ``Assignment.observed`` filled (the Kubernetes spec/status split). A RUNNING report does not
  downgrade HEALTHY/UNHEALTHY of the same container (:func:`merge_observed`).
* Indexes are maintained incrementally on every change: by kind, by environment, by node, per-node
  reservations of RUN assignments, and per-env/per-node RUN replica counts. Placement never rescans
  all assignments.
* Every entry keeps its revision (the stream sequence of its last write), which is what a fenced
  write expects (:mod:`shared.txn`). A writer applies its successful writes with
  :meth:`StateStore.apply_local` (read-your-writes); the echo from the watch is then ignored.
* Changes are delivered to :class:`shared.state.changes.ChangeFeed` subscribers, coalesced per
  (kind, id), filtered by kind: a loop subscribes to what it reacts to, so its own lease renewals never
  wake it.

Messages handed out by the store are shared: callers must not mutate them (copy, then write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from google.protobuf.message import DecodeError, Message
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.changes import ChangeFeed
from shared.state.tables import ENV_INDEXED, RUN, Entry, Indexes, Tables, entry_msg, merge_observed, reservation
from shared.telemetry import counter

log = logging.getLogger(__name__)


UNKNOWN_KIND = "unknown"
"""The kind :attr:`StateStore.skipped_by_kind` counts keys under that name no known kind."""


_skipped_counter = counter("zattera.view.skipped", "state values skipped because they could not be decoded")


Snapshot = dict[str, tuple[int, bytes | None, str]]
"""key -> (revision, value or None for a deletion, traceparent or ""): a whole bucket read at once."""


class StateStore:
    """The indexed in-memory state; see the module docstring. ``name`` labels its logs and metrics."""

    def __init__(self, *, name: str = "view") -> None:
        self._name = name
        self._t = Tables()
        self._items = self._t.by_kind
        self._key_of: dict[tuple[str, str], str] = {}
        self._revs: dict[str, int] = {}
        self._traces: dict[str, tuple[int, str]] = {}
        self._observed: dict[tuple[str, str], pb.AssignmentObserved] = {}
        self._idx = Indexes()
        self._feeds: set[ChangeFeed] = set()
        self._sorted_cache: dict[str, list[Any]] = {}
        self.skipped = 0
        self.skipped_by_kind: Counter[str] = Counter()
        """Skipped values per key kind (:data:`UNKNOWN_KIND` for keys that name no kind)."""
        self.applied = 0
        self.last_revision = 0
        self._revision_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._kind_revisions: dict[str, int] = {}

    # ------------------------------------------------------------------ applying changes

    def apply_raw(self, key: str, rev: int, data: bytes | None, traceparent: str = "") -> None:
        """Apply one stored value (None: the key was deleted) as the stream delivered it at ``rev``."""
        if traceparent:
            self._note_trace(key, rev, traceparent)
        self._apply_raw(key, rev, data)

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Replace the content with a whole-bucket read: keys it lacks are removed, the others applied in
        revision order (subscribers see exactly what changed)."""
        present = {key for key, (_, data, _) in snapshot.items() if data is not None}
        for key in [k for k in self._revs if k not in present]:
            self._apply_raw(key, self._revs[key], None, force=True)
        for key, (rev, data, traceparent) in sorted(snapshot.items(), key=lambda kv: kv[1][0]):
            self.apply_raw(key, rev, data, traceparent)

    def _apply_raw(self, key: str, rev: int, data: bytes | None, *, force: bool = False) -> None:
        if not force and rev <= self._revs.get(key, 0) and data is not None:
            return
        if rev > self.last_revision:
            self.last_revision = rev
            if self._revision_waiters:
                self._release_revision_waiters()
        try:
            k = K.parse(key)
        except K.BadKey as exc:
            self._skip(key, rev, exc, kind=UNKNOWN_KIND)
            return
        self._note_kind_revision(k.kind, rev)
        if data is None:
            self._remove(k, key)
            return
        try:
            msg = K.decode(k.kind, data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            # The key's value is now garbage: forget the previous one, as a store filled now would
            # never have seen it, and keep the revision so that a fenced write can replace it.
            self._remove(k, key)
            self._skip(key, rev, exc, kind=k.kind)
            return
        if other := K.names_another_key(msg, key):  # garbage too: readers would write under its id
            self._remove(k, key)
            self._skip(key, rev, K.BadKey(f"the value's own id names {other!r}"), kind=k.kind)
            return
        self._revs[key] = rev
        self._put(k, key, msg, rev)

    def _skip(self, key: str, rev: int, exc: Exception, *, kind: str) -> None:
        self.skipped += 1
        self.skipped_by_kind[kind] += 1
        self._revs[key] = rev
        _skipped_counter.add(1, {"view": self._name, "kind": kind})
        log.warning("view %s: skipped undecodable value under %r (rev %d): %s", self._name, key, rev, exc)

    def apply_local(self, key: str, rev: int, msg: Message | None, traceparent: str = "") -> None:
        """Apply a write this process just committed (read-your-writes before the watch echo arrives)."""
        if rev <= self._revs.get(key, 0):
            return
        if traceparent:
            self._note_trace(key, rev, traceparent)
        if rev > self.last_revision:
            self.last_revision = rev
            if self._revision_waiters:
                self._release_revision_waiters()
        k = K.parse(key)
        self._note_kind_revision(k.kind, rev)
        if msg is None:
            self._remove(k, key)
            return
        self._revs[key] = rev
        if k.kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            decoded = pb.Assignment()
            decoded.CopyFrom(msg)
            decoded.ClearField("observed")
            msg = decoded
        self._put(k, key, msg, rev)

    def _release_revision_waiters(self) -> None:
        waiting = []
        for revision, reached in self._revision_waiters:
            if revision <= self.last_revision:
                if not reached.done():
                    reached.set_result(None)
            else:
                waiting.append((revision, reached))
        self._revision_waiters = waiting

    async def wait_for_revision(self, revision: int, timeout: float) -> bool:
        """Wait until the store has applied every write up to ``revision`` (a state stream sequence, which
        also moves on writes that change nothing the store holds); False when ``timeout`` passes first."""
        if self.last_revision >= revision:
            return True
        reached = asyncio.get_running_loop().create_future()
        entry = (revision, reached)
        self._revision_waiters.append(entry)
        try:
            await asyncio.wait_for(reached, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._revision_waiters.remove(entry)

    def _note_kind_revision(self, kind: str, rev: int) -> None:
        if rev > self._kind_revisions.get(kind, 0):
            self._kind_revisions[kind] = rev

    def _note_trace(self, key: str, rev: int, traceparent: str) -> None:
        held = self._traces.get(key)
        if held is None or rev >= held[0]:
            self._traces[key] = (rev, traceparent)

    def _put(self, k: K.Key, key: str, msg: Message, rev: int) -> None:
        self.applied += 1
        kind = k.kind
        if kind == K.OBSERVED:
            assert isinstance(msg, pb.AssignmentObserved)
            self._put_observed(k, msg)
            return
        ident = k.id
        items = self._items[kind]
        old = items.get(ident)
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            observed = self._observed.get((k.node_id, ident))
            if observed is not None:
                msg.observed.CopyFrom(observed)
        if old is not None:
            self._unindex(kind, ident, old.msg)
        items[ident] = Entry(msg, rev)
        self._key_of[(kind, ident)] = key
        self._index(kind, ident, msg)
        self._sorted_cache.pop(kind, None)
        self._notify(kind, ident)

    def _put_observed(self, k: K.Key, new: pb.AssignmentObserved) -> None:
        slot = (k.node_id, k.id)
        merged = merge_observed(self._observed.get(slot), new)
        self._observed[slot] = merged
        assignment = entry_msg(self._t.assignment.get(k.id))
        if assignment is not None and assignment.node_id == k.node_id:
            assignment.observed.CopyFrom(merged)
            self._notify(K.ASSIGNMENT, k.id)
        self._notify(K.OBSERVED, k.id)

    def _remove(self, k: K.Key, key: str) -> None:
        self._revs.pop(key, None)
        self._traces.pop(key, None)
        if k.kind == K.OBSERVED:
            slot = (k.node_id, k.id)
            if self._observed.pop(slot, None) is not None:
                assignment = entry_msg(self._t.assignment.get(k.id))
                if assignment is not None and assignment.node_id == k.node_id:
                    assignment.ClearField("observed")
                    self._notify(K.ASSIGNMENT, k.id)
                self._notify(K.OBSERVED, k.id)
            return
        old = self._items[k.kind].pop(k.id, None)
        self._key_of.pop((k.kind, k.id), None)
        if old is None:
            return
        self._unindex(k.kind, k.id, old.msg)
        self._sorted_cache.pop(k.kind, None)
        self._notify(k.kind, k.id)

    def _notify(self, kind: str, ident: str) -> None:
        for feed in self._feeds:
            feed._offer(kind, ident)

    # ------------------------------------------------------------------ indexes

    def _index(self, kind: str, ident: str, msg: Message) -> None:
        field_name = ENV_INDEXED.get(kind)
        if field_name:
            self._idx.by_env[getattr(msg, field_name)][kind][ident] = msg
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            self._idx.assignments_by_node[msg.node_id][ident] = msg
            self._idx.assignments_by_release[msg.release_id].add(ident)
            if msg.desired == RUN:
                self._count_run(ident, msg)
        elif kind == K.RELEASE:
            self._recount_release(ident)

    def _unindex(self, kind: str, ident: str, msg: Message) -> None:
        field_name = ENV_INDEXED.get(kind)
        if field_name:
            env_id = getattr(msg, field_name)
            per_env = self._idx.by_env.get(env_id)
            if per_env is not None:
                per_env[kind].pop(ident, None)
        if kind == K.ASSIGNMENT:
            assert isinstance(msg, pb.Assignment)
            by_node = self._idx.assignments_by_node.get(msg.node_id)
            if by_node is not None:
                by_node.pop(ident, None)
                if not by_node:
                    del self._idx.assignments_by_node[msg.node_id]
            by_release = self._idx.assignments_by_release.get(msg.release_id)
            if by_release is not None:
                by_release.discard(ident)
                if not by_release:
                    del self._idx.assignments_by_release[msg.release_id]
            self._uncount_run(ident)
        elif kind == K.RELEASE:
            self._recount_release(ident)

    def _count_run(self, ident: str, a: pb.Assignment) -> None:
        release = self.release(a.release_id)
        cpu, mem = reservation(release)
        reserved = self._idx.reserved[a.node_id]
        reserved[0] += cpu
        reserved[1] += mem
        self._idx.contribution[ident] = (a.node_id, cpu, mem)
        self._idx.env_node_run[a.environment_id][a.node_id] += 1
        self._idx.run_counted[ident] = (a.environment_id, a.node_id)

    def _uncount_run(self, ident: str) -> None:
        contribution = self._idx.contribution.pop(ident, None)
        if contribution is not None:
            node_id, cpu, mem = contribution
            reserved = self._idx.reserved[node_id]
            reserved[0] -= cpu
            reserved[1] -= mem
            if reserved == [0, 0]:
                del self._idx.reserved[node_id]
        counted = self._idx.run_counted.pop(ident, None)
        if counted is not None:
            env_id, node_id = counted
            per_node = self._idx.env_node_run[env_id]
            per_node[node_id] -= 1
            if per_node[node_id] <= 0:
                del per_node[node_id]
            if not per_node:
                del self._idx.env_node_run[env_id]

    def _recount_release(self, release_id: str) -> None:
        """A release arrived or changed after its assignments: their reservations follow its spec."""
        for aid in list(self._idx.assignments_by_release.get(release_id, ())):
            entry = self._t.assignment.get(aid)
            if entry is not None and aid in self._idx.contribution:
                self._uncount_run(aid)
                self._count_run(aid, entry.msg)

    # ------------------------------------------------------------------ change feeds

    def subscribe(self, kinds: Iterable[str] = ()) -> ChangeFeed:
        feed = ChangeFeed(self, kinds)
        self._feeds.add(feed)
        return feed

    # ------------------------------------------------------------------ generic reads

    def rev(self, key: str) -> int:
        """Revision of the key's last write (0 when absent): the expectation for a fenced write."""
        return self._revs.get(key, 0)

    def kind_revision(self, kind: str) -> int:
        """Newest revision of any put or delete of ``kind`` seen (a delete counts while its marker is seen).

        Unlike :attr:`last_revision` it does not move on writes of other kinds (lease renewals), so
        two views at the same state agree on it: route snapshots derive their version from it.
        """
        return self._kind_revisions.get(kind, 0)

    def trace_headers(self, key: str) -> dict[str, str]:
        """The trace context (``traceparent``) of the key's last write, as headers for ``telemetry.span``:
        a service reacting to a write continues the writer's trace (empty when the write carried none)."""
        held = self._traces.get(key)
        if held is None or held[0] != self._revs.get(key):
            return {}
        return {"traceparent": held[1]}

    def key_of(self, kind: str, ident: str) -> str | None:
        """The state key of a (kind, id) the store holds (what a ChangeFeed reports), else None."""
        return self._key_of.get((kind, ident))

    def get(self, kind: str, ident: str) -> Message | None:
        return entry_msg(self._items[kind].get(ident))

    def count(self, kind: str) -> int:
        return len(self._items[kind])

    def all(self, kind: str) -> list[Any]:
        """Every object of a kind, sorted by id (cached until the kind changes)."""
        cached = self._sorted_cache.get(kind)
        if cached is None:
            items = self._items[kind]
            cached = [items[i].msg for i in sorted(items)]
            self._sorted_cache[kind] = cached
        return cached

    def _of_env(self, kind: str, env_id: str | None) -> list[Any]:
        """Every object of a kind (``env_id`` None), else those of that environment; sorted by id."""
        if env_id is None:
            return self.all(kind)
        objs = self._idx.by_env.get(env_id, {}).get(kind)
        return [objs[i] for i in sorted(objs)] if objs else []

    # ------------------------------------------------------------------ typed reads

    def node(self, node_id: str) -> pb.Node | None:
        return entry_msg(self._t.node.get(node_id))

    def nodes(self) -> list[pb.Node]:
        return self.all(K.NODE)

    def project(self, project_id: str) -> pb.Project | None:
        return entry_msg(self._t.project.get(project_id))

    def app(self, app_id: str) -> pb.App | None:
        return entry_msg(self._t.app.get(app_id))

    def env(self, env_id: str) -> pb.Environment | None:
        return entry_msg(self._t.env.get(env_id))

    def envs(self) -> list[pb.Environment]:
        return self.all(K.ENV)

    def release(self, release_id: str) -> pb.Release | None:
        return entry_msg(self._t.release.get(release_id))

    def releases(self, env_id: str | None = None) -> list[pb.Release]:
        return self._of_env(K.RELEASE, env_id)

    def deployment(self, deployment_id: str) -> pb.Deployment | None:
        return entry_msg(self._t.deployment.get(deployment_id))

    def deployments(self, env_id: str | None = None) -> list[pb.Deployment]:
        return self._of_env(K.DEPLOYMENT, env_id)

    def build(self, build_id: str) -> pb.Build | None:
        return entry_msg(self._t.build.get(build_id))

    def builds(self, env_id: str | None = None) -> list[pb.Build]:
        return self._of_env(K.BUILD, env_id)

    def assignment(self, assignment_id: str) -> pb.Assignment | None:
        return entry_msg(self._t.assignment.get(assignment_id))

    def assignments(self, env_id: str | None = None) -> list[pb.Assignment]:
        return self._of_env(K.ASSIGNMENT, env_id)

    def assignments_by_node(self, node_id: str) -> list[pb.Assignment]:
        objs = self._idx.assignments_by_node.get(node_id)
        return [objs[i] for i in sorted(objs)] if objs else []

    def assignment_ids_by_release(self, release_id: str) -> frozenset[str]:
        return frozenset(self._idx.assignments_by_release.get(release_id, ()))

    def observed(self, node_id: str, assignment_id: str) -> pb.AssignmentObserved | None:
        return self._observed.get((node_id, assignment_id))

    def observed_keys(self) -> Iterator[tuple[str, str]]:
        """(node_id, assignment_id) of every observed report, joined or not."""
        return iter(list(self._observed))

    def volume(self, volume_id: str) -> pb.Volume | None:
        return entry_msg(self._t.volume.get(volume_id))

    def volumes(self, env_id: str | None = None) -> list[pb.Volume]:
        return self._of_env(K.VOLUME, env_id)

    def snapshot(self, snapshot_id: str) -> pb.VolumeSnapshot | None:
        return entry_msg(self._t.snapshot.get(snapshot_id))

    def snapshots(self) -> list[pb.VolumeSnapshot]:
        return self.all(K.SNAPSHOT)

    def domains(self, env_id: str | None = None) -> list[pb.Domain]:
        return self._of_env(K.DOMAIN, env_id)

    def jobs(self, env_id: str | None = None) -> list[pb.Job]:
        """Job runs (cron slots and one-off commands), sorted by id."""
        return self._of_env(K.JOB, env_id)

    def secrets(self, env_id: str) -> list[pb.SealedSecret]:
        """Every sealed secret version of an environment (ciphertexts only)."""
        return self._of_env(K.SECRET, env_id)

    def images(self) -> list[pb.Image]:
        return self.all(K.IMAGE)

    def vip(self, env_id: str) -> pb.ServiceVIP | None:
        return entry_msg(self._t.vip.get(env_id))

    def vips(self) -> list[pb.ServiceVIP]:
        return self.all(K.VIP)

    def lease(self, loop: str) -> pb.Lease | None:
        return entry_msg(self._t.lease.get(loop))

    # ------------------------------------------------------------------ incremental aggregates

    def reserved(self, node_id: str) -> tuple[int, int]:
        """(cpu_millis, memory_mb) reserved on a node by RUN assignments of every env (jobs included)."""
        r = self._idx.reserved.get(node_id)
        return (r[0], r[1]) if r else (0, 0)

    def env_run_by_node(self, env_id: str) -> dict[str, int]:
        """RUN assignments of an env per node (read-only view; do not mutate)."""
        return self._idx.env_node_run.get(env_id, {})

    def env_run_count(self, env_id: str) -> int:
        return sum(self._idx.env_node_run.get(env_id, {}).values())
