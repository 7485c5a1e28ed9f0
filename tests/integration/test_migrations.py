"""Schema migrations on a real nats-server: clusters made by earlier releases (their streams recreated as
they were, ``tests/compat/releases``) brought to this code's schema; idempotent, resumable, one runner at a
time under the lease, recorded, and a downgrade refused."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
from nats.js.api import KeyValueConfig
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.connection import Connection, connect
from shared.migrations.base import Migration, MigrationContext, Step
from shared.migrations.registry import SCHEMA, Listed, load
from shared.migrations.runner import MigrationFailed, record, upgrade
from shared.provisioning import js_api, provision, raw_stream_config, recorded_config
from shared.skew import SkewRefused
from shared.state.feed import StateView
from shared.streams import STREAM_FIELDS_CHECKED, ClusterConfig
from shared.subjects import BUILD_EVENTS_STREAM, LIVE_STREAM, STATE_STREAM, build_events_subject
from shared.txn import Writer
from shared.version import VERSION
from tests.compat.releases import PRE_0_1, PREVIOUS, recreate, streams
from tests.routes import state as S
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def bare(nats_url: str) -> AsyncIterator[Connection]:
    """A connection to a server with nothing on it (no provisioning)."""
    c = await connect(nats_url, name="test-migrations")
    try:
        yield c
    finally:
        await c.close()


async def recreate_pre_0_1(conn: Connection) -> None:
    """31c8706's cluster while it runs: its captured streams, and its live bucket (in memory, so absent from
    a capture made after a restart) with rollups allowed, as that release made it."""
    await recreate(conn, PRE_0_1)
    live = dict(streams(PREVIOUS)[LIVE_STREAM]["config"], allow_rollup_hdrs=True)
    await js_api(conn.nc, f"STREAM.CREATE.{LIVE_STREAM}", live)


async def test_a_cluster_made_before_0_1_0_builds_again_once_upgraded(bare: Connection) -> None:
    """The builder's publishes to zattera.builds.<id>.events.<node> find a stream after the migration."""
    await recreate_pre_0_1(bare)
    with pytest.raises(Exception, match="no response from stream"):
        await bare.js.publish(build_events_subject("B1", "n1"), b"x", timeout=1)

    lines: list[str] = []
    report = await upgrade(bare, holder="test", progress=lines.append)

    assert [a.label for a in report.applied] == [s.label for s in load()]
    assert report.before.schema == 0 and report.after.schema == SCHEMA
    ack = await bare.js.publish(build_events_subject("B1", "n1"), b"x", timeout=2)
    assert ack.stream == BUILD_EVENTS_STREAM
    live = await raw_stream_config(bare.nc, LIVE_STREAM)
    assert live is not None and live["allow_rollup_hdrs"] is False
    recorded = await recorded_config(bare.js)
    assert recorded is not None
    assert (recorded.schema, recorded.version, recorded.replicas) == (SCHEMA, VERSION, 1)
    assert recorded.initialized_at  # read from the state stream's creation
    assert recorded.cluster_id  # recorded now, as a new cluster's init records one
    assert recorded.migrations[0].startswith("0001 ") and "subjects" in recorded.migrations[0]
    assert any("migration 0001 build-events-per-sender" in line for line in lines), lines
    # Provisioning (what every service runs first) now finds nothing to report.
    provisioned = await provision(bare.js)
    assert provisioned.mismatches == [] and provisioned.created == []


async def test_a_0_1_0_cluster_is_recorded_at_this_schema_and_changes_nothing_else(bare: Connection) -> None:
    await recreate(bare, PREVIOUS)
    before = {s: await raw_stream_config(bare.nc, s) for s in (BUILD_EVENTS_STREAM, LIVE_STREAM)}
    report = await upgrade(bare, holder="test")
    assert report.after.schema == SCHEMA and report.after.version == VERSION
    assert report.after.initialized_at == report.before.initialized_at != ""
    assert report.before.cluster_id == "" and report.after.cluster_id != ""
    for name, config in before.items():
        assert await raw_stream_config(bare.nc, name) == config, name
    again = await upgrade(bare, holder="test")
    assert again.applied == [] and again.after == report.after  # idempotent: nothing pending


async def test_an_upgraded_cluster_is_the_cluster_this_code_initialises(bare: Connection, nats_url: str) -> None:
    """Every migration together brings 0.1.0's streams to what provisioning creates today: a stream added
    to the definition without a migration, or a migration's change the definition lacks (or the reverse),
    fails here. Run without provisioning, which would create what is missing and hide it. (Streams a
    service makes on first use, per-env logs, the console's users, are not provisioning's.)"""
    await recreate(bare, PREVIOUS)
    await upgrade(bare, holder="test")
    migrated = {name: await raw_stream_config(bare.nc, name) for name in await _names(bare)}
    migrated_meta = set((migrated[STATE_STREAM] or {}).get("metadata") or {})
    fresh_url = nats_url  # the same server, emptied, then initialised by this code
    for name in list(migrated):
        await bare.js.delete_stream(name)
    fresh = await connect(fresh_url, name="fresh")
    try:
        await provision(fresh.js)
        made = {name: await raw_stream_config(fresh.nc, name) for name in await _names(fresh)}
    finally:
        await fresh.close()
    fresh_meta = {k for k in (made[STATE_STREAM] or {}).get("metadata") or {} if k.startswith("zattera.")}
    assert fresh_meta - {k for k in fresh_meta if k.startswith("zattera.migration.")} <= migrated_meta, (
        f"a new cluster records {fresh_meta - migrated_meta}, which no migration records on an older one"
    )
    assert set(made) <= set(migrated), (
        f"provisioning makes {set(made) - set(migrated)}, which no migration creates on an older cluster "
        "(docs/upgrades.md, 'Adding a migration')"
    )
    for name, config in made.items():
        assert config is not None and migrated[name] is not None
        differ = {f for f in _checked(config) if _checked(config)[f] != _checked(migrated[name])[f]}
        assert not differ, f"{name}: {differ} differ between a new cluster and a migrated one (docs/upgrades.md)"


def _checked(config: dict[str, object]) -> dict[str, object]:
    """The fields provisioning checks (``STREAM_FIELDS_CHECKED``) plus rollups, as the server names them."""
    return {f: config.get(f) for f in (*STREAM_FIELDS_CHECKED, "allow_rollup_hdrs", "discard", "deny_delete")}


async def _names(conn: Connection) -> list[str]:
    return [info.config.name for info in await conn.js.streams_info() if info.config.name]


async def test_a_cut_run_resumes_where_it_was_recorded(bare: Connection) -> None:
    """A runner killed after a migration's change but before its record: the next run applies it again
    (idempotent) and records it; one killed after the record does not run it again."""
    await recreate_pre_0_1(bare)
    runs: list[int] = []

    def counted(step: Step, fail_after: bool = False) -> Step:
        async def apply(ctx: MigrationContext) -> None:
            runs.append(step.number)
            await step.migration.apply(ctx)
            if fail_after:
                raise RuntimeError("killed before the record")

        return Step(step.listed, dataclasses.replace(step.migration, apply=apply))

    real = load()
    extra = Step(Listed(len(real) + 1, "extra_bucket", "test"), Migration("a bucket", VERSION, _make_bucket))
    with pytest.raises(MigrationFailed, match="stays at schema 0"):
        await upgrade(bare, holder="a", steps=[counted(real[0], fail_after=True)])
    assert (await recorded_config(bare.js)).schema == 0  # type: ignore[union-attr]
    subjects = (await raw_stream_config(bare.nc, BUILD_EVENTS_STREAM) or {})["subjects"]
    assert subjects == [build_events_subject("*")]  # the change itself had landed

    with pytest.raises(MigrationFailed):
        await upgrade(bare, holder="b", steps=[*(counted(s) for s in real), counted(extra, fail_after=True)])
    assert (await recorded_config(bare.js)).schema == len(real)  # type: ignore[union-attr]

    runs.clear()
    report = await upgrade(bare, holder="c", steps=[*(counted(s) for s in real), counted(extra)])
    assert runs == [extra.number]  # resumed at the first migration not recorded
    assert report.after.schema == extra.number
    assert [line.split(" ")[0] for line in report.after.migrations] == [f"{n:04d}" for n in range(1, extra.number + 1)]


async def _make_bucket(ctx: MigrationContext) -> None:
    await ctx.create_key_value(KeyValueConfig(bucket="test-extra", history=1))


async def test_one_process_runs_the_migrations_the_others_wait_for_it(bare: Connection, nats_url: str) -> None:
    await recreate_pre_0_1(bare)
    started = asyncio.Event()
    release = asyncio.Event()
    applied_by: list[str] = []

    def slow(step: Step, who: str) -> Step:
        async def apply(ctx: MigrationContext) -> None:
            applied_by.append(who)
            started.set()
            await release.wait()
            await step.migration.apply(ctx)

        return Step(step.listed, dataclasses.replace(step.migration, apply=apply))

    others = [await connect(nats_url, name=f"cp{i}") for i in range(2)]
    try:
        first = asyncio.create_task(upgrade(bare, holder="cp-a", steps=[slow(s, "a") for s in load()]))
        await asyncio.wait_for(started.wait(), 10)
        waiting = [
            asyncio.create_task(upgrade(c, holder=f"cp-{i}", steps=[slow(s, str(i)) for s in load()]))
            for i, c in enumerate(others)
        ]
        await asyncio.sleep(0)  # (nothing to wait for: they must be waiting on the lease)
        release.set()
        reports = await asyncio.gather(first, *waiting)
    finally:
        for c in others:
            await c.close()
    assert applied_by == ["a"] * len(load())
    assert reports[0].applied and not reports[0].by_other
    assert all(r.by_other and not r.applied for r in reports[1:])
    lease = await bare.js.get_last_msg(STATE_STREAM, f"$KV.zattera-state.{K.lease('schema-upgrade')}", direct=True)
    assert not lease.data or pb.Lease.FromString(lease.data).holder != "cp-a"  # released, not left held


async def test_a_cluster_at_a_newer_schema_is_refused_and_left_as_it_is(conn: Connection) -> None:
    now = await recorded_config(conn.js)
    assert now is not None and now.schema == SCHEMA and now.version == VERSION
    newer = dataclasses.replace(now, schema=SCHEMA + 2, version="0.9.0")
    await record(conn, newer)
    with pytest.raises(SkewRefused, match=r"schema .* is newer than this control plane .* downgrades are refused"):
        await upgrade(conn, holder="old")
    assert await recorded_config(conn.js) == newer


async def test_the_record_never_goes_down(conn: Connection) -> None:
    """A deposed runner's late write of an older schema or version cannot undo a newer one."""
    now = await recorded_config(conn.js)
    assert now is not None
    ahead = dataclasses.replace(now, schema=SCHEMA + 1, version="0.3.0")
    await record(conn, ahead)
    await record(conn, dataclasses.replace(now, schema=SCHEMA, version=VERSION))
    assert await recorded_config(conn.js) == ahead
    meta = (await raw_stream_config(conn.nc, STATE_STREAM) or {})["metadata"]
    assert json.loads(json.dumps(meta))["zattera.schema"] == str(SCHEMA + 1)


def test_a_fresh_cluster_records_this_schema() -> None:
    assert ClusterConfig(schema=SCHEMA, version=VERSION).metadata()["zattera.schema"] == str(SCHEMA)


async def test_vips_of_the_earlier_range_move_to_loopback_keeping_their_host_part(bare: Connection) -> None:
    """0.1.0 allocated VIPs from 10.97.0.0/16 (a connection to one left the machine): each becomes 127.128.a.b
    with the same ``a.b``, so apps' addresses of the env (``127.(128+c).a.b``) stay the same; run again,
    nothing changes."""
    await recreate(bare, PREVIOUS)
    view = StateView(bare, name="test")
    await view.start()
    try:
        await S.commit(Writer(bare, view), S.vip("e1", "10.97.0.5"), S.vip("e2", "10.97.3.254"))
        report = await upgrade(bare, holder="test")
        assert any(line.startswith("0003 ") and "moved 2 VIPs" in line for line in report.after.migrations)
        await eventually(
            lambda: (
                {v.environment_id: v.vip for v in view.vips()}
                == {
                    "e1": "127.128.0.5",
                    "e2": "127.128.3.254",
                }
            )
        )
        again = await upgrade(bare, holder="test")
        assert again.applied == []
    finally:
        await view.stop()
