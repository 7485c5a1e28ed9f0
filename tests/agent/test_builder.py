"""The builder: source tarball → build command → image in the registry → the runtime runs it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.builder import Builder
from shared.buildlogs import ERROR_HEADER, cancel_build_subject, run_build_subject
from shared.connection import Connection
from shared.ids import new_id
from shared.registry import BlobStore, fetch_image
from shared.state.feed import StateView
from shared.subjects import BUILD_EVENTS_STREAM, SOURCES_STORE, build_events_subject
from shared.txn import Writer
from tests.agent.conftest import APP, StartAgent, assignment, release
from tests.agent.test_runtime import answers, seed, state_of
from tests.factories import source_tarball
from tests.waiting import eventually


@contextlib.asynccontextmanager
async def serving(builder: Builder) -> AsyncIterator[Builder]:
    """``builder`` answering build requests until the block ends."""
    task = asyncio.create_task(builder.serve())
    await asyncio.wait_for(builder.ready.wait(), 5)
    try:
        yield builder
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def builder(conn: Connection, tmp_path: Path) -> AsyncIterator[Builder]:
    async with serving(Builder(conn, "b1", tmp_path / "builds", os_arch="linux/amd64")) as b:
        yield b


async def start_build(
    conn: Connection, files: dict[str, str], *, build_config: pb.BuildConfig | None = None
) -> tuple[str, Any]:
    """Dispatch a build of ``files`` to builder b1; returns its id and a subscription to its events."""
    digest = await BlobStore(conn, SOURCES_STORE).put(source_tarball(files))
    build = pb.Build(project_id="P1", app_id="A1", environment_id="E1", tarball_digest=digest)
    build.meta.id = new_id()
    request = cpb.RunBuildRequest(build=build, source_url=digest, push_image_ref=f"p1/a1:{build.meta.id.lower()}")
    if build_config is not None:
        request.build_config.CopyFrom(build_config)
        request.build_args.update(build_config.build_args)
    events = await conn.js.subscribe(
        build_events_subject(build.meta.id),
        stream=BUILD_EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    reply = await conn.nc.request(run_build_subject("b1"), request.SerializeToString(), timeout=5)
    assert not (reply.headers or {}).get(ERROR_HEADER)
    return build.meta.id, events


async def next_event(events: Any) -> cpb.BuildEvent:
    return cpb.BuildEvent.FromString((await events.next_msg(timeout=20)).data)


async def run_build(conn: Connection, files: dict[str, str]) -> list[cpb.BuildEvent]:
    _, events = await start_build(conn, files)
    received: list[cpb.BuildEvent] = []
    while not received or not received[-1].done:
        received.append(await next_event(events))
    await events.unsubscribe()
    return received


async def test_build_pushes_an_image_the_runtime_runs(
    builder: Builder, conn: Connection, view: StateView, writer: Writer, start_agent: StartAgent, tmp_path: Path
) -> None:
    manifest = (
        f'[build]\ncommand = "echo compiling && echo built > built.txt"\n\n[run]\ncommand = "{sys.executable} app.py"\n'
    )
    events = await run_build(conn, {"app.py": APP, "zattera.toml": manifest})

    lines = [e.log.line for e in events if e.log.line]
    assert "compiling" in lines
    success = [e for e in events if e.status == pb.BUILD_STATUS_SUCCEEDED]
    assert len(success) == 1 and success[0].image_digest.startswith("sha256:")
    assert list(success[0].platforms) == ["linux/amd64"]
    assert events[-1].done and not any(e.error for e in events)
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))

    image_ref = f"p1/a1@{success[0].image_digest}"
    assert (await fetch_image(conn, image_ref)).layers
    await start_agent("n1")
    rel = release(image_ref)
    a = assignment("n1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "n1", a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="built image HEALTHY")
    port = view.observed("n1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    assert await answers(port)
    assert (tmp_path / "agent-n1" / "instances" / a.meta.id / "rootfs" / "built.txt").read_text() == "built\n"


async def test_failing_build_command_fails_the_build_with_its_output_logged(builder: Builder, conn: Connection) -> None:
    events = await run_build(conn, {"zattera.toml": '[build]\ncommand = "echo oops && exit 7"\n'})

    assert "oops" in [e.log.line for e in events]
    assert events[-1].done and events[-1].status == pb.BUILD_STATUS_FAILED
    assert events[-1].error == "builder: build command exited with code 7: oops"
    assert not any(e.image_digest for e in events)


async def test_cancel_stops_a_running_build(builder: Builder, conn: Connection) -> None:
    build_id, events = await start_build(conn, {"zattera.toml": '[build]\ncommand = "echo started && sleep 30"\n'})
    while (await next_event(events)).log.line != "started":
        pass

    reply = await conn.nc.request(
        cancel_build_subject("b1"), cpb.CancelBuildRequest(build_id=build_id).SerializeToString(), timeout=5
    )
    assert cpb.CancelBuildResponse.FromString(reply.data).canceled
    last = await next_event(events)
    assert last.done and last.status == pb.BUILD_STATUS_FAILED and last.error == "build canceled"


async def test_a_resent_request_for_a_finished_build_is_accepted_without_running_it_again(
    builder: Builder, conn: Connection
) -> None:
    build = pb.Build(project_id="P1", app_id="A1", environment_id="E1", tarball_digest="sha256:" + "0" * 64)
    build.meta.id = new_id()
    request = cpb.RunBuildRequest(build=build, source_url=build.tarball_digest, push_image_ref="p1/a1:x")
    events = await conn.js.subscribe(
        build_events_subject(build.meta.id),
        stream=BUILD_EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    await conn.nc.request(run_build_subject("b1"), request.SerializeToString(), timeout=5)
    while not (await next_event(events)).done:  # fails at once: no such source
        pass
    await eventually(lambda: build.meta.id not in builder._builds, 5, "build finished")

    reply = await conn.nc.request(run_build_subject("b1"), request.SerializeToString(), timeout=5)

    assert not (reply.headers or {}).get(ERROR_HEADER)
    assert build.meta.id not in builder._builds, "a finished build was started again"
    await events.unsubscribe()
