"""Bring a cluster to this code's schema: the pending migrations, in order, by one process at a time.

:func:`upgrade` is what the control plane runs at start (every service process, after provisioning, and
``zattera up`` before it starts them) and what ``zattera cluster upgrade`` runs on demand:

1. read the recorded schema and version and judge them (``shared/skew.py``): a cluster at a newer schema
   than this code is refused (no downgrade), one at this schema needs nothing;
2. campaign for ``lease.schema-upgrade``; a process that does not get it waits until the holder has brought
   the cluster to this schema (or the lease is free again, and it takes over);
3. the holder runs each pending migration and records it — the schema number, the version and what it
   changed, in the state stream's metadata — before the next one: a run cut anywhere resumes at the first
   migration not recorded, which being idempotent finishes what it had begun;
4. the cluster's version becomes this code's when it is newer (a release without migrations moves it too);
   a ``cluster.upgraded`` event says what ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from zattera.v1 import types_pb2 as pb

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.events import EventPublisher, make_event
from shared.lease import Leadership, default_holder, run_while_leading
from shared.migrations.base import MigrationContext, MigrationInterrupted, Step
from shared.migrations.registry import load
from shared.provisioning import raw_stream_config, recorded_config, update_stream_raw
from shared.skew import Component, SkewRefused, Verdict, judge
from shared.streams import ClusterConfig
from shared.subjects import STATE_STREAM
from shared.tasks import cancel_and_wait
from shared.version import VERSION, newer

log = logging.getLogger(__name__)

UPGRADE_LEASE = "schema-upgrade"
POLL = 0.5
"""How often a process waiting for another's upgrade reads the recorded schema."""


class NotInitialised(ZatteraError):
    """The cluster has no state stream yet: it is initialised (at this schema), not upgraded."""


class MigrationFailed(ZatteraError):
    """A migration raised: the cluster stays at the last schema recorded (the next run resumes there)."""


@dataclass(frozen=True)
class Applied:
    label: str
    summary: str
    changes: tuple[str, ...]


@dataclass
class UpgradeReport:
    """What :func:`upgrade` found and did. ``applied`` is empty when nothing was pending or when another
    process ran the migrations (``by_other``)."""

    before: ClusterConfig
    after: ClusterConfig
    verdict: Verdict
    message: str = ""
    applied: list[Applied] = field(default_factory=list)
    by_other: bool = False

    @property
    def pending(self) -> int:
        return max(0, self.after.schema - self.before.schema)


def pending_steps(recorded_schema: int, steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.number > recorded_schema]


def history_line(step: Step, changes: list[str], at: str, version: str) -> str:
    """``<NNNN> <when> <version> <changes>`` (the metadata value is what follows the number)."""
    return f"{step.number:04d} {at} {version} {'; '.join(changes) or 'nothing to change'}"


async def _recorded(conn: Connection) -> ClusterConfig:
    config = await recorded_config(conn.js)
    if config is None:
        raise NotInitialised(f"{STATE_STREAM} does not exist: the cluster is not initialised")
    return config


async def record(conn: Connection, config: ClusterConfig) -> ClusterConfig:
    """Write ``config`` into the state stream's metadata; the schema and version recorded never go down
    (a deposed runner's late write cannot undo a newer one), earlier migrations' lines are kept and a
    recorded cluster id is never replaced."""
    raw = await raw_stream_config(conn.nc, STATE_STREAM)
    if raw is None:
        raise NotInitialised(f"{STATE_STREAM} vanished while being upgraded")
    now = ClusterConfig.from_metadata(raw.get("metadata") or {}, config.replicas, config.tombstone_ttl)
    merged = replace(
        config,
        cluster_id=now.cluster_id or config.cluster_id,  # a recorded id is never replaced
        schema=max(config.schema, now.schema),
        version=config.version if not now.version or newer(config.version, now.version) else now.version,
        migrations=tuple(sorted({*now.migrations, *config.migrations})),
    )
    raw["metadata"] = {**(raw.get("metadata") or {}), **merged.metadata()}
    await update_stream_raw(conn.nc, raw)
    return merged


async def _run_pending(
    conn: Connection,
    leadership: Leadership,
    steps: list[Step],
    *,
    schema: int,
    version: str,
    progress: Callable[[str], None],
) -> tuple[ClusterConfig, ClusterConfig, list[Applied]]:
    """Under the lease: every migration above the recorded schema, each recorded before the next."""
    before = config = await _recorded(conn)
    refusal = judge(Component.CONTROL_PLANE, version, schema, config.version, config.schema)
    if refusal.refused:  # a newer control plane upgraded the cluster while this one waited
        raise SkewRefused(refusal.message)
    applied = []
    for step in pending_steps(config.schema, steps):
        progress(f"migration {step.label}: {step.migration.summary}")
        ctx = MigrationContext(conn, config, leadership.lease, progress=lambda line: progress(f"  {line}"))
        try:
            await step.migration.apply(ctx)
        except MigrationInterrupted:
            raise
        except Exception as exc:
            raise MigrationFailed(
                f"migration {step.label} failed: {exc!r}; the cluster stays at schema {config.schema} "
                "(the next start resumes there)"
            ) from exc
        finally:
            await ctx.close()
        ctx.check_leading()
        at = datetime.now(UTC).isoformat(timespec="seconds")
        config = await record(
            conn,
            replace(
                ctx.config,
                schema=step.number,
                version=version if newer(version, config.version or "0") else config.version,
                migrations=(*config.migrations, history_line(step, ctx.changes, at, version)),
            ),
        )
        applied.append(Applied(step.label, step.migration.summary, tuple(ctx.changes)))
        progress(f"migration {step.label}: done ({'; '.join(ctx.changes) or 'nothing to change'})")
    if not config.version or newer(version, config.version):
        if not leadership.lease.held:
            raise MigrationInterrupted(f"lease {leadership.lease.loop} lost before recording the version")
        config = await record(conn, replace(config, version=version))
    return before, config, applied


def _needs_work(config: ClusterConfig, schema: int, version: str) -> bool:
    return config.schema < schema or not config.version or newer(version, config.version)


async def upgrade(
    conn: Connection,
    *,
    holder: str = "",
    schema: int | None = None,
    version: str = VERSION,
    steps: list[Step] | None = None,
    progress: Callable[[str], None] | None = None,
    lease_ttl: float = 3.0,
    lease_renew: float = 1.0,
    events: EventPublisher | None = None,
) -> UpgradeReport:
    """Bring the cluster to ``schema`` (default: this code's) as Zattera ``version``; returns what ran.
    Raises :class:`SkewRefused` (a downgrade, or a control plane too old for the cluster),
    :class:`MigrationFailed`, :class:`NotInitialised`."""
    steps = load() if steps is None else steps
    schema = max((s.number for s in steps), default=0) if schema is None else schema
    say = progress or (lambda line: log.info("%s", line))
    before = await _recorded(conn)
    skew = judge(Component.CONTROL_PLANE, version, schema, before.version, before.schema)
    if skew.refused:
        raise SkewRefused(skew.message)
    if not _needs_work(before, schema, version):
        return UpgradeReport(before, before, skew.verdict, skew.message)
    if skew.verdict is Verdict.UPGRADE:
        say(skew.message)
    outcome: asyncio.Future[tuple[ClusterConfig, ClusterConfig, list[Applied]]] = (
        asyncio.get_running_loop().create_future()
    )

    async def lead(leadership: Leadership) -> None:
        try:
            result = await _run_pending(conn, leadership, steps, schema=schema, version=version, progress=say)
        except MigrationInterrupted as exc:
            say(f"{exc}; waiting for the process that holds it")
            raise
        except Exception as exc:  # returned, not raised: the lease is handed over at once, not at its TTL
            if not outcome.done():
                outcome.set_exception(exc)
            return
        if not outcome.done():
            outcome.set_result(result)

    campaign = asyncio.create_task(
        run_while_leading(
            conn,
            UPGRADE_LEASE,
            lead,
            holder=holder or default_holder("schema-upgrade"),
            ttl=lease_ttl,
            renew_interval=lease_renew,
        )
    )
    waiting_said = False
    try:
        while not outcome.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(outcome), POLL)
            if outcome.done():
                break
            now = await _recorded(conn)
            if not _needs_work(now, schema, version):
                report = UpgradeReport(before, now, Verdict.UPGRADE, skew.message, by_other=True)
                say(f"the cluster was upgraded by another process: schema {now.schema} (Zattera {now.version})")
                return report
            if not waiting_said:
                waiting_said = True
                say(f"another process holds lease.{UPGRADE_LEASE}: waiting for its upgrade")
        start, after, applied = outcome.result()
    finally:
        await cancel_and_wait(campaign)
    report = UpgradeReport(start, after, Verdict.UPGRADE if applied else skew.verdict, skew.message, applied)
    say(
        f"cluster at schema {after.schema} (Zattera {after.version})"
        + (f": {len(applied)} migration(s) run" if applied else "")
    )
    if events is not None and (applied or start.version != after.version):
        await events.publish(upgraded_event(report))
    return report


def upgraded_event(report: UpgradeReport) -> pb.Event:
    """``cluster.upgraded``: from/to schema and version, the migrations run."""
    return make_event(
        "cluster.upgraded",
        f"cluster upgraded to schema {report.after.schema} (Zattera {report.after.version})"
        + (f": {', '.join(a.label for a in report.applied)}" if report.applied else ""),
        fields={
            "from_schema": str(report.before.schema),
            "to_schema": str(report.after.schema),
            "from_version": report.before.version,
            "to_version": report.after.version,
            "migrations": ", ".join(a.label for a in report.applied),
        },
    )
