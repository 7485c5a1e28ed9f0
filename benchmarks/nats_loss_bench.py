"""Control-plane unavailability after a NATS server is lost (issue 26 item 5): a 3-server cluster (every
stream R3), one replica of every service at the product's default timers (lease TTL 3 s, renew 1 s). Each
round SIGKILLs the server in one role — the JetStream meta leader, the state / live / routes / build-events
stream's leader, the server the observer is connected to — in turn, then measures:

* kill → the first successful fenced write of each leader loop (its next ``lease.<loop>`` write: every
  renewal is a fenced write), by the server timestamp of the write. The lease keys are read every 50 ms with
  one ``DIRECT.GET`` (``multi_last``), which any replica answers during an election too. (Not from a
  consumer over the stream: its consumer dies with its server and is re-created seconds later, and the
  stream keeps only the last write of a key, so the first writes after the kill were superseded by then
  and a consumer-based figure read ~17 s for what took 4–10 s.)
* kill → the first successful CLI read (``zattera deploy list --json`` in-process, started right after the
  kill, with its bounded retry across servers; a failed attempt is retried and counted in the figure).

The server is restarted and caught up (its replicas current) before the next round.
Quick (default, ~15–30 s): 1 kill (the meta leader). ``--full``: 10 kills.

    .venv/bin/python -m benchmarks.nats_loss_bench [--full]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
from typer.testing import CliRunner

from benchmarks.common import Row, bench_main, percentile, row
from cli.main import app
from shared import keys as K
from shared.connection import Connection, connect
from shared.directget import last_per_subject
from shared.subjects import STATE_PREFIX, STATE_STREAM
from tests.chaos.cluster import LOOPS, NATS_ROLES, SERVICES, FenceAudit, Fleet, NatsCluster

DEFAULT_TIMERS = {"ZATTERA_LEASE_TTL": "3", "ZATTERA_LEASE_RENEW": "1", "ZATTERA_LOOP_TICK": "15"}
ALL_LOOPS = tuple(loop for loops in LOOPS.values() for loop in loops)
GIVE_UP = 60.0


POLL = 0.05
LEASES = f"{STATE_PREFIX}{K.LEASE}."


def _server_time(stamp: str) -> float:
    """``Nats-Time-Stamp`` (RFC 3339 with nanoseconds) as epoch seconds."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{fraction or 0}")


async def _first_writes_after(conn: Connection, killed: float) -> dict[str, float]:
    """Seconds from ``killed`` to the first lease write that landed, per loop (a loop missing: none within
    ``GIVE_UP``)."""
    first: dict[str, float] = {}
    deadline = time.monotonic() + GIVE_UP
    while len(first) < len(ALL_LOOPS) and time.monotonic() < deadline:
        try:
            msgs = await last_per_subject(conn.nc, STATE_STREAM, f"{LEASES}>", 0.5)
        except (TimeoutError, nats.errors.Error, ConnectionError):
            msgs = []
        for msg in msgs:
            headers = msg.headers or {}
            loop = headers.get("Nats-Subject", "")[len(LEASES) :]
            deleted = "KV-Operation" in headers or "Nats-Marker-Reason" in headers
            if loop not in ALL_LOOPS or loop in first or not msg.data or deleted:
                continue
            at = _server_time(headers.get("Nats-Time-Stamp", ""))
            if at >= killed:
                first[loop] = at - killed
        await asyncio.sleep(POLL)
    return first


def _cli_read(urls: str) -> bool:
    return CliRunner().invoke(app, ["--nats", urls, "deploy", "list", "--json"]).exit_code == 0


async def _first_cli_read(urls: str, killed: float) -> float:
    while time.time() - killed < GIVE_UP:
        if await asyncio.to_thread(_cli_read, urls):
            return time.time() - killed
    return float("nan")


async def _all_loops_led(audit: FenceAudit) -> None:
    deadline = time.monotonic() + 120
    while any(audit.leader_pid(loop, fresh=2.5) is None for loop in ALL_LOOPS):
        if time.monotonic() > deadline:
            raise TimeoutError("every loop led")
        await asyncio.sleep(0.2)


async def _run(quick: bool) -> list[Row]:
    kills = 1 if quick else 10
    loop_samples: list[float] = []
    slowest_loop: list[float] = []
    read_samples: list[float] = []
    missed = 0
    base = Path.home() / ".cache" / "zattera-bench"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nats-loss-", dir=base) as tmp:
        nats = NatsCluster(Path(tmp) / "nats").start()
        fleet = Fleet(nats.urls, Path(tmp) / "logs", env=dict(DEFAULT_TIMERS))
        try:
            await nats.provision()
            conn = await connect(nats.urls, name="nats-loss-observer")
            audit = await FenceAudit(conn).start()
            fleet.start_all(SERVICES, replicas=1)
            for i in range(kills):
                await nats.provision()  # the previous victim has caught up
                await _all_loops_led(audit)
                role = NATS_ROLES[i % len(NATS_ROLES)]
                victim = await nats.server_in_role(conn, role)
                killed = time.time()
                nats.kill(victim)
                writes = asyncio.create_task(_first_writes_after(conn, killed))
                read_samples.append(await _first_cli_read(nats.urls, killed))
                took = list((await writes).values())
                missed += len(ALL_LOOPS) - len(took)
                loop_samples += took
                slowest_loop.append(max(took, default=float("nan")))
                nats.restart(victim)
            await audit.stop()
            await conn.close()
        finally:
            fleet.stop_all()
            nats.stop()
    n = len(slowest_loop)
    return [
        row(
            f"NATS loss → each loop's first fenced write p50 ({len(loop_samples)} writes)",
            percentile(loop_samples, 50),
            "s",
        ),
        row(
            f"NATS loss → each loop's first fenced write p99 ({len(loop_samples)} writes)",
            percentile(loop_samples, 99),
            "s",
            "≤ 10 s",
            "issue 26",
        ),
        row(
            f"NATS loss → slowest loop's first fenced write p99 ({n} kills)",
            percentile(slowest_loop, 99),
            "s",
            "≤ 10 s",
        ),
        row(f"NATS loss → first CLI read p50 ({n} kills)", percentile(read_samples, 50), "s"),
        row(f"NATS loss → first CLI read p99 ({n} kills)", percentile(read_samples, 99), "s", "≤ 5 s", "issue 26"),
        row("loops with no fenced write within 60 s of a kill", missed, "loops", "0"),
    ]


def run(quick: bool = True) -> list[Row]:
    return asyncio.run(_run(quick))


def main() -> None:
    bench_main("NATS server loss", run, __doc__, "10 kills (roles in turn)")


if __name__ == "__main__":
    main()
