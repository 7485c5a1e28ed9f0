"""Dockerfile builds on a builder node through the session's private dockerd, and the built image (its own
root filesystem) deployed on the docker runtime."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.builder import Builder
from shared.connection import Connection
from shared.imagearchive import read_image_archive
from shared.registry import PlatformImage, digest_of, push_image
from shared.state.feed import StateView
from shared.txn import Writer
from tests.agent.conftest import StartAgent, assignment, release
from tests.agent.test_builder import next_event, start_build
from tests.agent.test_docker_runtime import output_of, start_docker_agent
from tests.agent.test_runtime import http_get, seed, state_of
from tests.dockerd import base_rootfs_tar
from tests.waiting import eventually

DOCKERFILE = """
FROM zattera/base:latest
ARG GREETING=unset
COPY site/ /srv/
RUN echo "$GREETING from a Dockerfile" > /srv/index.html && echo built
USER 65534
CMD ["sh", "-c", "cat /srv/index.html; exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /srv"]
"""


@pytest.fixture
async def docker_builder(conn: Connection, tmp_path: Path, docker_host: str) -> AsyncIterator[Builder]:
    b = Builder(conn, "b1", tmp_path / "builds", os_arch="linux/amd64", docker_host=docker_host)
    task = asyncio.create_task(b.serve())
    await asyncio.wait_for(b.ready.wait(), 5)
    try:
        yield b
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def dockerfile_build(conn: Connection, files: dict[str, str], **config: str) -> list[cpb.BuildEvent]:
    build_config = pb.BuildConfig(type=pb.BUILD_TYPE_DOCKERFILE, build_args={"GREETING": "hello"}, **config)
    _, events = await start_build(conn, files, build_config=build_config)
    received: list[cpb.BuildEvent] = []
    while not received or not received[-1].done:
        received.append(await next_event(events))
    await events.unsubscribe()
    return received


async def test_a_dockerfile_build_is_pushed_and_deploys_on_the_docker_runtime(
    docker_builder: Builder,
    docker_host: str,
    conn: Connection,
    view: StateView,
    writer: Writer,
    start_agent: StartAgent,
    tmp_path: Path,
) -> None:
    files = {"web/build.Dockerfile": DOCKERFILE, "web/site/health": "ok\n", "README": "outside the context"}
    events = await dockerfile_build(conn, files, dockerfile="build.Dockerfile", context_dir="web")
    lines = [e.log.line for e in events if e.log.line]
    assert any(line.strip() == "built" for line in lines), lines
    success = [e for e in events if e.status == pb.BUILD_STATUS_SUCCEEDED]
    assert len(success) == 1 and not any(e.error for e in events), [e.error for e in events]

    await start_docker_agent(start_agent, docker_host)
    rel = release(f"p1/a1@{success[0].image_digest}")
    a = assignment("d1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="HEALTHY", timeout=30)
    port = view.observed("d1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    assert "hello from a Dockerfile" in await http_get(port)
    await eventually(lambda: "hello from a Dockerfile" in output_of(tmp_path, "d1", a.meta.id), what="its output")


async def test_a_failing_dockerfile_fails_the_build_with_its_output(docker_builder: Builder, conn: Connection) -> None:
    events = await dockerfile_build(conn, {"Dockerfile": "FROM zattera/base:latest\nRUN echo oops && exit 3\n"})
    assert any("oops" in e.log.line for e in events)
    assert events[-1].done and events[-1].status == pb.BUILD_STATUS_FAILED
    assert events[-1].error.startswith("builder: docker build:") and "3" in events[-1].error


async def test_a_context_dir_leaving_the_source_is_refused(docker_builder: Builder, conn: Connection) -> None:
    events = await dockerfile_build(conn, {"Dockerfile": "FROM scratch\n"}, context_dir="../..")
    assert events[-1].error == "builder: context_dir '../..' leaves the source"


def oci_layout(rootfs: bytes, cmd: list[str]) -> bytes:
    """An OCI image layout tarball of one image: ``rootfs`` as its only (gzip'd) layer."""
    layer = gzip.compress(rootfs)
    config = json.dumps(
        {
            "os": "linux",
            "architecture": "amd64",
            "config": {"Cmd": cmd, "User": "65534"},
            "rootfs": {"type": "layers", "diff_ids": [digest_of(rootfs)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "config": {"digest": digest_of(config), "size": len(config)},
            "layers": [{"digest": digest_of(layer), "size": len(layer)}],
        }
    ).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{"digest": digest_of(manifest)}]}).encode()
    files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index}
    for blob in (layer, config, manifest):
        files[f"blobs/sha256/{digest_of(blob).removeprefix('sha256:')}"] = blob
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def test_an_imported_oci_layout_runs_as_it_is_on_the_docker_runtime(
    docker_host: str, conn: Connection, view: StateView, writer: Writer, start_agent: StartAgent
) -> None:
    """Its own root filesystem (no base image under it), its own user."""
    serve = (
        "mkdir -p /tmp/www && echo oci > /tmp/www/index.html && exec httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h /tmp/www"
    )
    image = read_image_archive(oci_layout(base_rootfs_tar(), ["sh", "-c", serve]))
    record = await push_image(
        conn, repo="p1/a1", tag="oci", images=[PlatformImage(image.platform, image.config, image.layers)]
    )
    await start_docker_agent(start_agent, docker_host)
    rel = release(f"{record.repo}@{record.digest}", healthcheck=False)
    a = assignment("d1", rel)
    await seed(writer, rel, a)
    await eventually(lambda: state_of(view, "d1", a.meta.id) == pb.INSTANCE_STATE_HEALTHY, what="HEALTHY", timeout=30)
    port = view.observed("d1", a.meta.id).mesh_port_bindings["http"]  # type: ignore[union-attr]
    await eventually(lambda: _serves(port, "oci"), what="it serves")


async def _serves(port: int, text: str) -> bool:
    try:
        return text in await http_get(port)
    except OSError:
        return False
