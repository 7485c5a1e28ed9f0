"""Place: choose nodes for new replicas of a release, a pure function over the view.

The rules:

* **filters**, in node-id order, the first failing one decides: ``exclude``; ALIVE and schedulable
  (and the WORKER role: control-only nodes get no replicas); platform (sets the
  arch flag); label constraints, a missing label reading as "" (sets the label flag); the stateful
  volume pin.
* **reservations**, never live usage: every RUN assignment reserves its release's resources (100 m /
  256 MB per zero dimension); a zero capacity dimension is unlimited. ``cur + need <= capacity`` fits.
* **greedy pick**, re-scored after every pick, smallest key wins: (replicas of this env on the node,
  replicas of this env in the node's region, -free memory (unlimited = most), node id).
* **names**: the filters are :data:`FILTERS` and the score's terms :data:`SCORES`;
  :func:`shared.placement.explain.explain` counts, per filter, the nodes it removed, so a shortfall says why
  ("5 nodes: 3 filtered by arch, 2 by memory"). It is computed when asked (the scheduler's
  ``schedule.no_capacity`` event, ``zattera status``), never on the placement path, which keeps the index's
  speed.
* **errors**, when no candidate survives: the arch error beats the label error; otherwise, and on any
  shortfall, "only k of n" with the picks made so far. Volumes pinned to different nodes give a clear
  error (never silently the first).

Speed (no rescan of every node per pick, nor of every assignment per call): a
:class:`PlacementIndex` keeps, per filter signature (platforms, constraints), the eligible nodes of each
region sorted by free memory. Within a call, nodes already holding replicas of the env are few and live
in small per-region heaps; every other node scores (0, region load, -free, id), so the best of a region
is the first fitting entry of its sorted list, found with a cursor that only moves forward. A heap over
regions yields the pick, and only the picked node's region is re-scored. A call costs
O(regions + picks × log) after the index is built; the scheduler builds one index per pass and feeds it
every decision it makes (:meth:`PlacementIndex.reserve`), so env B's call sees env A's picks exactly as
if they had been written and read back.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from zattera.v1 import types_pb2 as pb

from shared.errors import ZatteraError
from shared.placement.platforms import loose_platform, normalize_platform, platform_set, supports
from shared.state.reader import StateReader
from shared.state.tables import reservation
from shared.volumes import find_volume

__all__ = [
    "FILTERS",
    "SCORES",
    "PlacementError",
    "PlacementIndex",
    "normalize_platform",
    "place",
    "supports",
]


FILTERS = ("excluded", "not alive", "cordoned", "control only", "arch", "labels", "volume pin", "cpu", "memory")
"""Placement's filters by name, in the order they apply; a node that fails several counts under the first:
the caller's exclusions, node status ALIVE, schedulable, the WORKER role, the release's platforms, its
label constraints, the stateful volume pin, then room for one more replica's reservation (cpu, memory)."""


SCORES = ("env replicas on the node", "env replicas in the node's region", "free memory", "node id")
"""The greedy pick's sort key, term by term: fewest replicas of the env on the node, then in its region,
then the most free memory (unreported capacity = unlimited), then the node id."""


UNLIMITED_FREE = 2**63 - 1
"""Free memory of a node with unreported (0) memory capacity: the most preferred target."""


_WORKER = pb.NODE_ROLE_WORKER


_ALIVE = pb.NODE_STATUS_ALIVE


class PlacementError(ZatteraError):
    """Why Place could not pick all ``n`` nodes (the message is what ``schedule.no_capacity`` says).

    ``unplaced`` is how many of the requested replicas got no node; ``reason`` names the blocker
    ("arch", "labels", "pins" or "capacity") so a caller can tell one shortfall from another.
    """

    def __init__(self, message: str, *, reason: str, unplaced: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.unplaced = unplaced


def arch_error(release: pb.Release, env_id: str, n: int) -> PlacementError:
    need = ", ".join(release.platforms)
    message = f"placement: no node with a supported architecture (need one of {need}) for env {env_id}"
    return PlacementError(message, reason="arch", unplaced=n)


def label_error(constraints: Mapping[str, str], env_id: str, n: int) -> PlacementError:
    pairs = ",".join(f"{k}={v}" for k, v in sorted(constraints.items()))
    return PlacementError(
        f"placement: no node matches constraints {pairs} for env {env_id}", reason="labels", unplaced=n
    )


def shortfall_error(placed: int, n: int, env_id: str) -> PlacementError:
    message = f"placement: only {placed} of {n} replicas placeable for env {env_id} (constraints/capacity)"
    return PlacementError(message, reason="capacity", unplaced=n - placed)


def split_pin_error(pins: list[tuple[str, str]], env_id: str, n: int) -> PlacementError:
    where = ", ".join(f'"{name}" on {node}' for name, node in pins)
    message = (
        f"placement: volumes of env {env_id} are pinned to different nodes ({where}); "
        "a stateful replica needs all its volumes on one node"
    )
    return PlacementError(message, reason="pins", unplaced=n)


def volume_pin(view: StateReader, release: pb.Release, env_id: str, n: int = 1) -> tuple[str, PlacementError | None]:
    """The node a stateful release is pinned to by its env's existing volumes ("" = no pin)."""
    spec = release.service
    if not spec.stateful or not spec.volumes:
        return "", None
    env = view.env(env_id)
    if env is None:
        return "", None
    pins: list[tuple[str, str]] = []
    for mount in spec.volumes:
        volume = find_volume(view, env.project_id, env_id, mount.volume_name)
        if volume is not None and volume.node_id:
            pins.append((mount.volume_name, volume.node_id))
    if len({node for _, node in pins}) > 1:
        return "", split_pin_error(pins, env_id, n)
    return (pins[0][1] if pins else ""), None


@dataclass(frozen=True, slots=True)
class _Node:
    """What placement needs of a placeable node (ALIVE, schedulable, WORKER)."""

    id: str
    region: str
    cap_cpu: int
    cap_mem: int
    arch: str
    labels: Mapping[str, str]

    def fits(self, cpu: int, mem: int, need_cpu: int, need_mem: int) -> bool:
        # cpu_fits and mem_fits inlined: this is the innermost test of the greedy pick
        return (self.cap_cpu == 0 or cpu + need_cpu <= self.cap_cpu) and (
            self.cap_mem == 0 or mem + need_mem <= self.cap_mem
        )

    def cpu_fits(self, cpu: int, need_cpu: int) -> bool:
        return self.cap_cpu == 0 or cpu + need_cpu <= self.cap_cpu

    def mem_fits(self, mem: int, need_mem: int) -> bool:
        return self.cap_mem == 0 or mem + need_mem <= self.cap_mem

    def platform_ok(self, wanted: frozenset[str]) -> bool:
        return not wanted or self.arch in wanted

    def labels_ok(self, constraints: Collection[tuple[str, str]]) -> bool:
        return all(self.labels.get(k, "") == v for k, v in constraints)

    def neg_free(self, mem: int) -> int:
        if self.cap_mem == 0:
            return -UNLIMITED_FREE
        return -max(self.cap_mem - mem, 0)


_placeable_cache: WeakKeyDictionary[StateReader, tuple[list[pb.Node], dict[str, _Node]]] = WeakKeyDictionary()


def _placeable_nodes(view: StateReader) -> dict[str, _Node]:
    """Placeable nodes by id, in id order; recomputed only when the view's nodes changed (the view hands
    out the same sorted list object until then)."""
    nodes = view.nodes()
    cached = _placeable_cache.get(view)
    if cached is not None and cached[0] is nodes:
        return cached[1]
    placeable = {node.meta.id: capacity_of(node) for node in nodes if status_filter(node) is None}
    _placeable_cache[view] = (nodes, placeable)
    return placeable


def status_filter(node: pb.Node) -> str | None:
    """The first of the node-status filters that ``node`` fails (None: it is placeable)."""
    if node.status != _ALIVE:
        return "not alive"
    if not node.schedulable:
        return "cordoned"
    if _WORKER not in node.roles:
        return "control only"
    return None


def capacity_of(node: pb.Node) -> _Node:
    labels = node.labels
    return _Node(
        id=node.meta.id,
        region=labels.get("region", ""),
        cap_cpu=node.capacity.cpu_millis,
        cap_mem=node.capacity.memory_mb,
        arch=loose_platform(node.os_arch),
        labels=labels,
    )


_Signature = tuple[frozenset[str], tuple[tuple[str, str], ...]]


@dataclass(slots=True)
class _Pool:
    """Nodes that pass the status, role, platform and label filters for one signature."""

    members: set[str]
    arch_rejected: frozenset[str]
    label_rejected: frozenset[str]
    by_region: dict[str, list[tuple[int, str]]]  # (-free memory, id), sorted


def _count_in(items: Collection[str], excluded: Collection[str]) -> int:
    """How many of ``excluded`` are in ``items`` (``exclude`` is small: a few nodes per call)."""
    return sum(1 for x in excluded if x in items)


@dataclass(slots=True)
class _Picking:
    """Call-local state of a node that holds or received replicas of the env."""

    count: int
    cpu: int
    mem: int


class PlacementIndex:
    """Candidate pools over the view, plus the reservations decided since it was made.

    Use it synchronously (no await between the view read and the decision), as one pass does.
    """

    def __init__(self, view: StateReader) -> None:
        self.view = view
        self._nodes = _placeable_nodes(view)
        self._pools: dict[_Signature, _Pool] = {}
        self._env_delta: dict[str, dict[str, int]] = {}
        self._used_delta: dict[str, tuple[int, int]] = {}

    def _used(self, node_id: str) -> tuple[int, int]:
        """(cpu, mem) reserved on a node: the view's RUN assignments plus the decisions accounted here."""
        cpu, mem = self.view.reserved(node_id)
        delta = self._used_delta.get(node_id)
        return (cpu + delta[0], mem + delta[1]) if delta else (cpu, mem)

    def _region(self, node_id: str) -> str | None:
        """The spread region of any node in the store (None when the node is gone)."""
        info = self._nodes.get(node_id)
        if info is not None:
            return info.region
        node = self.view.node(node_id)
        return None if node is None else node.labels.get("region", "")

    # ------------------------------------------------------------------ the pass overlay

    def reserve(self, node_id: str, env_id: str, cpu: int, mem: int, replicas: int = 1) -> None:
        """Account a decided change of RUN replicas (negative values release them)."""
        per_env = self._env_delta.setdefault(env_id, {})
        per_env[node_id] = per_env.get(node_id, 0) + replicas
        info = self._nodes.get(node_id)
        if info is None:
            return
        old_mem = self._used(node_id)[1]
        d_cpu, d_mem = self._used_delta.get(node_id, (0, 0))
        self._used_delta[node_id] = (d_cpu + cpu, d_mem + mem)
        old, new = (info.neg_free(old_mem), node_id), (info.neg_free(old_mem + mem), node_id)
        if old == new:
            return
        for pool in self._pools.values():
            if node_id in pool.members:
                entries = pool.by_region[info.region]
                del entries[bisect_left(entries, old)]
                insort(entries, new)

    def env_counts(self, env_id: str) -> Mapping[str, int]:
        """RUN replicas of the env per node, including the decisions accounted so far."""
        base = self.view.env_run_by_node(env_id)
        delta = self._env_delta.get(env_id)
        if not delta:
            return base
        merged = dict(base)
        for node_id, d in delta.items():
            merged[node_id] = merged.get(node_id, 0) + d
        return merged

    # ------------------------------------------------------------------ pools

    def _pool(self, release: pb.Release) -> _Pool:
        constraints = tuple(sorted(release.service.placement_constraints.items()))
        signature = (platform_set(release.platforms), constraints)
        pool = self._pools.get(signature)
        if pool is None:
            pool = self._build_pool(*signature)
            self._pools[signature] = pool
        return pool

    def _build_pool(self, wanted: frozenset[str], constraints: tuple[tuple[str, str], ...]) -> _Pool:
        members: set[str] = set()
        arch_rejected: list[str] = []
        label_rejected: list[str] = []
        by_region: dict[str, list[tuple[int, str]]] = {}
        for info in self._nodes.values():
            # _Node.platform_ok and labels_ok, inlined: once per node for every new filter signature
            if wanted and info.arch not in wanted:
                arch_rejected.append(info.id)
            elif constraints and any(info.labels.get(k, "") != v for k, v in constraints):
                label_rejected.append(info.id)
            else:
                members.add(info.id)
                by_region.setdefault(info.region, []).append((info.neg_free(self._used(info.id)[1]), info.id))
        for entries in by_region.values():
            entries.sort()
        return _Pool(members, frozenset(arch_rejected), frozenset(label_rejected), by_region)

    # ------------------------------------------------------------------ Place

    def place(
        self, release: pb.Release, env_id: str, n: int, exclude: Collection[str] = frozenset()
    ) -> tuple[list[str], PlacementError | None]:
        if n <= 0:
            return [], None
        pin, pin_error = volume_pin(self.view, release, env_id, n)
        if pin_error is not None:
            return [], pin_error
        pool = self._pool(release)
        excluded = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        if pin:
            has_candidates = pin in pool.members and pin not in excluded
        else:
            has_candidates = len(pool.members) > _count_in(pool.members, excluded)
        if not has_candidates:
            if len(pool.arch_rejected) > _count_in(pool.arch_rejected, excluded):
                return [], arch_error(release, env_id, n)
            if len(pool.label_rejected) > _count_in(pool.label_rejected, excluded):
                return [], label_error(release.service.placement_constraints, env_id, n)
            return [], shortfall_error(0, n, env_id)
        picks = self._greedy(pool, release, env_id, n, excluded, pin)
        if len(picks) < n:
            return picks, shortfall_error(len(picks), n, env_id)
        return picks, None

    def _greedy(
        self, pool: _Pool, release: pb.Release, env_id: str, n: int, excluded: Collection[str], pin: str
    ) -> list[str]:
        need_cpu, need_mem = reservation(release)
        nodes = self._nodes
        used = self._used
        env_counts = self.env_counts(env_id)
        load: dict[str, int] = {}
        for node_id, count in env_counts.items():
            region = self._region(node_id) if count else None
            if region is not None:
                load[region] = load.get(region, 0) + count

        # Nodes scored individually: with a pin, the pinned node; otherwise those holding the env already.
        # Every other pool member scores 0 replicas and is reached through the sorted region lists.
        held: dict[str, _Picking] = {}
        held_heaps: dict[str, list[tuple[int, int, str]]] = {}
        if pin:
            initial = [pin]
        else:
            initial = [i for i, c in env_counts.items() if c > 0 and i in pool.members and i not in excluded]
        for node_id in initial:
            info = nodes[node_id]
            state = _Picking(env_counts.get(node_id, 0), *used(node_id))
            held[node_id] = state
            held_heaps.setdefault(info.region, []).append((state.count, info.neg_free(state.mem), node_id))
        for heap in held_heaps.values():
            heapq.heapify(heap)
        sorted_lists = {} if pin else pool.by_region
        cursors = dict.fromkeys(sorted_lists, 0)

        def region_best(region: str) -> tuple[int, int, int, str] | None:
            entries = sorted_lists.get(region)
            if entries:
                i = cursors[region]
                while i < len(entries):
                    neg_free, node_id = entries[i]
                    if (
                        node_id not in held
                        and node_id not in excluded
                        and nodes[node_id].fits(*used(node_id), need_cpu, need_mem)
                    ):
                        cursors[region] = i
                        return (0, load.get(region, 0), neg_free, node_id)
                    i += 1
                cursors[region] = i
            heap = held_heaps.get(region)
            while heap:
                count, neg_free, node_id = heap[0]
                state = held[node_id]
                if nodes[node_id].fits(state.cpu, state.mem, need_cpu, need_mem):
                    return (count, load.get(region, 0), neg_free, node_id)
                heapq.heappop(heap)  # reservations only grow within a call: it never fits again
            return None

        best: dict[str, tuple[int, int, int, str] | None] = {}
        ranking: list[tuple[tuple[int, int, int, str], str]] = []
        for region in set(sorted_lists) | set(held_heaps):
            key = best[region] = region_best(region)
            if key is not None:
                ranking.append((key, region))
        heapq.heapify(ranking)

        picks: list[str] = []
        while len(picks) < n and ranking:
            key, region = heapq.heappop(ranking)
            if best[region] != key:
                continue  # superseded by a re-score of this region
            node_id = key[3]
            info = nodes[node_id]
            if node_id in held:
                heapq.heappop(held_heaps[region])  # the pick was this heap's top
            else:
                held[node_id] = _Picking(0, *used(node_id))
            state = held[node_id]
            picks.append(node_id)
            state.count += 1
            state.cpu += need_cpu
            state.mem += need_mem
            load[region] = load.get(region, 0) + 1
            heapq.heappush(held_heaps.setdefault(region, []), (state.count, info.neg_free(state.mem), node_id))
            key = best[region] = region_best(region)
            if key is not None:
                heapq.heappush(ranking, (key, region))
        return picks


def place(
    view: StateReader,
    release: pb.Release,
    env_id: str,
    n: int,
    exclude: Collection[str] = frozenset(),
    *,
    index: PlacementIndex | None = None,
) -> tuple[list[str], PlacementError | None]:
    """Choose up to ``n`` nodes (in pick order, repeats allowed) for new replicas of ``release`` in ``env_id``.

    Returns exactly ``n`` ids and no error, or the picks made so far plus the reason. ``index`` lets a
    caller placing many envs in one pass reuse one :class:`PlacementIndex` (fed with its decisions);
    without it the call builds its own from the view.
    """
    if n <= 0:
        return [], None
    return (index or PlacementIndex(view)).place(release, env_id, n, exclude)
