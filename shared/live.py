"""LiveView: the latest ephemeral samples from ``zattera-live`` (heartbeats, proxies' demand).

Keys: ``node.<node_id>`` holds a :class:`Heartbeat` (host usage, per-instance samples, and a node-local
proxy's per-env samples); ``proxy.<proxy_id>`` holds a :class:`ProxyHeartbeat` (per-env in-flight, held,
RPS, last request time). The bucket's TTL (60 s) removes what stops reporting; readers additionally
ignore samples older than :data:`FRESH_FOR` seconds (a dead node's last sample does not count forever).
A sample's age is measured from its own ``time`` field against the injected clock.

Besides the raw ``node``/``proxy`` changes, a feed that explicitly asks for them receives derived
changes: ``(ENV_TRAFFIC, env_id)`` when some reporter's sample for that env changed, appeared or
disappeared, and ``(INSTANCE, assignment_id)`` likewise for per-instance samples. The scaling loops use
them to re-evaluate only the environments a heartbeat touched, as soon as it arrives. Per-env and
per-instance indexes keep those reads proportional to an env's reporters, not to the cluster size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.backoff import resubscribing
from shared.clock import Clock
from shared.connection import ClusterUnavailable, Connection
from shared.directget import TooManySubjects, last_per_subject
from shared.jetstream import is_delete_marker
from shared.state.changes import ChangeFeed
from shared.state.feed import CONSUMER_HEARTBEAT, guard_ordered_consumer, server_delivered
from shared.subjects import LIVE_PREFIX, LIVE_STREAM
from shared.tasks import raise_if_cancelling
from shared.telemetry import counter
from shared.watches import WatchSpec
from shared.watches import follow as follow_watch

log = logging.getLogger(__name__)

FRESH_FOR = 30.0
LIVE_WATCH = WatchSpec(LIVE_STREAM, (f"{LIVE_PREFIX}>",), deliver="last_per_subject")
NODE = "node"
PROXY = "proxy"
ACME_CHALLENGE = "acme"
ENV_TRAFFIC = "env"
"""Derived change kind: a reporter's traffic sample for this env id changed (only for feeds that ask)."""
INSTANCE = "instance"
"""Derived change kind: a per-instance sample for this assignment id changed (only for feeds that ask)."""
_DERIVED_KINDS = (ENV_TRAFFIC, INSTANCE)

_skipped_counter = counter("zattera.live.skipped", "live samples skipped because they could not be decoded")


def node_key(node_id: str) -> str:
    return f"{NODE}.{node_id}"


def proxy_key(proxy_id: str) -> str:
    return f"{PROXY}.{proxy_id}"


def _ts(msg: cpb.Heartbeat | cpb.ProxyHeartbeat) -> float:
    return float(msg.time.seconds + msg.time.nanos / 1e9)


def _traffic(msg: cpb.Heartbeat | cpb.ProxyHeartbeat) -> Mapping[str, cpb.ProxySample]:
    return msg.proxy if isinstance(msg, cpb.Heartbeat) else msg.envs


def _changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], old_fresh: bool) -> set[str]:
    """Keys whose value differs between two sample maps (every key when the old sample was stale)."""
    if not old_fresh:
        return set(old) | set(new)
    changed = {k for k in old if k not in new}
    changed.update(k for k, v in new.items() if k not in old or old[k] != v)
    return changed


@dataclass(frozen=True, slots=True)
class EnvTraffic:
    """Per-env request activity summed over every fresh proxy report."""

    inflight: int = 0
    held: int = 0
    rps: float = 0.0
    last_request_at: float = 0.0
    reporters: int = 0


async def proxy_reports(conn: Connection, now: float, *, timeout: float = 2.0) -> list[cpb.ProxyHeartbeat]:
    """The proxies' fresh heartbeats, read once (one direct get of every ``proxy.*`` key: no watch), for a
    command that shows what the proxies serve and where they listen (``zattera status``)."""
    try:
        found = await last_per_subject(conn.nc, LIVE_STREAM, f"{LIVE_PREFIX}{PROXY}.*", timeout)
    except (TimeoutError, NatsError, ClusterUnavailable, TooManySubjects) as exc:
        log.debug("proxy heartbeats not read: %s", exc)
        return []
    reports = []
    for msg in found:
        if is_delete_marker(msg.headers) or not msg.data:
            continue
        with contextlib.suppress(DecodeError):
            heartbeat = cpb.ProxyHeartbeat.FromString(msg.data)
            if now - _ts(heartbeat) <= FRESH_FOR:
                reports.append(heartbeat)
    return reports


class LiveView:
    def __init__(
        self, conn: Connection | None, clock: Clock, *, fresh_for: float = FRESH_FOR, watched: bool = False
    ) -> None:
        """``watched``: follow the bucket through a watch control opens (the CLI, which creates no consumer)."""
        self._conn = conn
        self._watched = watched
        self._clock = clock
        self.fresh_for = fresh_for
        self._nodes: dict[str, cpb.Heartbeat] = {}
        self._proxies: dict[str, cpb.ProxyHeartbeat] = {}
        self._feeds: set[ChangeFeed] = set()
        # env id -> reporter key ("node.<id>" / "proxy.<id>") -> the reporter's latest heartbeat
        self._env_reporters: dict[str, dict[str, cpb.Heartbeat | cpb.ProxyHeartbeat]] = {}
        # assignment id -> node ids whose latest heartbeat carries a sample for it
        self._instance_nodes: dict[str, set[str]] = {}
        # reporter key -> time of its latest heartbeat carrying traffic data (see has_fresh_traffic_data)
        self._traffic_report_times: dict[str, float] = {}
        self._latest_traffic_report = 0.0
        self._sub: Any = None
        self._resubscribing: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.skipped = 0
        self.started_at: float | None = None
        """When :meth:`start` had the view loaded (the injected clock): heartbeats are heard from then on."""

    async def start(self, timeout: float = 30.0) -> None:
        assert self._conn is not None
        self._conn.on_reconnect(self._resubscribe)
        await self._subscribe()
        await asyncio.wait_for(self._ready.wait(), timeout)
        self.started_at = self._clock.now()

    async def stop(self) -> None:
        if self._resubscribing is not None:
            self._resubscribing.cancel()
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _resubscribe(self) -> None:
        if self._resubscribing is None or self._resubscribing.done():
            self._resubscribing = asyncio.create_task(self._resubscribe_until_done())

    async def _resubscribe_until_done(self) -> None:
        """After a reconnect, subscribe again — retried while JetStream cannot answer (a stream electing its
        leader after a server loss): a single failed try left the view deaf for good."""
        await self._unsubscribe()
        backoff = resubscribing()
        while self._conn is not None and not self._conn.closing:
            try:
                await self._subscribe()
                return
            except Exception as exc:
                raise_if_cancelling()
                delay = next(backoff)
                log.warning("live view: subscribing again failed, retrying in %.1fs: %r", delay, exc)
                await asyncio.sleep(delay)

    async def _subscribe(self) -> None:
        assert self._conn is not None

        async def on_msg(msg: Msg) -> None:
            key = msg.subject[len(LIVE_PREFIX) :]
            self.apply(key, None if is_delete_marker(msg.headers) else msg.data)
            with contextlib.suppress(Exception):
                if msg.metadata.num_pending == 0:
                    self._ready.set()

        if self._watched:
            self._sub = await follow_watch(self._conn, LIVE_WATCH, on_msg, caught_up=self._ready)
            return
        self._sub = await self._conn.js.subscribe(
            f"{LIVE_PREFIX}>",
            stream=LIVE_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
            pending_msgs_limit=1_000_000,
            pending_bytes_limit=512 * 1024 * 1024,
            idle_heartbeat=CONSUMER_HEARTBEAT,
        )
        guard_ordered_consumer(self._sub, None)
        info = await self._sub.consumer_info()
        if info.num_pending == 0 and server_delivered(info) == 0:
            self._ready.set()

    def apply(self, key: str, data: bytes | None) -> None:
        """Apply one live value (None = removed). Undecodable values are logged, counted and skipped."""
        kind, _, ident = key.partition(".")
        if kind == ACME_CHALLENGE:
            return  # HTTP-01 answers share the bucket (shared/acmechallenge.py), not samples
        if kind not in (NODE, PROXY) or not ident:
            self._skip(key, "unknown", "unknown key")
            return
        store: dict[str, Any] = self._nodes if kind == NODE else self._proxies
        msg: cpb.Heartbeat | cpb.ProxyHeartbeat | None = None
        if data is not None:
            try:
                msg = cpb.Heartbeat() if kind == NODE else cpb.ProxyHeartbeat()
                msg.ParseFromString(data)
            except (DecodeError, ValueError, RuntimeError) as exc:
                # Garbage replaces the previous sample: serve nothing rather than a stale heartbeat.
                self._skip(key, kind, str(exc))
                msg = None
        old = store.pop(ident, None)
        if msg is not None:
            store[ident] = msg
        self._reindex(key, ident, old, msg)
        for feed in self._feeds:
            feed._offer(kind, ident)

    def _reindex(
        self,
        key: str,
        ident: str,
        old: cpb.Heartbeat | cpb.ProxyHeartbeat | None,
        new: cpb.Heartbeat | cpb.ProxyHeartbeat | None,
    ) -> None:
        """Keep the per-env and per-instance indexes in step and offer the derived changes."""
        old_fresh = old is not None and self._fresh(_ts(old))
        old_traffic = _traffic(old) if old is not None else {}
        new_traffic = _traffic(new) if new is not None else {}
        for env_id in old_traffic:
            if env_id not in new_traffic:
                reporters = self._env_reporters.get(env_id)
                if reporters is not None:
                    reporters.pop(key, None)
                    if not reporters:
                        del self._env_reporters[env_id]
        if new is not None:
            for env_id in new_traffic:
                self._env_reporters.setdefault(env_id, {})[key] = new
        self._note_traffic_report(key, new)
        self._offer_derived(ENV_TRAFFIC, _changed_keys(old_traffic, new_traffic, old_fresh))

        old_instances = old.instances if isinstance(old, cpb.Heartbeat) else {}
        new_instances = new.instances if isinstance(new, cpb.Heartbeat) else {}
        for aid in old_instances:
            if aid not in new_instances:
                nodes = self._instance_nodes.get(aid)
                if nodes is not None:
                    nodes.discard(ident)
                    if not nodes:
                        del self._instance_nodes[aid]
        for aid in new_instances:
            self._instance_nodes.setdefault(aid, set()).add(ident)
        self._offer_derived(INSTANCE, _changed_keys(old_instances, new_instances, old_fresh))

    def _note_traffic_report(self, key: str, new: cpb.Heartbeat | cpb.ProxyHeartbeat | None) -> None:
        """Track the newest heartbeat that carries traffic data: a proxy heartbeat (even with no envs yet)
        or a node heartbeat with a non-empty proxy map. A worker-only node heartbeat is not traffic data
        (counting it would cool envs during an ingress blackout)."""
        old_time = self._traffic_report_times.pop(key, None)
        carries_traffic = isinstance(new, cpb.ProxyHeartbeat) or (isinstance(new, cpb.Heartbeat) and bool(new.proxy))
        if new is not None and carries_traffic:
            new_time = _ts(new)
            self._traffic_report_times[key] = new_time
            if new_time >= self._latest_traffic_report:
                self._latest_traffic_report = new_time
                return
        if old_time is not None and old_time >= self._latest_traffic_report:
            self._latest_traffic_report = max(self._traffic_report_times.values(), default=0.0)

    def _offer_derived(self, kind: str, idents: set[str]) -> None:
        if not idents:
            return
        for feed in self._feeds:
            if kind in feed.kinds:
                for ident in idents:
                    feed._offer(kind, ident)

    def _skip(self, key: str, kind: str, why: str) -> None:
        self.skipped += 1
        _skipped_counter.add(1, {"kind": kind})
        log.warning("live: skipped value under %r: %s", key, why)

    def subscribe(self, kinds: Iterable[str] = ()) -> ChangeFeed:
        """Changes of the given kinds (empty = every raw kind; derived kinds only when named)."""
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

    def fresh_instance_sample(self, assignment_id: str, prefer_node: str = "") -> cpb.InstanceSample | None:
        """A fresh sample of one instance from whichever node reports it (``prefer_node`` first)."""
        nodes = self._instance_nodes.get(assignment_id)
        if not nodes:
            return None
        order = [prefer_node, *sorted(nodes - {prefer_node})] if prefer_node in nodes else sorted(nodes)
        for node_id in order:
            sample = self.instance_sample(node_id, assignment_id)
            if sample is not None:
                return sample
        return None

    def has_fresh_traffic_data(self) -> bool:
        """True when at least one proxy has reported within :attr:`fresh_for` (the blackout guard)."""
        return self._latest_traffic_report > 0 and self._fresh(self._latest_traffic_report)

    def env_traffic(self, env_id: str) -> EnvTraffic:
        """Sum of fresh per-env proxy samples (proxy heartbeats and node heartbeats' proxy maps)."""
        inflight = held = reporters = 0
        rps = 0.0
        last = 0.0
        samples = [_traffic(hb)[env_id] for hb in self._env_reporters.get(env_id, {}).values() if self._fresh(_ts(hb))]
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
