"""Activator: wakes a scaled-to-zero env on request (``zattera.activate``).

Served by every autoscale replica in one queue group (not leader-gated). The request, the reply, the
error reply and the client are in :mod:`shared.activation`.

Semantics: unknown env → error 404; not ``scale_to_zero`` → ``accepted=false``; target
``max(min, 1)``; already at or above the target → ``accepted=true`` without a write (idempotent).

Single flight, cluster-wide: the write expects the env's revision as read. Of concurrent activations
(in this process or in other replicas) one write lands; the others conflict, wait until their view
has caught up, re-read the env, find it warm and answer ``accepted=true`` without writing. There is no
per-process debounce: it could not stop other control nodes, and a wake cannot be undone within seconds
(held requests count as demand), so it would only make a waiting request wait longer.

Errors (gRPC's codes as HTTP-like numbers, :mod:`shared.activation`): 400 undecodable request; 404 env
not found; 503 state view not in sync (retry); 409 the env kept changing under the write (retry); 500
anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.autoscale.common import ReplicaWrite, effective_txn, scale_event, wake_target
from shared import keys as K
from shared.activation import (
    ABORTED,
    ERROR_CODE_HEADER,
    ERROR_HEADER,
    INTERNAL,
    INVALID_ARGUMENT,
    NOT_FOUND,
    UNAVAILABLE,
    ActivateError,
)
from shared.clock import Clock
from shared.connection import Connection
from shared.events import EVENT_WOKEN, EventPublisher, replica_count
from shared.retry import Attempt, RetriesExhausted, commit_with_retry, decide_again
from shared.state.feed import StateView
from shared.subjects import ACTIVATE_SUBJECT, is_direct_request
from shared.telemetry import span
from shared.txn import TxnError, Writer

log = logging.getLogger(__name__)

ACTOR = "system:activator"
QUEUE_GROUP = "zattera-activator"


@dataclass(frozen=True, slots=True)
class Decision:
    """``accepted`` is the reply; ``write`` the wake to commit first (None = answer at once)."""

    accepted: bool
    write: ReplicaWrite | None
    reason: str


def evaluate(env: pb.Environment, revision: int) -> Decision:
    if not env.service.scale_to_zero:
        return Decision(False, None, "not a scale-to-zero env")
    target = wake_target(env)
    if env.effective_replicas >= target:
        return Decision(True, None, "already warm")
    return Decision(True, ReplicaWrite(env, revision, env.effective_replicas, target), "wake")


class Activator:
    def __init__(self, *, conn: Connection, view: StateView, writer: Writer, clock: Clock) -> None:
        self.conn = conn
        self.view = view
        self.writer = writer
        self.clock = clock
        self.wakes = 0
        self.events = EventPublisher(conn)
        self._handlers: set[asyncio.Task[None]] = set()

    async def activate(self, environment_id: str, node_id: str = "") -> cpb.ActivateResponse:
        """Wake the env if needed; raises :class:`ActivateError` with its code."""

        def decide() -> Attempt[Decision]:
            if self.view.stale:
                raise ActivateError(UNAVAILABLE, "state view is not in sync; retry shortly")
            env = self.view.env(environment_id)
            if env is None:
                raise ActivateError(NOT_FOUND, f"environment {environment_id!r} not found")
            decision = evaluate(env, self.view.rev(K.env(environment_id)))
            if decision.write is None:
                return Attempt(None, decision)
            return Attempt(effective_txn(self.writer, decision.write, self.clock.now()), decision)

        try:
            decision = await commit_with_retry(
                self.writer, decide, clock=self.clock, contended=f"environment {environment_id!r}", landed=decide_again
            )
        except RetriesExhausted:
            raise ActivateError(ABORTED, f"environment {environment_id!r} kept changing; retry") from None
        except TxnError as exc:
            raise ActivateError(INTERNAL, f"wake of {environment_id!r} failed: {exc}") from exc
        if decision.write is None:
            return cpb.ActivateResponse(accepted=decision.accepted)
        self.wakes += 1
        message = f"woke {decision.write.env.name} to {replica_count(decision.write.target)} on a request"
        log.info("%s (env %s, by node %r, %s)", message, environment_id, node_id, ACTOR)
        woken = scale_event(decision.write, EVENT_WOKEN, ACTOR, message, self.clock.now())
        if node_id:
            woken.fields["requested_by_node"] = node_id
        await self.events.publish(woken)
        return cpb.ActivateResponse(accepted=True)

    async def handle(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            return  # a reply steered at a subject no requester owns: nobody to answer, nothing to wake for
        with span("activator.activate", headers=msg.headers) as current:
            try:
                request = cpb.ActivateRequest.FromString(msg.data)
            except (DecodeError, ValueError) as exc:
                await self._reply_error(msg, ActivateError(INVALID_ARGUMENT, f"bad ActivateRequest: {exc}"))
                return
            current.set_attribute("environment_id", request.environment_id)
            try:
                response = await self.activate(request.environment_id, request.node_id)
            except ActivateError as exc:
                await self._reply_error(msg, exc)
                return
            except Exception as exc:
                log.exception("activator: activation of %s failed", request.environment_id)
                await self._reply_error(msg, ActivateError(INTERNAL, str(exc)))
                return
            await msg.respond(response.SerializeToString(deterministic=True))

    async def _reply_error(self, msg: Msg, error: ActivateError) -> None:
        if is_direct_request(msg):
            headers = {ERROR_CODE_HEADER: str(error.code), ERROR_HEADER: error.message}
            await self.conn.nc.publish(msg.reply, b"", headers=headers)

    async def serve(self) -> None:
        """Answer ``zattera.activate`` until cancelled; each request is handled concurrently, so
        concurrent wakes share one group commit."""

        async def on_msg(msg: Msg) -> None:
            task = asyncio.create_task(self.handle(msg))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

        sub = await self.conn.nc.subscribe(ACTIVATE_SUBJECT, queue=QUEUE_GROUP, cb=on_msg)
        try:
            await asyncio.Future()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            for task in list(self._handlers):
                task.cancel()
