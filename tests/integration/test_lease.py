"""Leases and leader failover with real processes on a real NATS server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.lease import Lease, run_while_leading
from shared.state.feed import StateView
from tests.waiting import BlocksUntilCancelled, eventually

TTL = 1.0
RENEW = 0.3


def spawn(nats_url: str, out: Path, ttl: float = TTL) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.contender",
            "--nats",
            nats_url,
            "--out",
            str(out),
            "--ttl",
            str(ttl),
            "--renew",
            str(RENEW),
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def events(out: Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def leads(out: Path) -> list[dict]:
    return [e for e in events(out) if e["ev"] == "lead"]


async def test_failover_after_sigkill_is_bounded_by_ttl_plus_renew(nats_url, tmp_path):
    out = tmp_path / "events.jsonl"
    procs = [spawn(nats_url, out), spawn(nats_url, out)]
    try:
        await eventually(lambda: len(leads(out)) == 1, timeout=20, what="a first leader")
        first = leads(out)[0]
        leader = next(p for p in procs if p.pid == first["pid"])
        await eventually(lambda: any(e["ev"] == "write" and e["ok"] for e in events(out)), timeout=10)
        killed_at = time.time()
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        await eventually(lambda: len(leads(out)) == 2, timeout=20, what="a second leader")
        second = leads(out)[1]
        assert second["pid"] != first["pid"]
        assert second["term"] > first["term"]
        # TTL + renew interval, plus scheduling slack on a loaded 2-core machine
        assert second["t"] - killed_at <= TTL + RENEW + 1.5
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_a_sigkilled_holder_is_replaced_through_its_probe_long_before_its_ttl(nats_url, tmp_path):
    """With a 30-s TTL only the probe can explain a takeover within seconds: the killed holder's connection
    is closed, so NATS answers "no responders" on its probe subject."""
    out = tmp_path / "events.jsonl"
    procs = [spawn(nats_url, out, ttl=30), spawn(nats_url, out, ttl=30)]
    try:
        await eventually(lambda: len(leads(out)) == 1, timeout=20, what="a first leader")
        first = leads(out)[0]
        await eventually(lambda: any(e["ev"] == "write" and e["ok"] for e in events(out)), timeout=10)
        leader = next(p for p in procs if p.pid == first["pid"])
        killed_at = time.time()
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        await eventually(lambda: len(leads(out)) == 2, timeout=15, what="a second leader before the 30-s TTL")
        second = leads(out)[1]
        assert second["pid"] != first["pid"] and second["term"] > first["term"]
        assert second["t"] - killed_at < 10, "taken over by the probe, not by the TTL"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_a_frozen_holder_is_not_taken_for_a_gone_one(nats_url, tmp_path, conn):
    """A holder that cannot answer (stopped, as a starved event loop would be) is still connected: its probe
    times out instead of "no responders", so a standby leaves the lease to its TTL."""
    out = tmp_path / "events.jsonl"
    proc = spawn(nats_url, out, ttl=30)
    try:
        await eventually(lambda: len(leads(out)) == 1, timeout=20, what="a leader")
        await eventually(lambda: any(e["ev"] == "write" and e["ok"] for e in events(out)), timeout=10)
        os.kill(proc.pid, signal.SIGSTOP)
        standby = Lease(conn, "contended", "standby", ttl=30)
        for _ in range(3):
            assert not await standby.try_acquire(), "a frozen holder was deposed by a probe"
        assert standby.standby_pause(standby.last_seen) == standby.probe_interval
        os.kill(proc.pid, signal.SIGCONT)
        writes = len([e for e in events(out) if e["ev"] == "write" and e["ok"]])
        await eventually(
            lambda: len([e for e in events(out) if e["ev"] == "write" and e["ok"]]) > writes + 2, 10, "writes resume"
        )
        assert len(leads(out)) == 1 and not [e for e in events(out) if e["ev"] == "lost"]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


async def test_a_holder_that_answers_no_probe_is_left_to_its_ttl(conn):
    """A lease written without a probe subject (a holder of an older version) is never taken over early."""
    old = Lease(conn, "u", "old", ttl=30)
    assert await old.try_acquire()
    standby = Lease(conn, "u", "new", ttl=30)
    assert not await standby.try_acquire()
    assert standby.standby_pause(standby.last_seen) == standby.renew_interval
    await old.release()


async def test_two_processes_never_lead_in_the_same_term_and_no_deposed_write_lands(nats_url, tmp_path, conn):
    out = tmp_path / "events.jsonl"
    procs = [spawn(nats_url, out) for _ in range(2)]
    try:
        for round_ in range(2):
            await eventually(lambda r=round_: len(leads(out)) > r, timeout=20, what="a leader")
            frozen = leads(out)[-1]["pid"]
            await eventually(lambda: any(e["ev"] == "write" and e["ok"] for e in events(out)), timeout=10)
            # Freeze the leader past its TTL; the standby takes over; then the frozen one resumes.
            os.kill(frozen, signal.SIGSTOP)
            await eventually(lambda pid=frozen: leads(out)[-1]["pid"] != pid, timeout=20, what="takeover")
            os.kill(frozen, signal.SIGCONT)
            await eventually(
                lambda pid=frozen: any(e["pid"] == pid and e["ev"] == "lost" for e in events(out)),
                timeout=20,
                what="the resumed leader steps down",
            )
        terms = [e["term"] for e in leads(out)]
        assert len(set(terms)) == len(terms), f"a term was led twice: {terms}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    # Server-side truth: a term is the revision of its acquiring write, so every write that landed in
    # term T has a revision between T and the next term's acquisition.
    view = StateView(conn, name="audit")
    await view.start()
    ordered_terms = sorted(set(terms))
    landed = [(view.rev(f"node.{n.meta.id}"), int(n.name.split(":")[1])) for n in view.nodes()]
    assert landed, "no write landed at all"
    for rev, term in landed:
        later = [t for t in ordered_terms if t > term]
        assert term < rev, (rev, term)
        assert not later or rev < later[0], f"write of term {term} landed at {rev}, after term {later[0]} began"
    await view.stop()


async def test_run_while_leading_cancels_the_leader_function_on_loss(conn):
    lead = BlocksUntilCancelled()
    runner = asyncio.create_task(run_while_leading(conn, "x", lead, holder="a", ttl=TTL, renew_interval=RENEW))
    await asyncio.wait_for(lead.started.wait(), 10)
    # Someone else takes the key (as after expiry): the next renewal is refused.
    await conn.js.publish("$KV.zattera-state.lease.x", b"", headers={"KV-Operation": "DEL"})
    thief = Lease(conn, "x", "b", ttl=30)
    assert await thief.try_acquire()
    await asyncio.wait_for(lead.cancelled.wait(), 10)
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)


async def test_clean_release_lets_a_standby_take_over_without_waiting_for_the_ttl(conn):
    first = Lease(conn, "y", "a", ttl=30)
    assert await first.try_acquire()
    await first.release()
    second = Lease(conn, "y", "b", ttl=30)
    assert await second.try_acquire()
    assert second.term > first.term


async def test_a_lapsed_lease_still_ours_is_re_acquired_at_once_and_never_by_another(conn):
    mine = Lease(conn, "z", "a", ttl=30)
    assert await mine.try_acquire()
    first_term = mine.term
    mine.lost("could not renew within the TTL")  # as through a stream election longer than the TTL
    other = Lease(conn, "z", "b", ttl=30)
    assert not await other.try_acquire(), "the key still holds a's lease: nobody else may take it"
    assert await mine.try_acquire()
    assert mine.held and mine.term > first_term
    assert await mine.renew()


async def test_a_refused_renewal_whose_write_had_landed_is_recognised_not_taken_for_a_loss(conn):
    lease = Lease(conn, "w", "a", ttl=30)
    assert await lease.try_acquire()
    # A renewal that landed but whose acknowledgement was lost: the key moved on with our own value.
    subject, value, headers = lease.fence_message()
    landed = (await conn.js.publish(subject, value, headers=headers)).seq
    assert await lease.renew()
    assert lease.held and lease.rev == landed  # adopted, not written twice
    assert await lease.renew() and lease.rev > landed
    # Someone else's write is not ours: the renewal is refused and the lease lost.
    await conn.js.publish(subject, b"", headers={"KV-Operation": "DEL"})
    assert not await lease.renew()
    assert not lease.held


async def test_an_acquisition_cancelled_between_its_two_writes_is_still_released(conn):
    """A shutdown that cancels try_acquire after its acquiring write landed must not leave the key held
    until the TTL (the service-process test saw such a lease left behind under load)."""
    lease = Lease(conn, "v", "a", ttl=30)
    publish = lease._publish
    confirming = asyncio.Event()

    async def never_answered_confirmation(data: bytes, expect: int) -> int:
        if expect:  # the confirming write expects the acquiring write's revision
            confirming.set()
            await asyncio.Event().wait()
        return await publish(data, expect)

    lease._publish = never_answered_confirmation  # type: ignore[method-assign]
    acquiring = asyncio.create_task(lease.try_acquire())
    await asyncio.wait_for(confirming.wait(), 5)
    acquiring.cancel()
    await asyncio.gather(acquiring, return_exceptions=True)
    assert not lease.held
    await lease.release()
    other = Lease(conn, "v", "b", ttl=30)
    assert await other.try_acquire(), "the half-taken lease was released, not left to expire"
