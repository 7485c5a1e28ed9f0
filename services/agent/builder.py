"""Source builds on this node (``--builder``): the builder side of ``shared/buildlogs.py``'s contract.

* ``zattera.agent.<node>.build`` carries a ``RunBuildRequest``. The reply comes at once: empty = accepted,
  header ``Zattera-Error`` = refused (undecodable request, no build id, or one that is not a safe path
  component: it names the build's scratch directory). A request for a build already
  running here, or among the last ``FINISHED_REMEMBERED`` finished here, is accepted again without starting
  it twice (a dispatcher resending a request whose reply was lost with a NATS server).
* The build then streams ``BuildEvent``\\ s on ``zattera.builds.<build_id>.events`` with
  :class:`BuildEventPublisher`: log lines, the success event (digest + platforms) and ``done``, or one
  ``failed`` event (which ends the stream). The dispatcher copies the lines into the build log stream.
* ``zattera.agent.<node>.build.cancel`` (``CancelBuildRequest``) cancels a running build and answers
  ``CancelBuildResponse{canceled}``.

Steps (reference §4.1–4.2, for the process runtime instead of BuildKit):

1. Fetch the source tarball: ``source_url`` is an object name ``sha256:<hex>`` in ``zattera-sources``
   (checked against its digest) or an ``http(s)://`` URL. Errors: ``fetch source: …``.
2. Unpack it into a scratch directory (entries escaping it, devices and links out of it are refused;
   more than 512 MiB declared → error).
3. The build recipe, from the source: ``zattera.toml`` ``[build] command`` (or ``[app.build] command``), run
   with ``/bin/sh -c`` in the source directory, its output streamed as log lines (``build_env`` and
   ``build_args`` become its environment); the start command from ``zattera.toml`` ``[run] command`` or a
   ``Procfile`` ``web:`` line (optional: ``ServiceSpec.command`` can give it at run time).
4. Pack the directory as one deterministic gzip'd tar layer with an OCI image config (``Cmd`` =
   ``sh -c <start command>``, ``WorkingDir`` = ``/``): the format ``images.py`` runs. Push it with
   ``shared.registry.push_image`` under ``push_image_ref``'s repo and tag, one manifest per requested
   platform (default: this node's), all sharing the layer: the process image is platform-neutral.
5. Report the digest (``succeeded``) and ``done``.

A step silent for ``keepalive`` seconds logs a line, so the dispatcher does not take the builder for lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import logging
import os
import shutil
import signal
import tarfile
import tomllib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.buildlogs import ERROR_HEADER, BuildEventPublisher, cancel_build_subject, run_build_subject
from shared.ids import is_safe_id, unsafe_id
from shared.natsio import SOURCES_STORE, Connection, is_direct_request
from shared.registry import BlobStore, PlatformImage, RegistryError, digest_of, parse_ref, push_image
from shared.tasks import cancel_and_wait
from shared.telemetry import span

log = logging.getLogger(__name__)

MAX_CONTEXT_BYTES = 512 * 1024 * 1024
SOURCE_FETCH_TIMEOUT = 600.0
FINISHED_REMEMBERED = 256
"""Finished build ids kept to recognise a resent RunBuild (a build id is never dispatched again)."""
PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")


class BuildError(Exception):
    """A build step failed; the message is the build's error."""


@dataclass(frozen=True)
class Recipe:
    build_command: str = ""
    start_command: str = ""


def _lookup(doc: Mapping[str, Any], *path: str) -> str:
    node: Any = doc
    for part in path:
        if not isinstance(node, Mapping):
            return ""
        node = node.get(part)
    return node if isinstance(node, str) else ""


def read_recipe(src: Path) -> Recipe:
    build = start = ""
    manifest = src / "zattera.toml"
    if manifest.is_file():
        try:
            doc = tomllib.loads(manifest.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise BuildError(f"builder: zattera.toml: {exc}") from exc
        build = _lookup(doc, "build", "command") or _lookup(doc, "app", "build", "command")
        start = _lookup(doc, "run", "command")
    procfile = src / "Procfile"
    if not start and procfile.is_file():
        for line in procfile.read_text(errors="replace").splitlines():
            if line.startswith("web:"):
                start = line[len("web:") :].strip()
                break
    return Recipe(build_command=build.strip(), start_command=start)


def unpack_source(data: bytes, dest: Path) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = tar.getmembers()
            if sum(m.size for m in members if m.isfile()) > MAX_CONTEXT_BYTES:
                raise BuildError(f"builder: context exceeds {MAX_CONTEXT_BYTES} bytes")
            tar.extractall(dest, members=members, filter="data")
    except tarfile.FilterError as exc:
        raise BuildError(f"builder: unsafe path in context: {exc}") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BuildError(f"builder: tar: {exc}") from exc


def pack_directory(src: Path) -> tuple[bytes, str]:
    """A deterministic gzip'd tar of ``src`` (sorted, zero times and owners) and its uncompressed digest."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(src).as_posix())
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isfile():
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)
            elif info.isdir() or info.issym():
                tar.addfile(info)
    data = raw.getvalue()
    return gzip.compress(data, mtime=0), digest_of(data)


def image_config(platform: str, recipe: Recipe, diff_id: str, build_id: str) -> bytes:
    os_name, _, arch = platform.partition("/")
    doc = {
        "architecture": arch,
        "os": os_name,
        "config": {
            "Cmd": ["/bin/sh", "-c", recipe.start_command] if recipe.start_command else [],
            "Env": [],
            "WorkingDir": "/",
            "Labels": {"dev.zattera.build-id": build_id},
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class Builder:
    def __init__(
        self, conn: Connection, node_id: str, work_dir: Path, *, os_arch: str, keepalive: float = 60.0
    ) -> None:
        self.conn = conn
        self.node_id = node_id
        self.work_dir = work_dir
        self.os_arch = os_arch
        self.keepalive = keepalive
        self._builds: dict[str, asyncio.Task[None]] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._stopping: set[asyncio.Task[None]] = set()
        self.ready = asyncio.Event()
        """Set once the build subjects are subscribed."""

    async def serve(self) -> None:
        nc = self.conn.nc
        subs = [
            await nc.subscribe(run_build_subject(self.node_id), cb=self._on_request),
            await nc.subscribe(cancel_build_subject(self.node_id), cb=self._on_cancel),
        ]
        await nc.flush()
        self.ready.set()
        try:
            await asyncio.Event().wait()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            builds = list(self._builds.values())
            for task in builds:
                task.cancel()
            await asyncio.gather(*builds, return_exceptions=True)

    async def _refuse(self, msg: Msg, why: str) -> None:
        if msg.reply:
            await self.conn.nc.publish(msg.reply, b"", headers={ERROR_HEADER: why})

    async def _on_request(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            log.warning("ignored a build message that is not a direct request (reply %r)", msg.reply)
            return
        try:
            request = cpb.RunBuildRequest.FromString(msg.data)
        except DecodeError as exc:
            await self._refuse(msg, f"bad request: {exc}")
            return
        build_id = request.build.meta.id
        if not build_id:
            await self._refuse(msg, "bad request: no build id")
            return
        if not is_safe_id(build_id):  # it names the scratch directory, removed after the build
            await self._refuse(msg, f"bad request: {unsafe_id('build id', build_id)}")
            return
        if build_id not in self._builds and build_id not in self._finished:
            task = asyncio.create_task(self._run(request, msg.headers), name=f"build:{build_id}")
            self._builds[build_id] = task
            task.add_done_callback(lambda _: self._remember_finished(build_id))
        if msg.reply:
            await msg.respond(b"")

    def _remember_finished(self, build_id: str) -> None:
        self._builds.pop(build_id, None)
        self._finished[build_id] = None
        while len(self._finished) > FINISHED_REMEMBERED:
            self._finished.popitem(last=False)

    async def _on_cancel(self, msg: Msg) -> None:
        if not is_direct_request(msg):
            log.warning("ignored a build cancel that is not a direct request (reply %r)", msg.reply)
            return
        try:
            build_id = cpb.CancelBuildRequest.FromString(msg.data).build_id
        except DecodeError:
            build_id = ""
        task = self._builds.get(build_id)
        if task is not None:
            # Not a bare task.cancel(): a cancellation landing while the build awaits an event's publish ack
            # is swallowed by nats-py, and the build ran on to the end. cancel_and_wait cancels again.
            stopper = asyncio.create_task(cancel_and_wait(task))
            self._stopping.add(stopper)
            stopper.add_done_callback(self._stopping.discard)
        if msg.reply:
            await msg.respond(cpb.CancelBuildResponse(canceled=task is not None).SerializeToString())

    async def _run(self, request: cpb.RunBuildRequest, headers: Mapping[str, str] | None = None) -> None:
        build_id = request.build.meta.id
        events = BuildEventPublisher(self.conn, build_id)
        scratch = self.work_dir / build_id
        try:
            # A child of the dispatcher's request (its traceparent header), so the build joins the deploy's trace.
            with span("agent.build", headers=headers or None, build_id=build_id, node_id=self.node_id):
                digest, platforms = await self._build(request, events, scratch)
            await events.succeeded(digest, platforms)
            await events.done()
            log.info("build %s: pushed %s", build_id, digest)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(events.failed("build canceled"))
            raise
        except BuildError as exc:
            log.info("build %s failed: %s", build_id, exc)
            await events.failed(str(exc))
        except Exception as exc:
            log.exception("build %s failed", build_id)
            await events.failed(f"builder: {type(exc).__name__}: {exc}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def _build(
        self, request: cpb.RunBuildRequest, events: BuildEventPublisher, scratch: Path
    ) -> tuple[str, list[str]]:
        build = request.build
        await events.log(f"fetching source {request.source_url or request.git.clone_url}")
        source = await self._fetch_source(request)
        src = scratch / "src"
        shutil.rmtree(scratch, ignore_errors=True)
        src.mkdir(parents=True)
        await asyncio.to_thread(unpack_source, source, src)
        recipe = read_recipe(src)
        if recipe.build_command:
            env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
            env.update(request.build_args)
            env.update(request.build_env)
            env["ZATTERA_BUILD_ID"] = build.meta.id
            await self._run_command(recipe.build_command, src, env, events)
        else:
            await events.log("no build command: packing the source as is")
        layer, diff_id = await asyncio.to_thread(pack_directory, src)
        platforms = sorted(set(build.platforms)) or [self.os_arch]
        ref = parse_ref(request.push_image_ref)
        if not ref.repo:
            raise BuildError("builder: the request has no image ref to push to")
        await events.log(f"pushing {ref.repo}:{ref.tag or build.meta.id.lower()} ({len(layer)} bytes)")
        try:
            image = await push_image(
                self.conn,
                repo=ref.repo,
                tag=ref.tag or build.meta.id.lower(),
                images=[PlatformImage(p, image_config(p, recipe, diff_id, build.meta.id), [layer]) for p in platforms],
                build_id=build.meta.id,
            )
        except RegistryError as exc:
            raise BuildError(f"builder: push: {exc}") from exc
        return image.digest, platforms

    async def _fetch_source(self, request: cpb.RunBuildRequest) -> bytes:
        url = request.source_url
        try:
            if url.startswith(("http://", "https://")):
                timeout = aiohttp.ClientTimeout(total=SOURCE_FETCH_TIMEOUT)
                async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
                    if response.status != 200:
                        raise BuildError(f"fetch source: source fetch: HTTP {response.status}")
                    return await response.read()
            if url.startswith("sha256:"):
                data = await BlobStore(self.conn, SOURCES_STORE).get(url)
                if digest_of(data) != url.lower():
                    raise BuildError(f"fetch source: content does not match {url}")
                return data
        except (RegistryError, aiohttp.ClientError, TimeoutError) as exc:
            raise BuildError(f"fetch source: {exc}") from exc
        if request.git.clone_url:
            raise BuildError("fetch source: git sources are not supported by this builder")
        raise BuildError(f"fetch source: unsupported source url {url!r}")

    async def _run_command(self, command: str, cwd: Path, env: Mapping[str, str], events: BuildEventPublisher) -> None:
        await events.log(f"$ {command}")
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            silent_for = 0.0
            while True:
                try:
                    line = await asyncio.wait_for(proc.stdout.readline(), self.keepalive)
                except TimeoutError:
                    silent_for += self.keepalive
                    await events.log(f"… still building ({silent_for:.0f}s without output)")
                    continue
                if not line:
                    break
                silent_for = 0.0
                text = line.decode(errors="replace").rstrip("\r\n")
                if text:
                    await events.log(text)
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        if code != 0:
            raise BuildError(f"builder: build command exited with code {code}")
