"""LiveView: the latest ephemeral samples from ``zattera-live`` (DESIGN §3).

Keys: ``node.<node_id>`` holds a :class:`Heartbeat` (host usage, per-instance samples, and a node-local
proxy's per-env samples); ``proxy.<proxy_id>`` holds a :class:`ProxyHeartbeat` (per-env in-flight, held,
RPS, last request time). The bucket's TTL (60 s) removes what stops reporting; readers additionally
ignore samples older than :data:`FRESH_FOR` seconds (the reference counted a dead node's last sample
forever). A sample's age is measured from its own ``time`` field against the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.clock import Clock
from shared.natsio import LIVE_PREFIX, LIVE_STREAM, Connection
from shared.telemetry import counter
from shared.view import ChangeFeed

log = logging.getLogger(__name__)

FRESH_FOR = 30.0
NODE = "node"
PROXY = "proxy"

_skipped_counter = counter("zattera.live.skipped", "live samples skipped because they could not be decoded")


def node_key(node_id: str) -> str:
    return f"{NODE}.{node_id}"


def proxy_key(proxy_id: str) -> str:
    return f"{PROXY}.{proxy_id}"


def _ts(msg: cpb.Heartbeat | cpb.ProxyHeartbeat) -> float:
    return float(msg.time.seconds + msg.time.nanos / 1e9)


@dataclass(frozen=True, slots=True)
class EnvTraffic:
    """Per-env request activity summed over every fresh proxy report."""

    inflight: int = 0
    held: int = 0
    rps: float = 0.0
    last_request_at: float = 0.0
    reporters: int = 0


class LiveView:
    def __init__(self, conn: Connection | None, clock: Clock, *, fresh_for: float = FRESH_FOR) -> None:
        self._conn = conn
        self._clock = clock
        self.fresh_for = fresh_for
        self._nodes: dict[str, cpb.Heartbeat] = {}
        self._proxies: dict[str, cpb.ProxyHeartbeat] = {}
        self._feeds: set[ChangeFeed] = set()
        self._sub: Any = None
        self._ready = asyncio.Event()
        self.skipped = 0

    async def start(self, timeout: float = 30.0) -> None:
        assert self._conn is not None
        self._conn.on_reconnect(self._resubscribe)
        await self._subscribe()
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _resubscribe(self) -> None:
        await self.stop()
        with contextlib.suppress(Exception):
            await self._subscribe()

    async def _subscribe(self) -> None:
        assert self._conn is not None

        async def on_msg(msg: Msg) -> None:
            key = msg.subject[len(LIVE_PREFIX) :]
            headers = msg.headers or {}
            deleted = headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers
            self.apply(key, None if deleted else msg.data)
            with contextlib.suppress(Exception):
                if msg.metadata.num_pending == 0:
                    self._ready.set()

        self._sub = await self._conn.js.subscribe(
            f"{LIVE_PREFIX}>",
            stream=LIVE_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=512 * 1024 * 1024,
        )
        info = await self._sub.consumer_info()
        if info.num_pending == 0:
            self._ready.set()

    def apply(self, key: str, data: bytes | None) -> None:
        """Apply one live value (None = removed). Undecodable values are logged, counted and skipped."""
        kind, _, ident = key.partition(".")
        if kind not in (NODE, PROXY) or not ident:
            self._skip(key, "unknown key")
            return
        store: dict[str, Any] = self._nodes if kind == NODE else self._proxies
        if data is None:
            store.pop(ident, None)
        else:
            try:
                msg = cpb.Heartbeat() if kind == NODE else cpb.ProxyHeartbeat()
                msg.ParseFromString(data)
            except (DecodeError, ValueError, RuntimeError) as exc:
                self._skip(key, str(exc))
                return
            store[ident] = msg
        for feed in self._feeds:
            feed._offer(kind, ident)

    def _skip(self, key: str, why: str) -> None:
        self.skipped += 1
        _skipped_counter.add(1)
        log.warning("live: skipped value under %r: %s", key, why)

    def subscribe(self, kinds: Iterable[str] = ()) -> ChangeFeed:
        feed = ChangeFeed(self, kinds)
        self._feeds.add(feed)
        return feed

    def _fresh(self, sample_time: float) -> bool:
        return self._clock.now() - sample_time <= self.fresh_for

    # ------------------------------------------------------------------ reads

    def node_heartbeat(self, node_id: str) -> cpb.Heartbeat | None:
        """The latest heartbeat of a node, however old (liveness decides on its age)."""
        return self._nodes.get(node_id)

    def node_seen_at(self, node_id: str) -> float | None:
        hb = self._nodes.get(node_id)
        return _ts(hb) if hb is not None else None

    def fresh_node_heartbeats(self) -> dict[str, cpb.Heartbeat]:
        return {node_id: hb for node_id, hb in self._nodes.items() if self._fresh(_ts(hb))}

    def fresh_proxy_heartbeats(self) -> list[cpb.ProxyHeartbeat]:
        return [hb for hb in self._proxies.values() if self._fresh(_ts(hb))]

    def instance_sample(self, node_id: str, assignment_id: str) -> cpb.InstanceSample | None:
        """A fresh per-instance sample, or None when missing or stale."""
        hb = self._nodes.get(node_id)
        if hb is None or not self._fresh(_ts(hb)):
            return None
        return hb.instances.get(assignment_id)

    def env_traffic(self, env_id: str) -> EnvTraffic:
        """Sum of fresh per-env proxy samples (proxy heartbeats and node heartbeats' proxy maps)."""
        inflight = held = reporters = 0
        rps = 0.0
        last = 0.0
        samples: list[cpb.ProxySample] = []
        for phb in self._proxies.values():
            if self._fresh(_ts(phb)) and env_id in phb.envs:
                samples.append(phb.envs[env_id])
        for nhb in self._nodes.values():
            if self._fresh(_ts(nhb)) and env_id in nhb.proxy:
                samples.append(nhb.proxy[env_id])
        for sample in samples:
            reporters += 1
            inflight += sample.inflight
            held += sample.held
            rps += sample.rps
            if sample.HasField("last_request_at"):
                last = max(last, sample.last_request_at.seconds + sample.last_request_at.nanos / 1e9)
        return EnvTraffic(inflight=inflight, held=held, rps=rps, last_request_at=last, reporters=reporters)


async def publish_node_heartbeat(conn: Connection, hb: cpb.Heartbeat) -> int:
    ack = await conn.js.publish(
        LIVE_PREFIX + node_key(hb.node_id), hb.SerializeToString(deterministic=True), stream=LIVE_STREAM
    )
    return int(ack.seq)


async def publish_proxy_heartbeat(conn: Connection, hb: cpb.ProxyHeartbeat) -> int:
    ack = await conn.js.publish(
        LIVE_PREFIX + proxy_key(hb.proxy_id), hb.SerializeToString(deterministic=True), stream=LIVE_STREAM
    )
    return int(ack.seq)
