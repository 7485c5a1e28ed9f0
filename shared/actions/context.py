"""What every operator action runs with, and the one way it commits.

An action takes an :class:`ActionContext`: the state it reads (the writer's view), the writer it commits
with, the clock, the event publisher and the actor (who is acting: ``operator`` or ``operator:<credential
name>`` for the CLI, ``console:<user>`` for the web console), which goes into the events it emits and the
records it stamps. Nothing in it is tied to the process that builds it, so the same functions can serve
the CLI, the console, or a control-side service answering requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared.actions.refusals import Conflicting
from shared.clock import Clock, RealClock
from shared.connection import Connection
from shared.deploy import Deployer
from shared.events import INFO, EventPublisher, event_for_env, make_event
from shared.retry import Attempt, Decide, RetriesExhausted, commit_with_retry
from shared.state.feed import StateView
from shared.tasks import cancel_and_wait
from shared.txn import Writer

if TYPE_CHECKING:
    from shared.snapshots.dispatch import SnapshotDispatcher

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=Message)
S = TypeVar("S", bound=Message)


class Background:
    """Work an action started that its caller does not wait for (a snapshot once its record is written);
    its owner ends what is still running with :meth:`close`."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def follow(self, task: asyncio.Task[Any], what: str) -> None:
        def done(finished: asyncio.Task[Any]) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                log.warning("%s failed: %s", what, finished.exception())

        self._tasks.add(task)
        task.add_done_callback(done)

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)


@dataclass(frozen=True)
class ActionContext:
    conn: Connection
    writer: Writer
    actor: str
    clock: Clock = field(default_factory=RealClock)
    background: Background = field(default_factory=Background)
    snapshots: SnapshotDispatcher | None = None
    """The snapshot dispatcher of a long-lived caller (the console); None: one made for the action."""

    @property
    def view(self) -> StateView:
        return self.writer.view

    @property
    def events(self) -> EventPublisher:
        return EventPublisher(self.conn)

    def deployer(self) -> Deployer:
        """The deployer committing through this context's writer and clock, recording its actor as who
        created what it writes."""
        return Deployer(self.writer, clock=self.clock, created_by=self.actor)

    def acting_as(self, actor: str) -> ActionContext:
        """The same context for another actor (the console: one per logged-in user)."""
        return dataclasses.replace(self, actor=actor)

    async def announce(
        self, kind: str, message: str, *, env: pb.Environment | None = None, severity: str = INFO, **fields: str
    ) -> None:
        """Publish the event of what the action did (of ``env`` when given), its ``fields`` beside the actor;
        a failure to publish is logged, never raised."""
        said = {"actor": self.actor, **fields}
        if env is None:
            await self.events.publish(make_event(kind, message, severity=severity, fields=said))
        else:
            await self.events.publish(event_for_env(env, kind, message, severity=severity, fields=said))


def action_context(conn: Connection, view: StateView, *, actor: str, clock: Clock | None = None) -> ActionContext:
    """A context committing through an unfenced writer on ``view``."""
    return ActionContext(conn, Writer(conn, view), actor, clock or RealClock())


async def commit(
    ctx: ActionContext,
    decide: Decide[T],
    *,
    contended: str,
    kept_changing: str = "",
    landed: Callable[[T], bool] | None = None,
) -> T:
    """:func:`shared.retry.commit_with_retry` on the context's writer and clock; running out of attempts is
    a :class:`Conflicting` refusal (``kept_changing``, else "<contended> kept changing; try again")."""
    try:
        return await commit_with_retry(ctx.writer, decide, clock=ctx.clock, contended=contended, landed=landed)
    except RetriesExhausted as exc:
        raise Conflicting(kept_changing or str(exc)) from None


async def commit_edit(ctx: ActionContext, what: str, edit: Callable[[], M | None]) -> M | None:
    """Commit ``edit()`` — one record decided on the current view, None when there is nothing to write —
    deciding again when a concurrent write won. Returns what was written (None: nothing)."""

    def attempt() -> Attempt[M | None]:
        edited = edit()
        return Attempt(None if edited is None else ctx.writer.txn().put(edited), edited)

    return await commit(ctx, attempt, contended=what)


def stamp_replacing(record: Message, existing: Message | None) -> None:
    """``record.meta``'s times for a record written over ``existing``: created when ``existing`` was (now
    when there is none), updated now."""
    now = time.time_ns()
    meta = record.meta  # type: ignore[attr-defined]
    if existing is not None:
        meta.created_at.CopyFrom(existing.meta.created_at)  # type: ignore[attr-defined]
    else:
        meta.created_at.FromNanoseconds(now)
    meta.updated_at.FromNanoseconds(now)


async def remove_with_status(ctx: ActionContext, kind: str, status_kind: str, name: str, what: str) -> None:
    """Delete the record ``<kind>.<name>`` and its delivery status ``<status_kind>.<name>`` in one write (a
    notification channel, a log drain); :class:`NotFound` naming ``what`` when there is no such record."""
    from shared.actions.refusals import NotFound

    if ctx.view.get(kind, name) is None:
        raise NotFound(f"no {what} {name!r}", field="name")
    txn = ctx.writer.txn().delete(f"{kind}.{name}")
    if ctx.view.get(status_kind, name) is not None:
        txn.delete(f"{status_kind}.{name}")
    await ctx.writer.commit(txn)


def with_status(
    ctx: ActionContext, kind: str, record_type: type[M], status_kind: str, status_type: type[S]
) -> list[tuple[M, S | None]]:
    """Every ``<kind>`` record, by id, with its delivery status ``<status_kind>`` of the same id (None: none
    yet): the notification channels, the log drains."""
    found: list[tuple[M, S | None]] = []
    for record in sorted(ctx.view.all(kind), key=lambda r: r.meta.id):
        assert isinstance(record, record_type)
        status = ctx.view.get(status_kind, record.meta.id)  # type: ignore[attr-defined]
        found.append((record, status if isinstance(status, status_type) else None))
    return found
