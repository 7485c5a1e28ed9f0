"""What the secrets service's delivery loops (notification channels, log drains) share: :class:`DeliveryLoop`,
their settings and one task per target (:class:`Followers`) that reads again after a fault; the targets'
status records (``NotifyStatus``, ``LogDrainStatus``) read as the view holds them and written and waited for
in the view, and the failure bookkeeping in them (FAILING after some failed attempts in a row, recovered by a
delivery)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Generic, Literal, TypeVar

from zattera.v1 import types_pb2 as pb

from shared.backoff import Backoff
from shared.clock import stamp
from shared.events import ERROR
from shared.loop import LeaderLoop, LoopDeps
from shared.secrets import Keyring
from shared.tasks import cancel_and_wait, raise_if_cancelling
from shared.txn import Deposed

from .settings import SecretsSettings

log = logging.getLogger(__name__)

Status = TypeVar("Status", pb.NotifyStatus, pb.LogDrainStatus)
T = TypeVar("T")
S = TypeVar("S", bound="DeliverySettings")

SHOWN_WAIT = 10.0
"""Seconds the view may take to show one written status."""


@dataclass(frozen=True)
class DeliverySettings:
    """How a delivery loop delivers and retries."""

    timeout: float = 10.0
    """Seconds one delivery may take."""
    retry_first: float = 1.0
    """Seconds before a failed delivery is tried again (doubling with each failure)."""
    retry_most: float = 60.0
    """The longest pause between two attempts, seconds."""
    failing_after: int = 3
    """Failed attempts in a row after which the target is FAILING."""

    def backoff(self) -> Backoff:
        """The pauses between two attempts: ``retry_first`` doubling up to ``retry_most``."""
        return Backoff(self.retry_first, self.retry_most)

    @classmethod
    def of(cls: type[S], cfg: SecretsSettings, prefix: Literal["notify", "drain"]) -> S:
        """These settings as ``cfg`` holds them: each field from its ``<prefix>_<field>`` setting (the fields of
        a subclass keep their defaults)."""
        return cls(**{f.name: getattr(cfg, f"{prefix}_{f.name}") for f in fields(DeliverySettings)})


@dataclass
class _Follower(Generic[T]):
    task: asyncio.Task[None]
    version: bytes
    """The target as it was when the task started (another version restarts it)."""
    extra: T


class Followers(Generic[T]):
    """One task per delivery target, started again when the target changes or the task ended; ``T`` is what
    a loop keeps beside a task (what to clean up once it stopped)."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        """Names the tasks: ``<kind>-<target>``."""
        self._running: dict[str, _Follower[T]] = {}

    def __len__(self) -> int:
        return len(self._running)

    async def stop_changed(self, wanted: Mapping[str, tuple[bytes, T]]) -> list[tuple[str, T]]:
        """Stop the tasks whose target is not ``wanted`` (name: version and extra) at the version they started
        with, or which ended; the names and extras of those stopped."""
        stopped: list[tuple[str, T]] = []
        for name, running in list(self._running.items()):
            entry = wanted.get(name)
            if entry is None or entry[0] != running.version or running.task.done():
                await cancel_and_wait(running.task)
                del self._running[name]
                stopped.append((name, running.extra))
        return stopped

    def start_missing(
        self, wanted: Mapping[str, tuple[bytes, T]], follow: Callable[[str], Coroutine[Any, Any, None]]
    ) -> None:
        """Start ``follow(name)`` for each ``wanted`` target without a task."""
        for name, (version, extra) in wanted.items():
            if name not in self._running:
                task = asyncio.create_task(follow(name), name=f"{self._kind}-{name}")
                self._running[name] = _Follower(task, version, extra)

    async def stop_all(self) -> None:
        await cancel_and_wait(*(r.task for r in self._running.values()))
        self._running.clear()


class DeliveryLoop(LeaderLoop, Generic[S, T]):
    """A leader loop delivering to targets whose settings are sealed to the cluster key (``keyring`` opens
    them), with one task per target (:attr:`followers`, each kept with a ``T``)."""

    target_noun: ClassVar[str]
    """What the log calls a target: ``drain``, ``channel``."""
    failing_kind: ClassVar[str]
    """The event that announces a target FAILING."""

    def __init__(
        self, deps: LoopDeps, keyring: Callable[[], Keyring | None], *, settings: S, tick: float = 30.0
    ) -> None:
        super().__init__(deps, tick=tick)
        self.keyring = keyring
        self.settings = settings
        self.followers: Followers[T] = Followers(self.name)

    async def end_term(self) -> None:
        await self.followers.stop_all()

    async def record_failure(
        self,
        status: Status,
        error: str,
        save: Callable[[Status], Awaitable[None]],
        announce: Callable[[str, str, str], Awaitable[None]],
    ) -> None:
        """Count one failed delivery in ``status`` (the first of a row stamps ``failing_since``), log it and
        ``save`` the status; when this one makes the target FAILING (``failing_after`` in a row), ``announce``
        (kind, what, severity) says so with :attr:`failing_kind`."""
        if status.failures == 0:
            stamp(status.failing_since, self.clock.now())
        status.failures += 1
        status.last_error = error
        newly_failing = not status.failing and status.failures >= self.settings.failing_after
        status.failing = status.failing or newly_failing
        log.warning("%s: %s %s: %s (attempt %d)", self.name, self.target_noun, status.meta.id, error, status.failures)
        await save(status)
        if newly_failing:
            await announce(self.failing_kind, f"is failing: {error}", ERROR)

    async def keep_following(self, follow: Callable[[], Awaitable[None]], what: str) -> None:
        """Run ``follow`` for good: after a fault (a NATS one: a stream deleted, a consumer lost) it runs again
        after a pause (:meth:`DeliverySettings.backoff`); a deposed leader stops. ``what`` names it in the log."""
        backoff = self.settings.backoff()
        while True:
            try:
                await follow()
            except Deposed:
                raise
            except Exception as exc:
                raise_if_cancelling()  # a cancellation nats-py turned into an error ends the follower
                log.warning("%s failed (%s); again shortly", what, type(exc).__name__)
                await self.clock.sleep(next(backoff))


def status_of(loop: LeaderLoop, kind: str, record: type[Status], name: str) -> Status:
    """A copy of status ``name`` as the view holds it (an empty one when it has none), to change and save."""
    found = loop.view.get(kind, name)
    status = record()
    if isinstance(found, record):
        status.CopyFrom(found)
    status.meta.id = name
    return status


async def save_status(loop: LeaderLoop, kind: str, status: Status) -> None:
    """Write ``status`` (stamped now) through the loop's fenced writer and wait until the view shows it (the
    next write expects it)."""
    assert loop.writer is not None
    stamp(status.meta.updated_at, loop.clock.now())
    written = type(status)()
    written.CopyFrom(status)
    feed = loop.view.subscribe({kind})
    try:
        await loop.writer.commit(loop.writer.txn(loop.name).put(written))
        while loop.view.get(kind, written.meta.id) != written:
            await asyncio.wait_for(feed.wait(), SHOWN_WAIT)
    finally:
        feed.close()


def clear_failures(status: Status) -> bool:
    """A delivery was accepted: the failures in ``status`` cleared; True when it was FAILING (it recovered)."""
    recovered = status.failing
    status.failing, status.failures, status.last_error = False, 0, ""
    status.ClearField("failing_since")
    return recovered
