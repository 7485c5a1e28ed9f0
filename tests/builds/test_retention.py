"""Retention on real NATS."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from zattera.v1 import types_pb2 as pb

from services.builds.registry import RegistrySweeper
from services.builds.retention import Retention
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.registry import BlobStore, PlatformImage, image_id, push_image
from shared.state.feed import StateView
from shared.subjects import IMAGES_STORE, SOURCES_STORE
from shared.txn import Writer
from tests.builds import seed
from tests.builds.test_dispatcher import put
from tests.waiting import eventually

HOUR = 3600.0


def retention(conn: Connection, view: StateView, clock: FakeClock, writer: Writer, **kw: Any) -> Retention:
    loop = Retention(LoopDeps(conn, view, clock), **kw)
    loop.writer = writer
    return loop


def env(active: str) -> pb.Environment:
    e = pb.Environment(project_id="proj", app_id="app", active_release_id=active)
    e.meta.id = "env"
    return e


def tag_record(n: int) -> pb.Image:
    i = pb.Image(repo="proj/app", tag=f"build-{n}", digest=f"sha256:{n:064x}", blob_digests=[f"sha256:{n:064x}"])
    i.meta.id = image_id("proj/app", f"build-{n}")
    return i


def release_ids(view: StateView) -> set[str]:
    return {r.meta.id for r in view.releases()}


def tags(view: StateView) -> set[str]:
    return {i.tag for i in view.images()}


async def test_retention_keeps_recent_active_and_referenced_and_untags_the_pruned_builds(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock
) -> None:
    await put(writer, env("rel-15"), *(seed.release(i) for i in range(1, 16)), *(tag_record(i) for i in range(1, 16)))
    await put(writer, seed.deployment("d-inflight", "rel-2", pb.DEPLOYMENT_PHASE_HEALTHCHECKING))
    await retention(conn, view, clock, writer).pass_once()
    assert release_ids(view) == {*(f"rel-{i}" for i in range(6, 16)), "rel-2"}
    assert {f"build-{i}" for i in range(1, 16)} - tags(view) == {"build-1", "build-3", "build-4", "build-5"}


async def test_retention_keeps_the_previous_release(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock
) -> None:
    await put(writer, env("rel-11"), *(seed.release(i) for i in range(1, 13)))
    await retention(conn, view, clock, writer).pass_once()
    assert release_ids(view) == {f"rel-{i}" for i in range(3, 13)}


async def test_stale_tarballs_are_deleted_unless_fresh_or_needed_by_a_queued_build(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock
) -> None:
    sources = BlobStore(conn, SOURCES_STORE, clock=clock)
    old = await sources.put(b"old source")
    needed = await sources.put(b"old source of a queued build")
    await clock.advance(25 * HOUR)
    fresh = await sources.put(b"fresh source")
    await put(writer, seed.build("b1", tarball_digest=needed))
    await retention(conn, view, clock, writer).pass_once()
    assert [await sources.has(d) for d in (old, needed, fresh)] == [False, True, True]


async def test_reupload_of_an_old_tarball_refreshes_it(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock
) -> None:
    sources = BlobStore(conn, SOURCES_STORE, clock=clock)
    digest = await sources.put(b"same source")
    await clock.advance(25 * HOUR)
    await sources.put(b"same source")  # dedupe upload: the reference kept the old mtime
    await retention(conn, view, clock, writer).pass_once()
    assert await sources.has(digest)


async def test_pruned_upload_release_frees_its_image_blobs_and_shared_layers_survive(
    conn: Connection, view: StateView, writer: Writer, clock: FakeClock
) -> None:
    builds = [f"01JBUILD{i:018d}" for i in range(1, 13)]  # upper-case ULIDs; images are tagged lower-case
    pushed = []
    for i, build_id in enumerate(builds, start=1):
        image = await push_image(
            conn,
            repo="proj/app",
            tag=build_id.lower(),
            images=[PlatformImage("linux/amd64", f"cfg {i}".encode(), [b"shared base", f"app {i}".encode()])],
            build_id=build_id,
            clock=clock,
        )
        pushed.append(image)
    releases = [seed.release(i, build_id="", image_ref=f"proj/app@{pushed[i - 1].digest}") for i in range(1, 13)]
    deployments = [
        seed.deployment(f"d{i}", f"rel-{i}", pb.DEPLOYMENT_PHASE_SUCCEEDED, build_id=b) for i, b in enumerate(builds, 1)
    ]
    await put(writer, env("rel-12"), *releases, *deployments)
    await eventually(lambda: len(view.images()) == 12, 5, "tags in the view")
    await clock.advance(1000.0)
    sweeper = RegistrySweeper(conn, view, clock, grace=900.0)
    await retention(conn, view, clock, writer, sweeper=sweeper).pass_once()

    assert release_ids(view) == {f"rel-{i}" for i in range(3, 13)}
    assert tags(view) == {b.lower() for b in builds[2:]}
    blobs = BlobStore(conn, IMAGES_STORE)
    assert [await blobs.has(d) for d in pushed[0].blob_digests if d != pushed[2].blob_digests[1]] == [False] * 3
    assert await blobs.has(pushed[2].blob_digests[1])  # the shared base layer
    assert all([await blobs.has(d) for d in pushed[11].blob_digests])


async def test_retention_sweeps_at_term_start_then_an_hour_after_each_sweep(
    conn: Connection,
    view: StateView,
    writer: Writer,
    clock: FakeClock,
    leading: Callable[[Connection, Retention, str], asyncio.Task[None]],
) -> None:
    loop = Retention(LoopDeps(conn, view, clock))
    leading(conn, loop, "retention-test")
    await eventually(lambda: loop.sweeps == 1 and clock.sleepers == 1, 5, "first sweep at term start")
    await clock.advance(HOUR - 1)
    assert loop.sweeps == 1
    await clock.advance(1)
    await eventually(lambda: loop.sweeps == 2, 5, "second sweep an hour later")


async def test_a_deleted_envs_releases_images_deployments_and_builds_go_once_no_replica_uses_them(
    conn: Connection,
    view: StateView,
    writer: Writer,
    clock: FakeClock,
    leading: Callable[[Connection, Retention, str], asyncio.Task[None]],
) -> None:
    """`zattera envs delete` leaves releases and images to retention; it wakes on the deletion
    and on the reaping of the env's last replica, not an hour later."""
    from shared import keys as K
    from tests.factories import assignment

    build = seed.build("build-2", status=pb.BUILD_STATUS_SUCCEEDED)
    build.environment_id = "env"
    running = assignment("n1", "env", "rel-2", assignment_id="a-2")
    await put(writer, env("rel-2"), *(seed.release(i) for i in (1, 2)), *(tag_record(i) for i in (1, 2)))
    await put(writer, seed.deployment("d-2", "rel-2", pb.DEPLOYMENT_PHASE_SUCCEEDED), build, running)
    loop = Retention(LoopDeps(conn, view, clock))
    leading(conn, loop, "retention-test")
    await eventually(lambda: loop.sweeps == 1 and clock.sleepers == 1, 5, "first sweep at term start")
    assert release_ids(view) == {"rel-1", "rel-2"}

    await writer.commit(writer.txn().delete(K.env("env")))
    await eventually(lambda: release_ids(view) == {"rel-2"}, 5, "the unused release pruned at once")
    assert tags(view) == {"build-2"} and view.deployment("d-2") is not None

    await writer.commit(writer.txn().delete(K.assignment("n1", "a-2")))  # the scheduler reaped the replica
    await eventually(lambda: not release_ids(view) and not tags(view), 5, "the last release and its image")
    await eventually(lambda: view.deployment("d-2") is None and view.build("build-2") is None, 5, "leftovers")
    await eventually(lambda: loop.sweeps == 3, 5, "three sweeps, the clock never advanced")
