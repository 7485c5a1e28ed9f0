"""Read → decide → fenced commit with one retry policy (shared/retry.py), on a real NATS server."""

from __future__ import annotations

import asyncio
import random

import pytest

from shared.clock import FakeClock
from shared.connection import Connection, connect
from shared.lease import Lease
from shared.retry import RETRY, Attempt, RetriesExhausted, RetryPolicy, commit_with_retry, decide_again
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX
from shared.txn import CommitUnknown, Deposed, Txn, Writer
from tests.factories import node
from tests.waiting import eventually


def bumped(view: StateView, writer: Writer, decisions: list[int]) -> Attempt[int]:
    """Read node n1 and decide to add 1 to its cpu: a read-modify-write a lost update would show."""
    current = view.node("n1")
    assert current is not None
    updated = node("n1", cpu=current.capacity.cpu_millis + 1)
    decisions.append(updated.capacity.cpu_millis)
    return Attempt(writer.txn("bump").put(updated), updated.capacity.cpu_millis)


async def test_a_decision_that_lands_is_committed_once(view: StateView, writer: Writer) -> None:
    await writer.commit(writer.txn().create(node("n1", cpu=1)))
    decisions: list[int] = []
    result = await commit_with_retry(
        writer, lambda: bumped(view, writer, decisions), clock=FakeClock(), contended="node n1"
    )
    assert result == 2 and decisions == [2]
    assert view.node("n1").capacity.cpu_millis == 2


async def test_nothing_to_write_returns_without_a_commit(view: StateView, writer: Writer) -> None:
    before = view.last_revision
    result = await commit_with_retry(writer, lambda: Attempt(None, "same"), clock=FakeClock(), contended="x")
    assert result == "same" and view.last_revision == before


async def test_a_conflict_waits_for_the_winner_and_decides_again_on_it(
    nats_url: str, view: StateView, writer: Writer
) -> None:
    """Another process's write lands between our read and our commit: ours is refused, decided again on the
    winner's value, and both increments survive."""
    await writer.commit(writer.txn().create(node("n1", cpu=1)))
    rival_conn = await connect(nats_url, name="rival")
    rival_view = StateView(rival_conn, name="rival")
    await rival_view.start()
    rival = Writer(rival_conn, rival_view)
    decisions: list[int] = []

    async def decide() -> Attempt[int]:
        attempt = bumped(view, writer, decisions)
        if len(decisions) == 1:
            await rival.commit(rival.txn().put(node("n1", cpu=100)))
        return attempt

    try:
        result = await commit_with_retry(writer, decide, clock=FakeClock(), contended="node n1")
    finally:
        await rival_view.stop()
        await rival_conn.close()
    assert decisions == [2, 101] and result == 101
    assert view.node("n1").capacity.cpu_millis == 101


async def test_exhausted_attempts_raise_one_clear_error_after_backing_off_on_the_clock(
    view: StateView, writer: Writer
) -> None:
    await writer.commit(writer.txn().create(node("n1", cpu=1)))
    clock = FakeClock()
    started = clock.now()
    decisions = 0

    def always_stale() -> Attempt[None]:
        nonlocal decisions
        decisions += 1
        return Attempt(writer.txn("stale").put(node("n1", cpu=7), expect=view.rev("node.n1") + 1000), None)

    task = asyncio.create_task(commit_with_retry(writer, always_stale, clock=clock, contended="node n1"))
    while not task.done():
        await eventually(lambda: clock.sleepers > 0 or task.done(), what="a backoff or the end")
        await clock.advance(RETRY.max_delay)
    with pytest.raises(RetriesExhausted, match=r"^node n1 kept changing; try again$"):
        await task
    assert decisions == RETRY.attempts
    assert clock.now() > started  # the pauses ran on the injected clock
    assert view.node("n1").capacity.cpu_millis == 1


class LosesFirstReply(Writer):
    """A writer whose first commit lands on the server but whose reply is lost."""

    lost = False

    async def commit(self, txn: Txn) -> None:
        await super().commit(txn)
        if not self.lost:
            self.lost = True
            raise CommitUnknown("no reply (lost on purpose)")


@pytest.mark.parametrize(
    ("landed", "expected"),
    [("recognise", [2]), ("decide again", [2, 3]), ("report", [2])],
)
async def test_an_unknown_outcome_is_recognised_from_the_caught_up_view(
    conn: Connection, view: StateView, landed: str, expected: list[int]
) -> None:
    """``landed`` recognises the write that did land; :func:`decide_again` decides on the caught-up view;
    without ``landed`` the unknown outcome is the caller's to report."""
    writer = LosesFirstReply(conn, view)
    await Writer(conn, view).commit(writer.txn().create(node("n1", cpu=1)))
    decisions: list[int] = []

    def there(cpu: int) -> bool:
        return view.node("n1").capacity.cpu_millis == cpu

    check = {"recognise": there, "decide again": decide_again, "report": None}[landed]
    attempt = commit_with_retry(
        writer, lambda: bumped(view, writer, decisions), clock=FakeClock(), contended="node n1", landed=check
    )
    if check is None:
        with pytest.raises(CommitUnknown):
            await attempt
    else:
        assert await attempt == expected[-1]
    assert decisions == expected
    assert view.node("n1").capacity.cpu_millis == expected[-1]


async def test_a_deposed_writer_is_not_retried(conn: Connection, view: StateView) -> None:
    """A conflict because the lease is gone is not the state changing: it propagates after one decision."""
    ours = Lease(conn, "scheduler", "ours", ttl=30)
    assert await ours.try_acquire()
    fenced = Writer(conn, view, lease=ours)
    await fenced.commit(fenced.txn().create(node("n1", cpu=1)))
    await conn.js.publish(STATE_PREFIX + "lease.scheduler", b"", headers={"KV-Operation": "DEL"})
    assert await Lease(conn, "scheduler", "theirs", ttl=30).try_acquire()
    decisions: list[int] = []
    with pytest.raises(Deposed):
        await commit_with_retry(fenced, lambda: bumped(view, fenced, decisions), clock=FakeClock(), contended="n1")
    assert decisions == [2]


@pytest.mark.parametrize(
    ("retry", "ceiling"),
    [(1, 0.0), (2, 0.05), (3, 0.1), (4, 0.2), (6, 0.8), (7, 1.0), (30, 1.0)],
)
def test_backoff_is_immediate_once_then_full_jitter_up_to_the_cap(retry: int, ceiling: float) -> None:
    policy = RetryPolicy(attempts=10, base_delay=0.05, max_delay=1.0)
    rng = random.Random(7)
    pauses = [policy.backoff(retry, rng) for _ in range(200)]
    assert all(0.0 <= p <= ceiling for p in pauses)
    if ceiling:
        assert max(pauses) > ceiling / 2  # jittered across the range, not pinned at 0
