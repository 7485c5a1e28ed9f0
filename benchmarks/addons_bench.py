"""Managed PostgreSQL: ``python -m benchmarks.addons_bench [--full]``.

The add-on's entry script (shared/addons/postgres_entry.sh) on the real server and pgBackRest, run as the
agent runs it (an unprivileged user, volumes in a directory), and the node's real private-network forwarder
(services/agent/forwarder.py) in this process:

* **create → accepting connections**: from the script's start (initdb, roles, configuration, the server)
  until the app role logs in over TCP; and until its first base backup is in the repository;
* **WAL archive lag** under a steady write load (pgbench at a fixed rate, each row recording its commit
  time and WAL segment): for each row, how long until its segment is archived (``pg_stat_archiver`` polled
  every 0.2 s); p50/p99 against ``archive_timeout`` + 10 s;
* **PITR restore time**: a fork to the latest point of a database of N bytes (quick 128 MiB, full 1 GiB),
  from the script's start until the fork accepts connections;
* **pgbench TPS** (the built-in TPC-B-like script, 4 clients) through the private network (a consumer's
  private address → the server) versus directly to the same server, in alternating rounds: the user-space
  forwarder and the kernel path (iptables DNAT, ``services/agent/kernelnet.py``); target >= 80 % of direct.
  As root the whole bench runs in a network namespace of its own (``unshare --net``) so the kernel path's
  rules stay there; elsewhere the kernel path is not measured.
* **``addons psql`` over NATS**: one query's result (quick 500,000 rows ≈ 20 MB, full 2,000,000) read by
  ``psql`` through the tunnel (shared/addons/tunnel.py: an embedded nats-server, the node's tunnel agent in
  this process) versus through the server's own socket, and a session's open → first answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import bench_main, median
from benchmarks.network_bench import in_private_netns, kernel_available
from services.agent.forwarder import Forwarder
from services.agent.kernelnet import Dnat, KernelPath
from services.agent.network import consumer_address
from shared.embedded import free_port
from tests.addons.pgserver import PG_BIN, PgInstance, require_servers, wait_for

MIB = 1 << 20


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _pgbench(db: PgInstance, host: str, port: int, *args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        [f"{PG_BIN}/pgbench", "-h", host, "-p", str(port), "-U", "app", *args, "app"],
        env={"PGPASSWORD": db.app_password, "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pgbench: {done.stderr.strip()[-500:]}")
    return done.stdout


def _tps(output: str) -> float:
    for line in output.splitlines():
        if line.startswith("tps = "):
            return float(line.split()[2])
    raise RuntimeError(f"no tps in pgbench output: {output[-300:]}")


def archive_lag(db: PgInstance, seconds: int, rate: int) -> list[float]:
    db.sql("create table lag(t double precision, seg text)")
    script = db.root / "lag.sql"
    script.write_text(
        "insert into lag values (extract(epoch from clock_timestamp()),"
        " pg_walfile_name(pg_current_wal_insert_lsn()));\n"
    )
    samples: list[tuple[float, str]] = []
    stop = threading.Event()

    def poll() -> None:
        query = "select coalesce(last_archived_wal, '') from pg_stat_archiver"
        while not stop.is_set():
            samples.append((time.time(), db.sql(query, user="postgres")[0]))
            stop.wait(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _pgbench(db, "127.0.0.1", db.port, "-n", "-c", "1", "-R", str(rate), "-T", str(seconds), "-f", str(script))
    rows = [
        (float(t), seg) for t, seg in (line.split("|") for line in db.sql("select t, seg from lag", user="postgres"))
    ]
    last_segment = max(seg for _, seg in rows)
    wait_for(lambda: bool(samples) and samples[-1][1] >= last_segment, 180, "the last segment archived")
    stop.set()
    poller.join()
    lags = []
    for committed, seg in rows:
        archived = next((at for at, done in samples if done >= seg and at >= committed), None)
        if archived is not None:
            lags.append(archived - committed)
    return lags


async def through_private_network(db: PgInstance, seconds: int, rounds: int, *, kernel: bool) -> dict[str, list[float]]:
    """pgbench TPS in alternating rounds (the order rotated each round): directly to the server, through the
    user-space forwarder (a consumer's private address) and, when ``kernel``, through the kernel path (a second
    consumer's private address: the DNAT rule the agent writes for it, no listener behind it)."""
    container_port = free_port()
    forwarder = Forwarder(dns_port=0, hold_timeout=5)
    path = KernelPath(f"addons-bench-{os.getpid()}") if kernel else None
    tps: dict[str, list[float]] = {}
    try:
        internal = cpb.InternalService(
            fqdn="orders.db.shop.internal.", project_id="shop-id", environment_id="db-env", vip="127.128.0.9"
        )
        internal.ports.add(
            name="postgres",
            port=container_port,
            protocol="tcp",
            endpoints=[cpb.Endpoint(assignment_id="a1", addr=f"127.0.0.1:{db.port}", healthy=True)],
        )
        await forwarder.apply(cpb.RouteSnapshot(version=1, internal_services=[internal]))
        consumer = pb.Assignment(environment_id="web-env", project_id="shop-id", node_id="n1")
        env = await forwarder.instance_env(consumer, pb.Release(environment_id="web-env", project_id="shop-id"))
        port = int(env["ZATTERA_SERVICE_ORDERS_DB_PORT"])
        where = {"direct": ("127.0.0.1", db.port), "forwarder": (env["ZATTERA_SERVICE_ORDERS_DB_HOST"], port)}
        if path is not None:
            host = consumer_address(2, internal.vip)
            await asyncio.to_thread(path.install)
            await asyncio.to_thread(path.apply, [Dnat(host, port, (f"127.0.0.1:{db.port}",))])
            where["kernel"] = (host, port)
        modes = list(where)
        args = ("-n", "-c", "4", "-j", "2", "-T", str(seconds))
        for i in range(rounds):
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                output = await asyncio.to_thread(_pgbench, db, *where[mode], *args)
                tps.setdefault(mode, []).append(_tps(output))
        return {mode: tps[mode] for mode in modes}
    finally:
        if path is not None:
            await asyncio.to_thread(path.remove)
        await forwarder.close()


def servers_missing() -> list[str]:
    """PostgreSQL and pgBackRest programs not installed."""
    return [p for p in (f"{PG_BIN}/postgres", shutil.which("pgbackrest") or "pgbackrest") if not Path(p).exists()]


def private_network_pgbench(quick: bool, *, kernel: bool) -> dict[str, list[float]]:
    """:func:`through_private_network` on a fresh server (the private-network bench's pgbench figure)."""
    work = Path(tempfile.mkdtemp(prefix="zattera-pn-bench-", dir=os.environ.get("ZATTERA_BENCH_DIR")))
    work.chmod(0o755)
    db = PgInstance(work / "origin", "origin")
    try:
        db.start(until=db.accepts)
        _pgbench(db, "127.0.0.1", db.port, "-i", "-s", "1", "-q")
        seconds, rounds = (4, 5) if quick else (20, 7)
        return asyncio.run(through_private_network(db, seconds, rounds, kernel=kernel))
    finally:
        db.stop()
        shutil.rmtree(work, ignore_errors=True)


def _psql_direct(db: PgInstance, args: list[str]) -> None:
    subprocess.run(
        [f"{PG_BIN}/psql", "-h", str(db.data / "run"), "-p", str(db.port), "-U", "postgres", *args],
        stdout=subprocess.DEVNULL,
        check=True,
        timeout=600,
    )


async def psql_over_nats(db: PgInstance, rows: int) -> tuple[float, float, float, int]:
    """(seconds direct, seconds through the tunnel, seconds of a trivial query through it, result bytes)."""
    from benchmarks.common import embedded_server
    from shared.addons.tunnel import TunnelAgent, run_psql
    from shared.connection import connect

    query = f"select g, md5(g::text) from generate_series(1, {rows}) g"
    args = ["-X", "-At", "-d", "app", "-c", query]
    size = int(db.sql(f"select sum(length(g::text) + 34) from generate_series(1, {rows}) g")[0])
    with embedded_server("zattera-addons-psql-") as server:
        conn = await connect(server.url, name="bench")
        agent = TunnelAgent(conn, "n-db", db.root)  # the data volume is <root>/data: volume id "data"
        await agent.start()
        try:
            start = time.perf_counter()
            await asyncio.to_thread(_psql_direct, db, args)
            direct = time.perf_counter() - start
            psql = f"{PG_BIN}/psql"
            start = time.perf_counter()
            code = await run_psql(conn, "n-db", "data", args, psql=psql, stdout=subprocess.DEVNULL)
            tunnel = time.perf_counter() - start
            start = time.perf_counter()
            code |= await run_psql(conn, "n-db", "data", ["-X", "-c", "select 1"], psql=psql, stdout=subprocess.DEVNULL)
            trivial = time.perf_counter() - start
            if code:
                raise RuntimeError("psql through the tunnel failed")
        finally:
            await agent.stop()
            await conn.close()
    return direct, tunnel, trivial, size


def measure(work: Path, quick: bool) -> list[dict[str, object]]:
    size = 128 * MIB if quick else 1024 * MIB
    archive_timeout = 5 if quick else 60
    lag_seconds = 40 if quick else 240
    bench_seconds = 10 if quick else 30
    rows: list[dict[str, object]] = []
    instances: list[PgInstance] = []
    try:
        db = PgInstance(work / "origin", "origin", archive_timeout=archive_timeout)
        instances.append(db)
        start = time.perf_counter()
        db.start(until=db.accepts)
        accepting = time.perf_counter() - start
        wait_for(lambda: (db.data / "ready").exists(), 120, "the first base backup")
        first_backup = time.perf_counter() - start
        rows.append(
            {
                "figure": "create -> accepting connections",
                "value": round(accepting, 2),
                "unit": "s",
                "target": "-",
                "anchor": "initdb, roles, server start (process runtime)",
            }
        )
        rows.append(
            {
                "figure": "create -> first base backup done",
                "value": round(first_backup, 2),
                "unit": "s",
                "target": "-",
                "anchor": "stanza-create + full backup of an empty cluster",
            }
        )

        lags = archive_lag(db, lag_seconds, rate=20)
        p50, p99 = _pct(lags, 0.5), _pct(lags, 0.99)
        rows.append(
            {
                "figure": "WAL archive lag p50",
                "value": round(p50, 2),
                "unit": "s",
                "target": "-",
                "anchor": f"{len(lags)} rows at 20/s for {lag_seconds} s, archive_timeout {archive_timeout} s",
            }
        )
        rows.append(
            {
                "figure": "WAL archive lag p99",
                "value": round(p99, 2),
                "unit": "s",
                "target": f"<= {archive_timeout + 10}",
                "anchor": f"max {max(lags):.2f} s",
            }
        )

        _pgbench(db, "127.0.0.1", db.port, "-i", "-s", "1", "-q")
        tps = asyncio.run(through_private_network(db, bench_seconds, 3, kernel=kernel_available()))
        direct = median(tps["direct"])
        rows.append(
            {
                "figure": "pgbench TPS direct",
                "value": round(direct),
                "unit": "tps",
                "target": "-",
                "anchor": f"TPC-B-like, scale 1, 4 clients, {bench_seconds} s rounds: "
                + ", ".join(f"{v:.0f}" for v in tps["direct"]),
            }
        )
        for mode, label in (("forwarder", "the user-space forwarder"), ("kernel", "the kernel path (DNAT)")):
            if mode in tps:
                value = median(tps[mode])
                rows.append(
                    {
                        "figure": f"pgbench TPS through {label}",
                        "value": round(value),
                        "unit": "tps",
                        "target": ">= 80 % of direct",
                        "anchor": f"{100 * value / direct:.0f} % of direct; rounds "
                        + ", ".join(f"{v:.0f}" for v in tps[mode]),
                    }
                )

        result_rows = 500_000 if quick else 2_000_000
        direct_s, tunnel_s, trivial_s, result_bytes = asyncio.run(psql_over_nats(db, result_rows))
        rows.append(
            {
                "figure": "addons psql: a query's result, direct (server socket)",
                "value": round(direct_s, 2),
                "unit": "s",
                "target": "-",
                "anchor": f"{result_rows:,} rows, {result_bytes / MIB:.0f} MiB,"
                f" {result_bytes / MIB / direct_s:.0f} MiB/s",
            }
        )
        rows.append(
            {
                "figure": "addons psql: the same over NATS (tunnel)",
                "value": round(tunnel_s, 2),
                "unit": "s",
                "target": "-",
                "anchor": f"{result_bytes / MIB / tunnel_s:.0f} MiB/s;"
                f" psql start, session open, select 1: {trivial_s * 1000:.0f} ms",
            }
        )

        rows_needed = size // 1100
        db.sql(f"create table big as select g as id, repeat('x', 1000) as pad from generate_series(1, {rows_needed}) g")
        db.archived_through_current()
        bytes_ = int(db.sql("select pg_database_size('app')")[0])
        fork = PgInstance(
            work / "fork",
            "fork",
            extra={
                "ZATTERA_PG_RESTORE_REPO": str(db.backups / "repo"),
                "ZATTERA_PG_RESTORE_STANZA": "origin",
                "ZATTERA_PG_RESTORE_TARGET": "latest",
            },
        )
        instances.append(fork)
        start = time.perf_counter()
        fork.start(timeout=3600, until=fork.accepts)
        restore = time.perf_counter() - start
        assert fork.sql("select count(*) from big") == [str(rows_needed)]
        rows.append(
            {
                "figure": "PITR fork -> accepting connections",
                "value": round(restore, 1),
                "unit": "s",
                "target": "-",
                "anchor": f"{bytes_ / MIB:.0f} MiB database, all of it WAL after the base backup",
            }
        )
    finally:
        for instance in instances:
            instance.stop()
    return rows


def run(quick: bool = True) -> list[dict[str, object]]:
    require_servers()
    isolated = in_private_netns("benchmarks.addons_bench", quick)  # the kernel path's rules stay in it
    if isolated is not None:
        return isolated
    work = Path(tempfile.mkdtemp(prefix="zattera-addons-bench-", dir=os.environ.get("ZATTERA_BENCH_DIR")))
    work.chmod(0o755)
    try:
        return measure(work, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    bench_main("Managed PostgreSQL", run, __doc__, "1 GiB restore, archive_timeout 60 s, 4 min of writes")


if __name__ == "__main__":
    main()
