"""Node heartbeats into ``zattera-live`` (key ``node.<id>``): one at start, then every ``interval``.

Host figures: CPU % since the previous heartbeat (0–100, host-wide), memory used/total, and the disk of
the data dir. Per instance (keyed by assignment id): CPU % over the last interval (100 = one core, like
Docker) and RSS, each summed over the instance's process and its descendants. An instance's first
sample reads 0 % (psutil needs two readings); a process that cannot be read is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.agent.launchers import InstanceHandle
from shared.clock import Clock, stamp
from shared.connection import Connection
from shared.live import publish_node_heartbeat
from shared.metrics import enabled as metrics_enabled
from shared.metrics import observe_gauges
from shared.tasks import raise_if_cancelling

log = logging.getLogger(__name__)


class HeartbeatPublisher:
    def __init__(
        self,
        conn: Connection,
        node_id: str,
        data_dir: Path,
        instances: Callable[[], Mapping[str, InstanceHandle]],
        clock: Clock,
        *,
        interval: float = 5.0,
        env_of: Callable[[str], str] = lambda assignment_id: "",
        forwarding: Callable[[], tuple[dict[str, int], int]] | None = None,
    ) -> None:
        """``forwarding``: the private-network forwarder's connections to endpoints no longer routed (env id
        → count) and the route snapshot version it follows (None: no forwarder on this node)."""
        self._conn = conn
        self.node_id = node_id
        self._data_dir = data_dir
        self._instances = instances
        self._clock = clock
        self.interval = interval
        self._env_of = env_of
        self._forwarding = forwarding
        # psutil keeps the previous CPU reading in the Process object: reuse one per (pid, create time).
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self.last: cpb.Heartbeat | None = None
        psutil.cpu_percent(interval=None)
        if metrics_enabled():
            observe_gauges(
                "zattera.agent.instance.cpu",
                "%",
                "CPU of each instance on this node over the last heartbeat interval (100 = one core)",
                lambda: self._instance_figures(lambda s: s.cpu_percent),
            )
            observe_gauges(
                "zattera.agent.instance.memory",
                "By",
                "resident memory of each instance on this node (its processes summed)",
                lambda: self._instance_figures(lambda s: float(s.memory_bytes)),
            )

    def _instance_figures(self, figure: Callable[[cpb.InstanceSample], float]) -> list[tuple[float, dict[str, str]]]:
        """The last heartbeat's figure per instance, labelled by assignment id and env id (bounded: the
        instances of this node)."""
        if self.last is None:
            return []
        return [
            (figure(s), {"instance": aid, "env": self._env_of(aid), "node": self.node_id})
            for aid, s in self.last.instances.items()
        ]

    async def run(self) -> None:
        while True:
            try:
                await publish_node_heartbeat(self._conn, self.sample())
            except Exception as exc:
                raise_if_cancelling()  # a stop that nats-py turned into an error ends the loop
                log.warning("heartbeat not published: %s", exc)
            await asyncio.sleep(self.interval)

    def sample(self) -> cpb.Heartbeat:
        hb = cpb.Heartbeat(node_id=self.node_id, cpu_percent=psutil.cpu_percent(interval=None))
        stamp(hb.time, self._clock.now())
        memory = psutil.virtual_memory()
        hb.memory_used_bytes = memory.total - memory.available
        hb.memory_total_bytes = memory.total
        with contextlib.suppress(OSError):
            disk = psutil.disk_usage(str(self._data_dir))
            hb.disk_used_bytes = disk.used
            hb.disk_total_bytes = disk.total
        seen: set[tuple[int, float]] = set()
        for assignment_id, handle in self._instances().items():
            sample = self._instance_sample(handle, seen)
            if sample is not None:
                hb.instances[assignment_id].CopyFrom(sample)
        for key in [k for k in self._procs if k not in seen]:
            del self._procs[key]
        if self._forwarding is not None:
            old, version = self._forwarding()
            for env_id, count in old.items():
                hb.forwarder_old_connections[env_id] = count
            hb.forwarder_routes_version = version
            hb.forwarder_counts = True
        self.last = hb
        return hb

    def _instance_sample(self, handle: InstanceHandle, seen: set[tuple[int, float]]) -> cpb.InstanceSample | None:
        usage = handle.usage()
        if usage is not None:  # a container: the daemon's figures
            return cpb.InstanceSample(cpu_percent=usage[0], memory_bytes=usage[1])
        try:
            root = psutil.Process(handle.pid)
            members = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        sample = cpb.InstanceSample()
        for member in members:
            try:
                key = (member.pid, member.create_time())
                proc = self._procs.setdefault(key, member)
                sample.cpu_percent += proc.cpu_percent(interval=None)
                sample.memory_bytes += proc.memory_info().rss
            except psutil.Error:
                continue
            seen.add(key)
        return sample
