"""Build-to-serving time of real apps (issue 27): examples/flask and examples/express built by the real
builder (stack detection, real packages from PyPI and npm) on an embedded nats-server, then the image fetched,
unpacked and started as the process runtime does (``services/agent/images.py``) until it answers HTTP.

* cold: a fresh builder (no dependency layer, no download cache): everything is downloaded and installed;
* warm: a code change only: the dependency layer is reused from the builder's cache;
* pack as is: today's build of the same source (no install, ``[build] install = ""``): build time only, since
  such an image cannot serve (its packages are missing: the issue's starting point).

The scheduler's and the agent's own reaction times are not included (see the deploy benchmarks).
``python -m benchmarks.stack_builds_bench`` (quick, ~15 s: the Flask app, one sample each) or ``--full`` (both
apps, three warm samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from nats.js.api import ConsumerConfig, DeliverPolicy
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, median, row
from services.agent.builder import Builder
from services.agent.images import prepare_image
from services.agent.processes import spawn
from shared.buildlogs import run_build_subject
from shared.connection import Connection, connect
from shared.embedded import free_port
from shared.ids import new_id
from shared.provisioning import provision
from shared.registry import BlobStore
from shared.subjects import BUILD_EVENTS_STREAM, SOURCES_STORE, build_events_subject
from tests.factories import source_tarball

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ANCHOR = "issue 27 (builds that work for real apps)"
SERVE_TIMEOUT = 60.0


def example(name: str) -> dict[str, str]:
    root = EXAMPLES / name
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


async def build(conn: Connection, node: str, files: dict[str, str]) -> str:
    """Build ``files`` on builder ``node``; returns the image ref."""
    digest = await BlobStore(conn, SOURCES_STORE).put(source_tarball(files))
    request = cpb.RunBuildRequest(source_url=digest)
    request.build.meta.id = new_id()
    request.push_image_ref = f"bench/app:{request.build.meta.id.lower()}"
    events = await conn.js.subscribe(
        build_events_subject(request.build.meta.id),
        stream=BUILD_EVENTS_STREAM,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    try:
        await conn.nc.request(run_build_subject(node), request.SerializeToString(), timeout=5)
        while True:
            event = cpb.BuildEvent.FromString((await events.next_msg(timeout=300)).data)
            if event.status == pb.BUILD_STATUS_FAILED:
                raise RuntimeError(f"build failed: {event.error}")
            if event.image_digest:
                return f"bench/app@{event.image_digest}"
    finally:
        await events.unsubscribe()


async def serve(conn: Connection, ref: str, instance_dir: Path) -> float:
    """Fetch and start the image as the process runtime does; the time (perf_counter) it first answers GET /
    (the process is stopped afterwards, outside the measure)."""
    image = await prepare_image(conn, ref, instance_dir)
    port = free_port()
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ} | image.env | {"PORT": str(port)}
    handle = await spawn(image.command(), cwd=image.workdir, env=env, instance_dir=instance_dir)
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
                await writer.drain()
                answered = (await reader.read()).startswith(b"HTTP/1.")
                writer.close()
                if answered:
                    return time.perf_counter()
            await asyncio.sleep(0.02)
        raise RuntimeError(f"{ref} did not answer within {SERVE_TIMEOUT}s")
    finally:
        await handle.stop(2.0)


async def _run(quick: bool, url: str, work: Path) -> list[Row]:
    conn = await connect(url, name="bench-stack-builds")
    await provision(conn.js)
    rows: list[Row] = []
    try:
        for app in ("flask",) if quick else ("flask", "express"):
            node = f"builder-{app}"
            builder = Builder(conn, node, work / app / "builds", os_arch="linux/amd64", cache_dir=work / app / "cache")
            task = asyncio.create_task(builder.serve())
            await builder.ready.wait()
            try:
                files = example(app)
                started = time.perf_counter()
                cold = await serve(conn, await build(conn, node, files), work / app / "cold") - started
                warm: list[float] = []
                built: list[float] = []
                for i in range(1 if quick else 3):
                    changed = {**files, "zattera.toml": files["zattera.toml"] + f"\n# change {i}\n"}
                    started = time.perf_counter()
                    ref = await build(conn, node, changed)
                    built.append(time.perf_counter() - started)
                    warm.append(await serve(conn, ref, work / app / f"warm{i}") - started)
                as_is = {**files, "zattera.toml": files["zattera.toml"] + '\n[build]\ninstall = ""\n'}
                started = time.perf_counter()
                await build(conn, node, as_is)
                packed = time.perf_counter() - started
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            rows += [
                row(f"{app}: cold build → serving (fresh builder, downloads)", cold, "s", "", ANCHOR),
                row(f"{app}: warm rebuild → serving (code change, cached deps)", median(warm), "s", "≤ 5 s", ANCHOR),
                row(f"{app}: warm rebuild, build only", median(built), "s", "", ANCHOR),
                row(f"{app}: pack-as-is build (today's, cannot serve)", packed, "s", "", ANCHOR),
            ]
    finally:
        await conn.close()
    return rows


def run(quick: bool = True) -> list[Row]:
    if not shutil.which("npm"):
        return [row("stack builds: npm is not installed (make system-packages)", float("nan"), "")]
    with embedded_server() as server, tempfile.TemporaryDirectory(prefix="zattera-stack-bench-") as tmp:
        return asyncio.run(_run(quick, server.url, Path(tmp)))


def main() -> None:
    bench_main("Stack builds (build → serving)", run, __doc__, "the Express app too, three warm samples per app")


if __name__ == "__main__":
    main()
