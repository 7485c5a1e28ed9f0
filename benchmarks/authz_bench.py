"""The cost of teams' authorisation (issue 39 item 6): a deploy and ``zattera logs -f``, open mode versus a
team member on a secured cluster, in one run.

Three modes, each on its own embedded nats-server with the join service's handlers in the benchmark's process
(watches, and when secured the relay with the audit log and the authorising path):

* **open**: no authentication (``zattera up``);
* **operator**: ``--secure``, the operator (admin) credential: writes relayed and audited, reads direct;
* **member**: ``--secure``, a deployer of the project: every write checked against its grant by the relay,
  every state read and event answered by the authorising path.

Figures per mode:

* **deploy**: what ``zattera deploy --image … --no-watch`` does at the CLI once connected — load the state
  snapshot (one batch direct get), then the deploy action (release, deployment and env writes, the event) —
  timed from the snapshot request to the action's return; 20 deploys (full: 100) after two warm-ups, p50.
* **logs -f**: a follower (``shared.applogs.read_app_logs(follow=True)``, the code of ``zattera logs -f``)
  of an environment's log stream, one per mode on its own client connection, in 6 rounds; 300 lines per mode
  (full: 1,500), 50 (250) a round. A round opens the three followers (their order rotating between rounds:
  the time to start following — stream info, watch or feed opened, backlog read — median of the rounds), then
  for each line publishes one batch from control to each mode in turn, waiting until that mode's follower
  has printed it, 5 ms apart; the modes' order rotates through the six permutations line by line, so each
  mode is first, second and third equally often and the three latencies of a line are taken within a few
  milliseconds of each other under the same load. Figures: the latency from publish to the line at the
  follower, p50 and p99 over all rounds; each mode against open mode (ratio of the p50s; each round's p50
  against open mode's in the same round: min, median, max; and the median of the per-line differences with
  open mode's same line, in µs).

Until 2026-12-03 07:40 UTC the followers of a round ran one mode after the other (200 lines, 33 a round, the
modes' order alternating per round); interleaving line by line takes the machine's load, which moves within
a second here, out of the comparison.

    .venv/bin/python -m benchmarks.authz_bench [--full]
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, percentile, row
from shared import keys as K
from shared.actions.context import ActionContext
from shared.actions.deploys import Deploy
from shared.actions.deploys import deploy as deploy_action
from shared.applogs import LogLimits, app_log_subject, app_logs_stream_config, read_app_logs
from shared.connection import Connection, connect
from shared.embedded import EmbeddedNats
from shared.provisioning import create_or_update_stream, provision
from shared.security.authority import RoleIssuer
from shared.security.authz import Authz
from shared.security.creds import read_user_jwt
from shared.security.join import JoinService
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import Role
from shared.security.setup import prepare
from shared.state.feed import StateView
from shared.subjects import STATE_PREFIX
from shared.teams import DEPLOYER, User
from shared.teams_store import save_user
from shared.txn import Writer
from shared.watch_server import serve_watches
from tests.e2e.cluster import cli_argv

PROJECT, APP, ENV = "p-bench", "a-bench", "e-bench"
MODES = ("open", "operator", "member")
LINE_GAP = 0.005
LOG_ROUNDS = 6
"""The log followers run in rounds, the modes' order alternating, so the machine's load weighs on each alike."""


@dataclass
class Mode:
    name: str
    url: str
    control: Connection
    client_creds: str  # "" = open


@contextlib.asynccontextmanager
async def mode(name: str, base: Path, envs: int) -> AsyncIterator[Mode]:
    setup = prepare(base / "security") if name != "open" else None
    server = EmbeddedNats(
        data_dir=base / "nats", extra_config=setup.server_config() if setup is not None else ""
    ).start()
    tasks: list[asyncio.Task[None]] = []
    try:
        control = await connect(server.url, name="bench-control", creds=str(setup.control_creds) if setup else None)
        await provision(control.js)
        authz = None
        creds = ""
        if setup is not None:
            publics = json.loads((setup.directory / "accounts.json").read_text())
            authz = Authz(
                control,
                publics["members"],
                issuer=RoleIssuer.load(setup.directory, Role.MEMBER),
                admins_account=publics["operators"],
            )
            issuers = {role: RoleIssuer.load(setup.directory, role) for role in (Role.AGENT, Role.BUILDER)}
            service = JoinService(control, issuers, setup.sentinel_jwt(), authz=authz)
            tasks.append(asyncio.create_task(service.run()))
            await asyncio.wait_for(service.ready.wait(), 10)
            if name == "member":
                creds = str(setup.creds(Role.MEMBER, "dev"))
                key = str(decode_claims(read_user_jwt(creds))["sub"])
                await save_user(control.js, User("dev", key, False, {PROJECT: DEPLOYER}))
            else:
                creds = str(setup.operator_creds)
        ready = asyncio.Event()
        authorize = authz.authorize_watch if authz is not None else None
        tasks.append(asyncio.create_task(serve_watches(control, ready, authorize=authorize)))
        await asyncio.wait_for(ready.wait(), 10)
        seeded: list[pb.Project | pb.App | pb.Environment] = [
            pb.Project(meta=pb.Meta(id=PROJECT), name="bench"),
            pb.App(meta=pb.Meta(id=APP), project_id=PROJECT, name="web"),
            pb.Environment(meta=pb.Meta(id=ENV), app_id=APP, project_id=PROJECT, name="prod"),
        ]
        # One environment per deploy: without an orchestrator a deployment stays in progress.
        seeded += [
            pb.Environment(meta=pb.Meta(id=f"{ENV}-{i}"), app_id=APP, project_id=PROJECT, name=f"env{i}")
            for i in range(envs)
        ]
        for msg in seeded:
            await control.js.publish(f"{STATE_PREFIX}{K.key_of(msg)}", K.encode(msg))
        await create_or_update_stream(control.js, app_logs_stream_config(ENV, LogLimits(64 << 20, 3600.0), 1))
        try:
            yield Mode(name, server.url, control, creds)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await control.close()
    finally:
        server.stop()


async def _client(m: Mode) -> Connection:
    return await connect(m.url, name=f"bench-cli-{m.name}", creds=m.client_creds or None)


async def deploy_once(conn: Connection, i: int) -> tuple[float, float]:
    """One deploy as the CLI makes it: (snapshot load, deploy action) in seconds."""
    started = time.perf_counter()
    view = StateView(conn, name="bench-cli")
    await view.load_snapshot(10.0)
    loaded = time.perf_counter()
    ctx = ActionContext(conn, Writer(conn, view), "bench")
    await deploy_action(ctx, Deploy(f"{ENV}-{i}", image_ref=f"docker.io/library/busybox:{i}"))
    done = time.perf_counter()
    await view.stop()
    return loaded - started, done - loaded


def _batch(i: int) -> bytes:
    batch = cpb.InstanceLogBatch(environment_id=ENV, instance_id="i1", node_id="n1")
    line = batch.lines.add(line=f"{i} {time.perf_counter()!r}", stream="stdout")
    line.time.FromNanoseconds(time.time_ns())
    return batch.SerializeToString()


class Follower:
    """One mode's ``logs -f``: ``read_app_logs(follow=True)`` on a client connection of its own, kept open for a
    round; :meth:`line` publishes one batch from control and waits until the follower has it."""

    def __init__(self, m: Mode) -> None:
        self.mode = m
        self._conn: Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._opened = asyncio.Event()
        self._arrived = asyncio.Event()
        self._latency = 0.0

    async def start(self) -> float:
        """Open the follower on a stream holding one line; the time until that line is printed."""
        self._conn = await _client(self.mode)
        await self.mode.control.js.publish(app_log_subject(ENV, "i1"), _batch(-1))
        start = time.perf_counter()
        self._task = asyncio.create_task(self._read(self._conn))
        await asyncio.wait_for(self._opened.wait(), 10)
        return time.perf_counter() - start

    async def _read(self, conn: Connection) -> None:
        async for line in read_app_logs(conn, ENV, last=1, follow=True):
            index, sent = line.line.split(" ", 1)
            if int(index) < 0:
                self._opened.set()
                continue
            self._latency = time.perf_counter() - float(sent)
            self._arrived.set()

    async def line(self, i: int) -> float:
        """Publish → printed by the follower, in seconds."""
        self._arrived.clear()
        await self.mode.control.js.publish(app_log_subject(ENV, "i1"), _batch(i))
        await asyncio.wait_for(self._arrived.wait(), 10)
        return self._latency

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._conn is not None:
            await self._conn.close()


ORDERS = list(itertools.permutations(range(len(MODES))))
"""The modes' order per line, cycled: each mode is first, second and third equally often."""


async def follow_round(modes: list[Mode], r: int, lines: int) -> dict[str, tuple[list[float], float]]:
    """One round: a follower per mode opened (in a rotating order), then ``lines`` lines per mode, one mode
    after the other for each line (order rotating per line), LINE_GAP between lines; mode → (latencies,
    start)."""
    followers: dict[str, Follower] = {}
    starts: dict[str, float] = {}
    try:
        for index in ORDERS[r % len(ORDERS)]:
            m = modes[index]
            followers[m.name] = Follower(m)
            starts[m.name] = await followers[m.name].start()
        latencies: dict[str, list[float]] = {m.name: [] for m in modes}
        for i in range(lines):
            for index in ORDERS[(r + i) % len(ORDERS)]:
                m = modes[index]
                latencies[m.name].append(await followers[m.name].line(i))
                await asyncio.sleep(LINE_GAP)
    finally:
        for follower in followers.values():
            await follower.stop()
    return {name: (latencies[name], starts[name]) for name in latencies}


async def cli_deploy(m: Mode, i: int) -> float:
    """``zattera deploy --image … --no-watch`` as a process, as a user or CI runs it (start-up included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")}
    env |= {"ZATTERA_NATS_URL": m.url, "ZATTERA_NATS_CREDS": m.client_creds}
    argv = [*cli_argv(), "deploy", "--image", f"docker.io/library/busybox:{i}", "--env", f"bench/web/env{i}"]
    started = time.perf_counter()
    done = await asyncio.to_thread(subprocess.run, [*argv, "--no-watch"], env=env, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{m.name}: deploy failed: {done.stderr.decode()[-300:]}")
    return time.perf_counter() - started


async def measure(base: Path, count: int, lines: int, cli_count: int) -> dict[str, dict[str, object]]:
    """The three modes side by side, deploys interleaved (one of each mode in turn), so the machine's load
    weighs on each alike; then the log followers' rounds (:func:`follow_round`), the modes interleaved line by
    line."""
    results: dict[str, dict[str, object]] = {name: {"snapshot": [], "action": [], "cli": []} for name in MODES}
    async with contextlib.AsyncExitStack() as stack:
        envs = count + 2 + cli_count
        modes = [await stack.enter_async_context(mode(name, base / name, envs)) for name in MODES]
        clients = {m.name: await _client(m) for m in modes}
        try:
            for i in range(count + 2):
                for m in modes if i % 2 == 0 else reversed(modes):
                    snapshot, action = await deploy_once(clients[m.name], i)
                    if i >= 2:
                        results[m.name]["snapshot"].append(snapshot)  # type: ignore[attr-defined]
                        results[m.name]["action"].append(action)  # type: ignore[attr-defined]
            for i in range(count + 2, count + 2 + cli_count):
                for m in modes if i % 2 == 0 else reversed(modes):
                    results[m.name]["cli"].append(await cli_deploy(m, i))  # type: ignore[attr-defined]
            for name in MODES:
                results[name] |= {"logs": [], "startup": [], "logs_rounds": []}
            for r in range(LOG_ROUNDS):
                for name, (latencies, startup) in (await follow_round(modes, r, lines // LOG_ROUNDS)).items():
                    results[name]["logs"].extend(latencies)  # type: ignore[attr-defined]
                    results[name]["startup"].append(startup)  # type: ignore[attr-defined]
                    results[name]["logs_rounds"].append(percentile(latencies, 50))  # type: ignore[attr-defined]
        finally:
            for conn in clients.values():
                await conn.close()
    for name in MODES:
        snaps, actions = results[name]["snapshot"], results[name]["action"]
        results[name]["deploy"] = [a + b for a, b in zip(snaps, actions, strict=True)]  # type: ignore[call-overload]
    return results


def run(quick: bool = True) -> list[Row]:
    count = 20 if quick else 100
    lines = 300 if quick else 1500
    cli_count = 6 if quick else 20
    with tempfile.TemporaryDirectory(prefix="zattera-bench-authz-", dir=Path.home() / ".cache") as tmp:
        results = asyncio.run(measure(Path(tmp), count, lines, cli_count))
    ms = 1000.0
    rows: list[Row] = []
    p50 = {name: percentile(results[name]["deploy"], 50) for name in MODES}  # type: ignore[arg-type]
    for name in MODES:
        deploy = results[name]["deploy"]
        logs = results[name]["logs"]
        rows += [
            row(f"{name}: deploy at the CLI, p50 ({len(deploy)})", p50[name] * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}: deploy at the CLI, p10 (spread)", percentile(deploy, 10) * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}: deploy at the CLI, p90 (spread)", percentile(deploy, 90) * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}: deploy at the CLI, p99", percentile(deploy, 99) * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}:   of which snapshot read, p50", percentile(results[name]["snapshot"], 50) * ms, "ms"),  # type: ignore[arg-type]
            row(
                f"{name}:   of which deploy action (writes, event), p50",
                percentile(results[name]["action"], 50) * ms,  # type: ignore[arg-type]
                "ms",
            ),
            row(
                f"{name}: `zattera deploy --image --no-watch` process, median",
                percentile(results[name]["cli"], 50) * ms,  # type: ignore[arg-type]
                "ms",
            ),
            row(f"{name}: `zattera deploy` process, min", min(results[name]["cli"]) * ms, "ms"),  # type: ignore[call-overload]
            row(f"{name}: `zattera deploy` process, max", max(results[name]["cli"]) * ms, "ms"),  # type: ignore[call-overload]
            row(f"{name}: logs -f line latency, p50 ({len(logs)})", percentile(logs, 50) * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}: logs -f line latency, p99", percentile(logs, 99) * ms, "ms"),  # type: ignore[arg-type]
            row(f"{name}: logs -f start (first line), median", percentile(results[name]["startup"], 50) * ms, "ms"),  # type: ignore[arg-type]
        ]
    logs50 = {name: percentile(results[name]["logs"], 50) for name in MODES}  # type: ignore[arg-type]
    cli50 = {name: percentile(results[name]["cli"], 50) for name in MODES}  # type: ignore[arg-type]
    rows += [
        row(
            "member vs open: `zattera deploy` process added (median)",
            (cli50["member"] / cli50["open"] - 1) * 100,
            "%",
            "≤ 10",
        ),
        row(
            "member vs operator: `zattera deploy` process added (median)",
            (cli50["member"] / cli50["operator"] - 1) * 100,
            "%",
            "≤ 10",
        ),
        row("member vs operator: deploy core added (p50)", (p50["member"] / p50["operator"] - 1) * 100, "%"),
        row("member vs open: deploy core added (p50)", (p50["member"] / p50["open"] - 1) * 100, "%"),
        row(
            "member vs open: logs -f line latency added (p50)",
            (logs50["member"] / logs50["open"] - 1) * 100,
            "%",
            "≤ 10",
        ),
        row("operator vs open: logs -f line latency added (p50)", (logs50["operator"] / logs50["open"] - 1) * 100, "%"),
        row(
            "member vs operator: logs -f line latency added (p50)",
            (logs50["member"] / logs50["operator"] - 1) * 100,
            "%",
        ),
    ]
    for name in ("member", "operator"):
        paired = [a - b for a, b in zip(results[name]["logs"], results["open"]["logs"], strict=True)]  # type: ignore[call-overload]
        rows.append(
            row(
                f"{name} − open: logs -f, the same line's latency, median difference",
                percentile(paired, 50) * 1e6,
                "µs",
            )
        )
    rounds = list(zip(results["member"]["logs_rounds"], results["open"]["logs_rounds"], strict=True))  # type: ignore[call-overload]
    ratios = sorted((member / opened - 1) * 100 for member, opened in rounds)
    rows += [
        row(f"member vs open: logs -f p50 added, per round: min of {len(ratios)}", ratios[0], "%"),
        row("member vs open: logs -f p50 added, per round: median", percentile(ratios, 50), "%"),
        row("member vs open: logs -f p50 added, per round: max", ratios[-1], "%"),
    ]
    return rows


if __name__ == "__main__":
    bench_main("Teams' authorisation", run, __doc__, "100 deploys and 1,000 log batches per mode")
