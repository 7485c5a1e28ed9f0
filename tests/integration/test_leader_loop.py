"""The one loop shape (shared/loop.py) on a real NATS with a fake clock: several change feeds, a scope per
wake-up (full, partial, ignored), the loop's own deadline beside the tick, and the term hooks; and no loop
of a service overrides ``run()``."""

from __future__ import annotations

import ast
import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.lease import run_while_leading
from shared.loop import FULL, LeaderLoop, LoopDeps, Scope
from shared.state.changes import Change, ChangeFeed
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import env, node
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
TICK = 100.0


class Probe(LeaderLoop):
    """Wakes on nodes (partial passes over the node ids; node "quiet" is ignored) and, through a feed of
    its own, on envs (full passes); records what it ran."""

    name = "probe"
    kinds = frozenset({K.NODE})

    def __init__(self, deps: LoopDeps, *, due: float | None = None) -> None:
        super().__init__(deps, tick=TICK)
        self.due = due
        self.full: list[float] = []
        self.partial: list[frozenset[str]] = []
        self.terms: list[str] = []

    def extra_feeds(self) -> Sequence[ChangeFeed]:
        return [self.view.subscribe({K.ENV})]

    def scope_of(self, changes: set[Change]) -> Scope:
        if any(kind == K.ENV for kind, _ in changes):
            return FULL
        return frozenset(ident for kind, ident in changes if kind == K.NODE and ident != "quiet")

    def seconds_until_due(self) -> float | None:
        return None if self.due is None else self.due - self.clock.now()

    async def begin_term(self) -> None:
        self.terms.append("begin")

    async def end_term(self) -> None:
        self.terms.append("end")

    async def run_pass(self) -> None:
        self.full.append(self.clock.now())

    async def run_partial_pass(self, scope: frozenset[str]) -> None:
        self.partial.append(scope)


@contextlib.asynccontextmanager
async def leading(conn: Connection, loop: LeaderLoop, clock: FakeClock) -> AsyncIterator[None]:
    task = asyncio.create_task(run_while_leading(conn, loop.name, loop.run, holder="t", ttl=3, renew_interval=0.1))
    try:
        await eventually(lambda: loop.passes >= 1 and clock.sleepers > 0, what="the term-start pass, then waiting")
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_changes_wake_partial_full_or_no_passes_and_the_tick_still_comes(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    clock = FakeClock()
    probe = Probe(LoopDeps(conn, view, clock, coalesce=0))
    async with leading(conn, probe, clock):
        assert probe.terms == ["begin"] and len(probe.full) == 1
        await writer.commit(writer.txn().put(node("n1")))
        await eventually(lambda: frozenset({"n1"}) in probe.partial, what="a partial pass over n1")
        assert len(probe.full) == 1

        await writer.commit(writer.txn().put(env("e1")))  # the loop's own feed: a full pass
        await eventually(lambda: len(probe.full) == 2, what="a full pass woken by the extra feed")

        passes = probe.passes
        await writer.commit(writer.txn().put(node("quiet")))  # out of scope: no pass
        await clock.advance(TICK - 1)
        assert probe.passes == passes
        await clock.advance(1)  # the tick counts from the last full pass
        await eventually(lambda: len(probe.full) == 3, what="the tick's full pass")
    assert probe.terms == ["begin", "end"]


async def test_the_loops_own_deadline_wakes_it_before_the_tick(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    clock = FakeClock()
    probe = Probe(LoopDeps(conn, view, clock, coalesce=0), due=clock.now() + 10)
    async with leading(conn, probe, clock):
        await clock.advance(9)
        assert len(probe.full) == 1
        probe.due = None  # acted on: the next wake-up is the tick again
        await clock.advance(1)
        await eventually(lambda: len(probe.full) == 2, what="the deadline's pass")
        assert probe.full[-1] == probe.full[0] + 10


def leader_loops_overriding_run() -> list[str]:
    """``file: class`` of every class under services/ that derives from a loop and defines ``run``."""
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}
            if not bases & {"LeaderLoop", "ScalingLoop"}:
                continue
            if any(isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef) and f.name == "run" for f in cls.body):
                found.append(f"{path.relative_to(ROOT)}: {cls.name}")
    return found


def test_no_service_loop_overrides_run() -> None:
    assert leader_loops_overriding_run() == []
