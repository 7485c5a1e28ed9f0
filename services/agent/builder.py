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

Steps (for the process runtime, without BuildKit):

1. Fetch the source tarball: ``source_url`` is an object name ``sha256:<hex>`` in ``zattera-sources``
   (checked against its digest) or an ``http(s)://`` URL. Errors: ``fetch source: …``.
2. Unpack it into a scratch directory (entries escaping it, devices and links out of it are refused;
   more than 512 MiB declared → error).
3. The plan (``shared/buildplan.py``): the stack detected from the source, with ``zattera.toml`` ``[build]
   install``/``command`` and ``[run] command`` and the ``Procfile`` ``web:`` line overriding its steps. Its
   lines open the build log; a plan with an error (no start command, a Dockerfile) fails the build.
4. The install step (Python: ``uv pip install --target .zattera/python``; Node: ``npm ci`` or the lockfile's
   tool) writes the dependency layer, or it comes from the cache (``depcache.py``: this builder's, else the
   cluster registry's ``<repo>:deps-<key>``); then the build step. Steps run with ``/bin/sh -c`` in the
   source directory, their output streamed as log lines (``build_env`` and ``build_args`` become their
   environment, plus the node's proxy/CA settings and the package managers' per-node download caches).
5. Pack the rest of the directory as the app layer (deterministic gzip'd tar) with an OCI image config
   (``Entrypoint`` putting the dependency layer on ``PATH``/``PYTHONPATH``, ``Cmd`` = ``sh -c <start>``,
   ``WorkingDir`` = ``/``): the format ``images.py`` runs. Push it with ``shared.registry.push_image`` under
   ``push_image_ref``'s repo and tag, one manifest per requested platform (default: this node's).
6. Report the digest (``succeeded``) and ``done``.

A ``BUILD_TYPE_DOCKERFILE`` build (the build's type or the app's ``BuildConfig.type``) replaces steps 3-4:
the node's Docker daemon builds ``BuildConfig.dockerfile`` in ``BuildConfig.context_dir`` with the
``build_args``, its output streamed as log lines, and the resulting image (its whole root filesystem) is
pushed for this node's platform (``dockerbuild.py``).

A step silent for ``keepalive`` seconds logs a line, so the dispatcher does not take the builder for lost.

On a node that sandboxes (``sandbox.py``) the install and build steps — the app's own code: setup scripts,
npm lifecycle scripts — run in a sandbox as the app's build user (``build:<repo>`` in the node's uid table),
seeing only the build's scratch directory and that app's download caches and dependency layers (kept per
app, so no app's build can plant files in another's), and die with the agent. What the builder itself writes
after a step never follows a link the step may have planted.

The steps themselves (fetching and unpacking the source, running a command, the toolchains, packing the
image) are ``build_steps.py``'s; this module is the build request's handling and the build's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.agent.build_steps import (
    BuildError,
    fetch_source,
    image_config,
    interpreter,
    node_path,
    node_version,
    pack_directory,
    run_command,
    tool_env,
    unpack_layer,
    unpack_source,
    write_interpreter_shims,
)
from services.agent.depcache import LayerCache, cache_tag, dependency_key
from services.agent.dockerbuild import DEFAULT_DOCKERFILE, DockerBuildError, build_context_dir, build_dockerfile
from services.agent.sandbox import Confinement, Sandbox
from services.agent.sandbox_users import give
from shared.buildlogs import ERROR_HEADER, BuildEventPublisher, cancel_build_subject, run_build_subject
from shared.buildplan import BuildPlan, PlanError, build_problem, detect, read_source, starts_python
from shared.connection import Connection
from shared.ids import is_safe_id, unsafe_id
from shared.registry import (
    PlatformImage,
    RegistryError,
    fetch_image,
    lookup_tag,
    parse_ref,
    push_image,
)
from shared.subjects import is_direct_request
from shared.tasks import cancel_and_wait
from shared.telemetry import span

log = logging.getLogger(__name__)


FINISHED_REMEMBERED = 256
"""Finished build ids kept to recognise a resent RunBuild (a build id is never dispatched again)."""


PASSED_THROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")


@dataclass(eq=False)
class Builder:
    conn: Connection
    node_id: str
    work_dir: Path
    _: KW_ONLY
    os_arch: str
    keepalive: float = 60.0
    cache_dir: Path | None = None
    """Where the caches are kept across builds and restarts (:attr:`cache_root`)."""
    docker_host: str = ""
    sandbox: Sandbox | None = None

    def __post_init__(self) -> None:
        self.cache_root = self.cache_dir or self.work_dir.with_name(f"{self.work_dir.name}-cache")
        """``cache_dir``, else ``<work_dir>-cache``: beside the scratch directories (named by build ids)."""
        self.layers = LayerCache(self.cache_root / "layers")
        self.node_python = os.path.realpath(sys.executable)
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
        events = BuildEventPublisher(self.conn, build_id, self.node_id)
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
        source = await fetch_source(self.conn, request)
        src = scratch / "src"
        shutil.rmtree(scratch, ignore_errors=True)
        src.mkdir(parents=True)
        await asyncio.to_thread(unpack_source, source, src)
        if build.type == pb.BUILD_TYPE_DOCKERFILE or request.build_config.type == pb.BUILD_TYPE_DOCKERFILE:
            return await self._build_dockerfile(request, events, src)
        try:
            plan = detect(read_source(src))
        except PlanError as exc:
            raise BuildError(f"builder: {exc}") from exc
        if plan.provider == "dockerfile" and self.docker_host:
            await events.log("plan: a Dockerfile build on this builder's Docker daemon (docs/containers.md)")
            return await self._build_dockerfile(request, events, src)
        for line in plan.lines():
            await events.log(line)
        if problem := build_problem(plan, docker=bool(self.docker_host)):
            raise BuildError(f"builder: {problem}")
        ref = parse_ref(request.push_image_ref)
        if not ref.repo:
            raise BuildError("builder: the request has no image ref to push to")
        env = {k: os.environ[k] for k in PASSED_THROUGH_ENV if k in os.environ}
        env.update(request.build_args)
        env.update(request.build_env)
        env["ZATTERA_BUILD_ID"] = build.meta.id
        confinement = self._confinement(ref.repo, scratch, src)
        env.update(tool_env(self._caches(ref.repo)))
        python = await interpreter(self.node_python, plan.python, env, events) if plan.provider == "python" else ""
        if python:
            env["UV_PYTHON"] = python
        if plan.provider == "static":  # python3 -m http.server: the node's own interpreter
            python = self.node_python
        elif plan.provider in ("none", "procfile") and starts_python(plan.start):
            python = self.node_python  # as is, started with python3: runs on the node's interpreter (docker too)
            await events.log(f"plan: python   {python} (the start command runs Python: the builder's interpreter)")
        node = await node_path(env) if plan.provider == "node" else ""
        layers: list[tuple[bytes, str]] = []
        if plan.dependency_dir and plan.install:
            layers.append(await self._dependency_layer(plan, src, env, events, ref.repo, confinement))
        if plan.build:
            await self._run_step("build", plan.build, src, env, events, confinement)
        elif not layers:
            await events.log("no install or build step: packing the source as is")
        # Without a dependency layer (install skipped), a committed node_modules stays in the app layer.
        app_exclude = plan.dependency_dir if layers else ""
        layers.append(await asyncio.to_thread(pack_directory, src, exclude=app_exclude))
        platforms = sorted(set(build.platforms)) or [self.os_arch]
        diff_ids = [diff_id for _, diff_id in layers]
        images = [
            PlatformImage(
                p,
                image_config(p, plan, diff_ids, build.meta.id, python=python, node=node),
                [layer for layer, _ in layers],
            )
            for p in platforms
        ]
        return await self._push(request, events, images)

    async def _push(
        self, request: cpb.RunBuildRequest, events: BuildEventPublisher, images: list[PlatformImage]
    ) -> tuple[str, list[str]]:
        build = request.build
        ref = parse_ref(request.push_image_ref)
        if not ref.repo:
            raise BuildError("builder: the request has no image ref to push to")
        size = sum(len(layer) for image in images for layer in image.layers)
        layers = len(images[0].layers)
        await events.log(f"pushing {ref.repo}:{ref.tag or build.meta.id.lower()} ({layers} layers, {size} bytes)")
        try:
            image = await push_image(
                self.conn, repo=ref.repo, tag=ref.tag or build.meta.id.lower(), images=images, build_id=build.meta.id
            )
        except RegistryError as exc:
            raise BuildError(f"builder: push: {exc}") from exc
        return image.digest, [i.platform for i in images]

    async def _build_dockerfile(
        self, request: cpb.RunBuildRequest, events: BuildEventPublisher, src: Path
    ) -> tuple[str, list[str]]:
        """A Dockerfile build through this node's Docker daemon (``dockerbuild.py``): one platform, this
        node's."""
        config = request.build_config
        try:
            context_dir = build_context_dir(src, config.context_dir)
            layer, _ = await asyncio.to_thread(pack_directory, context_dir)
            await events.log(f"docker build ({config.dockerfile or DEFAULT_DOCKERFILE} in {config.context_dir or '.'})")
            built = await build_dockerfile(
                self.docker_host,
                layer,
                tag=f"zattera-build/{request.build.meta.id.lower()}",
                dockerfile=config.dockerfile,
                build_args=request.build_args,
                log=events.log,
                platform=self.os_arch,
            )
        except DockerBuildError as exc:
            raise BuildError(f"builder: {exc}") from exc
        return await self._push(request, events, [PlatformImage(built.platform, built.config, built.layers)])

    def _caches(self, repo: str) -> Path:
        """Where the builds of ``repo`` keep downloads and dependency layers: one place for every app, unless
        sandboxed (then each app its own: a build could plant files in a shared cache)."""
        if self.sandbox is None:
            return self.cache_root
        name = repo.replace("/", "--")
        if not is_safe_id(name.replace(".", "_")) or name.strip(".-") == "":
            raise BuildError(f"builder: {repo!r} cannot name a cache directory")
        return self.cache_root / "apps" / name

    def _confinement(self, repo: str, scratch: Path, src: Path) -> Confinement | None:
        """The sandbox of this build's steps (None: they run as the agent's user)."""
        if self.sandbox is None:
            return None
        caches = self._caches(repo)
        for directory in (caches / "downloads", scratch / "home"):
            directory.mkdir(parents=True, exist_ok=True)
        uid = self.sandbox.uid(f"build:{repo}")
        give(caches / "downloads", uid)
        give(scratch / "home", uid)
        return Confinement(
            uid=uid,
            workdir=src,
            writable=(src, scratch / "home", caches / "downloads"),
            home=scratch / "home",
            die_with_parent=True,
        )

    async def _run_step(
        self,
        step: str,
        command: str,
        src: Path,
        env: Mapping[str, str],
        events: BuildEventPublisher,
        confinement: Confinement | None,
    ) -> None:
        """Run the plan's ``step`` (``command``) in ``src``, in the build's sandbox when it has one."""
        await run_command(
            command,
            src,
            env,
            events,
            step=step,
            keepalive=self.keepalive,
            sandbox=self.sandbox,
            confinement=confinement,
        )

    async def _dependency_layer(
        self,
        plan: BuildPlan,
        src: Path,
        env: dict[str, str],
        events: BuildEventPublisher,
        repo: str,
        confinement: Confinement | None = None,
    ) -> tuple[bytes, str]:
        """The layer holding what ``plan.install`` writes: from this builder's cache, else the registry's, else
        installed (with the package managers' download caches of this node) and cached in both."""
        deps = src / plan.dependency_dir
        shutil.rmtree(deps, ignore_errors=True)  # a committed node_modules or .zattera is replaced
        for name, text in plan.generated.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(text)
        platform = self.os_arch
        if plan.provider == "python":
            platform += f" {env['UV_PYTHON']}"
        elif plan.provider == "node":
            platform += f" node {await node_version(env)}"
        key = await asyncio.to_thread(dependency_key, plan, src, platform)
        layers = self.layers if self.sandbox is None else LayerCache(self._caches(repo) / "layers")
        cached = await asyncio.to_thread(layers.get, key)
        if cached is not None:
            await events.log(f"dependencies: cached layer {key[:12]} (this builder)")
            if await lookup_tag(self.conn, repo, cache_tag(key)) is None:  # a registry reset, or another repo
                await self._push_cached_layer(repo, key, cached, events)
        else:
            cached = await self._registry_layer(repo, key)
            if cached is not None:
                await events.log(f"dependencies: cached layer {key[:12]} (cluster registry)")
                await asyncio.to_thread(layers.put, key, *cached)
        if cached is not None:
            if plan.build:  # the build step may need them (npm run build)
                await asyncio.to_thread(unpack_layer, cached[0], src)
            return cached
        await self._run_step("install", plan.install, src, env, events, confinement)
        if plan.provider == "python":
            write_interpreter_shims(src, plan.dependency_dir, env["UV_PYTHON"])
        layer = await asyncio.to_thread(pack_directory, src, only=plan.dependency_dir)
        await asyncio.to_thread(layers.put, key, *layer)
        await self._push_cached_layer(repo, key, layer, events)
        return layer

    async def _registry_layer(self, repo: str, key: str) -> tuple[bytes, str] | None:
        try:
            image = await fetch_image(self.conn, f"{repo}:{cache_tag(key)}", platform=self.os_arch)
            diff_ids = json.loads(image.config)["rootfs"]["diff_ids"]
            return image.layers[0], str(diff_ids[0])
        except (RegistryError, ValueError, KeyError, IndexError):
            return None

    async def _push_cached_layer(
        self, repo: str, key: str, layer: tuple[bytes, str], events: BuildEventPublisher
    ) -> None:
        config = json.dumps(
            {"os": "", "architecture": "", "config": {}, "rootfs": {"type": "layers", "diff_ids": [layer[1]]}},
            sort_keys=True,
        ).encode()
        try:
            await push_image(
                self.conn, repo=repo, tag=cache_tag(key), images=[PlatformImage(self.os_arch, config, [layer[0]])]
            )
        except RegistryError as exc:  # only a cache: the build goes on
            await events.log(f"dependencies: not cached in the registry: {exc}")
