"""A slow, literal transcription of the reference's Place, the oracle for the fast one.

It rescans every node per pick and every assignment per call, exactly as the reference does, plus the
two fixes this project makes to placement (the WORKER role filter and the split-pin error).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from zattera.v1 import types_pb2 as pb

from shared.placement.placement import (
    UNLIMITED_FREE,
    PlacementError,
    arch_error,
    label_error,
    shortfall_error,
    split_pin_error,
)
from shared.placement.platforms import supports
from shared.state.reader import StateReader


def _need(release: pb.Release | None) -> tuple[int, int]:
    if release is None:
        return 100, 256
    res = release.service.resources
    return res.cpu_millis or 100, res.memory_mb or 256


def reference_place(
    view: StateReader, release: pb.Release, env_id: str, n: int, exclude: Collection[str] = frozenset()
) -> tuple[list[str], PlacementError | None]:
    if n <= 0:
        return [], None
    spec = release.service
    need_cpu, need_mem = _need(release)
    pin = ""
    if spec.stateful and spec.volumes:
        env = view.env(env_id)
        if env is not None:
            pins: list[tuple[str, str]] = []
            for mount in spec.volumes:
                found = None
                for volume in view.volumes():
                    if (
                        volume.project_id == env.project_id
                        and volume.environment_id == env_id
                        and volume.name == mount.volume_name
                    ):
                        found = volume
                        break
                if found is not None and found.node_id:
                    pins.append((mount.volume_name, found.node_id))
            if len({node for _, node in pins}) > 1:
                return [], split_pin_error(pins, env_id, n)
            pin = pins[0][1] if pins else ""

    reserved: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    env_by_node: dict[str, int] = defaultdict(int)
    for a in view.assignments():
        if a.desired != pb.ASSIGNMENT_DESIRED_RUN:
            continue
        cpu, mem = _need(view.release(a.release_id))
        reserved[a.node_id][0] += cpu
        reserved[a.node_id][1] += mem
        if a.environment_id == env_id:
            env_by_node[a.node_id] += 1
    nodes = view.nodes()
    env_by_region: dict[str, int] = defaultdict(int)
    for node in nodes:
        env_by_region[node.labels.get("region", "")] += env_by_node[node.meta.id]

    candidates: list[pb.Node] = []
    arch_rejected = label_rejected = False
    for node in nodes:
        if node.meta.id in exclude:
            continue
        if node.status != pb.NODE_STATUS_ALIVE or not node.schedulable:
            continue
        if pb.NODE_ROLE_WORKER not in node.roles:
            continue
        if not supports(node.os_arch, release.platforms):
            arch_rejected = True
            continue
        if any(node.labels.get(k, "") != v for k, v in spec.placement_constraints.items()):
            label_rejected = True
            continue
        if pin and node.meta.id != pin:
            continue
        candidates.append(node)
    if not candidates:
        if arch_rejected:
            return [], arch_error(release, env_id, n)
        if label_rejected:
            return [], label_error(spec.placement_constraints, env_id, n)

    picks: list[str] = []
    add_res: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    pick_env: dict[str, int] = defaultdict(int)
    pick_region: dict[str, int] = defaultdict(int)
    for _ in range(n):
        best: pb.Node | None = None
        best_key: tuple[int, int, int, str] | None = None
        for node in candidates:
            node_id = node.meta.id
            cur_cpu = reserved[node_id][0] + add_res[node_id][0]
            cur_mem = reserved[node_id][1] + add_res[node_id][1]
            cap = node.capacity
            if cap.cpu_millis and cur_cpu + need_cpu > cap.cpu_millis:
                continue
            if cap.memory_mb and cur_mem + need_mem > cap.memory_mb:
                continue
            free = UNLIMITED_FREE if cap.memory_mb == 0 else max(cap.memory_mb - cur_mem, 0)
            region = node.labels.get("region", "")
            key = (
                env_by_node[node_id] + pick_env[node_id],
                env_by_region[region] + pick_region[region],
                -free,
                node_id,
            )
            if best_key is None or key < best_key:
                best, best_key = node, key
        if best is None:
            break
        picks.append(best.meta.id)
        pick_env[best.meta.id] += 1
        pick_region[best.labels.get("region", "")] += 1
        add_res[best.meta.id][0] += need_cpu
        add_res[best.meta.id][1] += need_mem
    if len(picks) < n:
        return picks, shortfall_error(len(picks), n, env_id)
    return picks, None
