"""How many copies every stream keeps: the control side of ``zattera cluster replicas N``.

Served by the join service on ``zattera.cluster.replicas`` (it holds the control credential; the CLI changes
no stream itself). A request without ``stream`` answers the plan: every stream of the account with its
replica count, and the count the cluster recorded. A request naming a stream changes that stream's replica
count and answers once every copy is caught up (or says how far it got). The state stream carries the
recorded configuration, so changing it also records the new count: streams created later use it. The
operator's action (:mod:`shared.actions.replicas`) asks stream by stream, the state stream last, so a
change cut short is finished by running it again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NotFoundError

from shared.actions.refusals import ActionRefused, Conflicting, Invalid, NotFound, Unavailable
from shared.provisioning import js_api, raw_stream_config, update_stream_raw
from shared.streams import CONFIG_METADATA_PREFIX
from shared.subjects import CLUSTER_REPLICAS_SUBJECT, STATE_STREAM

__all__ = ["CLUSTER_REPLICAS_SUBJECT", "StreamChanged", "change", "handler", "plan"]

log = logging.getLogger(__name__)

ALLOWED = (1, 3, 5)
"""An even count survives no more losses than the odd count below it and needs one more server."""
DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 1800.0
LIST_TIMEOUT = 10.0
"""nats-server's meta leader gathers ``STREAM.LIST`` from every stream leader for up to 4 s, then answers
with the ones that did not answer listed as missing."""
INFO_TIMEOUT = 5.0
INFO_TRIES = 2
PLAN_WAIT = 40.0
"""How long the plan may take to answer: the list, then each stream no leader answered for asked again."""
INSUFFICIENT_RESOURCES = 10023
"""nats-server: no set of servers can hold the copies; too few servers with distinct placement tags is said
as "no suitable peers for placement" (err_code 10005 or this one, by version)."""
PLACEMENT_RETRY = 10.0
"""Seconds a change refused for want of peers is sent again before the refusal stands: a busy server the
meta leader has not heard from lately counts as no peer for a moment (seen on a loaded machine)."""
REPLICAS_METADATA = f"{CONFIG_METADATA_PREFIX}replicas"


@dataclass(frozen=True)
class StreamCopies:
    """One stream's replica count and how many of its copies are caught up."""

    stream: str
    replicas: int
    current: int
    leader: str = ""
    servers: tuple[str, ...] = ()

    @property
    def caught_up(self) -> bool:
        return bool(self.leader) and self.current == self.replicas


@dataclass(frozen=True)
class StreamChanged:
    stream: str
    before: int
    after: int
    current: int
    seconds: float
    changed: bool
    servers: tuple[str, ...] = ()


def check_count(replicas: Any) -> int:
    """The requested count, or :class:`Invalid` naming the field."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise Invalid("replicas", "must be a whole number (1, 3 or 5)")
    if replicas not in ALLOWED:
        raise Invalid(
            "replicas",
            f"{replicas} is not allowed: use 1, 3 or 5 (an even count survives no more server losses than the "
            "odd one below it)",
        )
    return replicas


def copies(info: dict[str, Any]) -> StreamCopies:
    """What a ``STREAM.INFO`` answer says of the stream's copies."""
    config = info.get("config") or {}
    cluster = info.get("cluster") or {}
    peers = cluster.get("replicas") or []
    leader = str(cluster.get("leader") or "")
    current = (1 if leader else 0) + sum(1 for p in peers if p.get("current") and not p.get("offline"))
    servers = tuple(sorted([leader] * bool(leader) + [str(p.get("name") or "") for p in peers]))
    return StreamCopies(str(config.get("name") or ""), int(config.get("num_replicas") or 1), current, leader, servers)


async def stream_list(nc: NATS) -> tuple[list[dict[str, Any]], set[str]]:
    """Every stream's ``STREAM.INFO`` as the meta leader gathers them (``STREAM.LIST``, page by page), and the
    names whose leader did not answer it in time: for those the list carries the stream's assignment (its
    configuration, its copies marked offline)."""
    infos: list[dict[str, Any]] = []
    missing: set[str] = set()
    while True:
        page = await js_api(nc, "STREAM.LIST", {"offset": len(infos)}, timeout=LIST_TIMEOUT)
        batch = list(page.get("streams") or [])
        infos += batch
        missing |= {str(n) for n in page.get("missing") or []}
        if not batch or len(infos) >= int(page.get("total") or 0):
            return infos, missing


async def _asked_again(nc: NATS, name: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """A stream the list found no leader for, asked directly (a leader elected meanwhile answers); what the list
    said when none does (a stream whose servers are down answers "stream is offline", or nothing at first);
    None: deleted meanwhile."""
    for _ in range(INFO_TRIES):
        try:
            return await js_api(nc, f"STREAM.INFO.{name}", timeout=INFO_TIMEOUT)
        except NotFoundError:
            return None
        except NatsTimeoutError:
            continue
        except APIError:
            break
    return info


async def plan(nc: NATS) -> dict[str, Any]:
    """Every stream with its replica count, the state stream last (the order a change goes in). A stream no
    leader answers for (its servers down, an election under way) is listed with no leader and its copies
    offline rather than failing the plan: the operator needs the plan most while a server is down."""
    infos, missing = await stream_list(nc)
    streams = []
    recorded = 1
    for info in infos:
        name = str((info.get("config") or {}).get("name") or "")
        answered = await _asked_again(nc, name, info) if name in missing else info
        if answered is None:
            continue  # deleted meanwhile
        streams.append(copies(answered))
        if name == STATE_STREAM:
            config = answered.get("config") or {}
            recorded = int((config.get("metadata") or {}).get(REPLICAS_METADATA) or config.get("num_replicas") or 1)
    streams.sort(key=lambda s: (s.stream == STATE_STREAM, s.stream))
    return {"recorded": recorded, "streams": [asdict(s) for s in streams]}


async def change(
    nc: NATS,
    stream: str,
    replicas: int,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    monotonic: Callable[[], float] = time.monotonic,
    pause: Callable[[float], Awaitable[None]] | None = None,
) -> StreamChanged:
    """Set ``stream``'s replica count and wait until every copy is caught up; :class:`Conflicting` when the
    servers cannot hold the copies or they are not caught up within ``timeout``."""
    import asyncio

    wait = pause or asyncio.sleep
    replicas = check_count(replicas)
    started = monotonic()
    config = await raw_stream_config(nc, stream)
    if config is None:
        raise NotFound(f"no stream {stream!r}", field="stream")
    before = int(config.get("num_replicas") or 1)
    meta = dict(config.get("metadata") or {})
    record = stream == STATE_STREAM and meta.get(REPLICAS_METADATA, str(replicas)) != str(replicas)
    changed = before != replicas or record
    if changed:
        config["num_replicas"] = replicas
        if stream == STATE_STREAM:
            config["metadata"] = meta | {REPLICAS_METADATA: str(replicas)}
        while True:
            try:
                await update_stream_raw(nc, config)
                break
            except APIError as exc:
                if exc.err_code != INSUFFICIENT_RESOURCES and "no suitable peers" not in str(exc.description):
                    raise Conflicting(f"{stream}: the server refused the change: {exc.description}") from None
                if monotonic() - started >= min(timeout, PLACEMENT_RETRY):
                    raise Conflicting(
                        f"cannot place {replicas} copies of {stream}: the cluster has fewer than {replicas} server "
                        "machines able to hold one (each server machine holds at most one copy; join more with "
                        "zattera nodes join-token --server)",
                        field="replicas",
                    ) from None
            await wait(0.5)  # a server the meta leader has not heard from lately is no peer for a moment
        log.info("stream %s: replicas %d -> %d", stream, before, replicas)
    while True:
        try:
            now = copies(await js_api(nc, f"STREAM.INFO.{stream}", timeout=INFO_TIMEOUT))
        except NatsTimeoutError:  # no leader answering yet (the copies moving): asked again until ``timeout``
            now = StreamCopies(stream, replicas, 0)
        if now.caught_up and now.replicas == replicas and len(now.servers) == replicas:
            return StreamChanged(stream, before, replicas, now.current, monotonic() - started, changed, now.servers)
        if monotonic() - started > timeout:
            raise Conflicting(
                f"{stream}: {now.current} of {replicas} copies caught up after {timeout:.0f} s (the change stands "
                "and goes on; run the command again to wait for it)"
            )
        await wait(0.25)


def handler(nc: NATS) -> Callable[[Msg], Awaitable[None]]:
    """The ``zattera.cluster.replicas`` answer: ``{"replicas"}`` → the plan, ``{"replicas", "stream",
    "timeout"}`` → a :class:`StreamChanged` as JSON; a refusal as ``{"refused": …}``."""
    from shared.security.callers import answerable

    async def answer(msg: Msg) -> None:
        if not answerable(msg):
            return
        try:
            request = json.loads(msg.data or b"{}")
            if not isinstance(request, dict):
                raise Invalid("request", "expected a JSON object")
            replicas = check_count(request.get("replicas"))
            stream = request.get("stream")
            if stream is None:
                reply: dict[str, Any] = await plan(nc) | {"replicas": replicas}
            else:
                timeout = request.get("timeout", DEFAULT_TIMEOUT)
                if not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT:
                    raise Invalid("timeout", f"must be between 1 and {MAX_TIMEOUT:.0f} seconds")
                reply = asdict(await change(nc, str(stream), replicas, timeout=float(timeout)))
        except ActionRefused as refused:
            reply = {"refused": refused.to_dict()}
        except (ValueError, TypeError) as exc:
            reply = {"refused": Invalid("request", f"bad request: {exc}").to_dict()}
        except (TimeoutError, APIError) as exc:
            reply = {"refused": Unavailable(f"JetStream did not answer: {exc}").to_dict()}
        await nc.publish(msg.reply, json.dumps(reply).encode())

    return answer
