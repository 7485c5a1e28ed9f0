"""The steps of a source build on this node, as functions of what they are given: fetch and unpack the
source, the package managers' environment, the toolchains (Python interpreter, node), run one plan step with
its output streamed as log lines, pack the app layer and its image config. ``builder.py`` orders them."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import io
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from uv import find_uv_bin
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.agent.hostbase import NODE_LABEL
from services.agent.pythonbase import PYTHON_LABEL
from services.agent.sandbox import Confinement, Sandbox, exit_status
from services.agent.sandbox_users import give
from shared.buildlogs import BuildEventPublisher
from shared.buildplan import BuildPlan
from shared.connection import Connection
from shared.errors import ZatteraError
from shared.registry import (
    BlobStore,
    RegistryError,
    digest_of,
)
from shared.subjects import SOURCES_STORE
from shared.subprocesses import start_shell

log = logging.getLogger(__name__)

MAX_CONTEXT_BYTES = 512 * 1024 * 1024


SOURCE_FETCH_TIMEOUT = 600.0


# What the package managers need to reach their registries from this node (proxies, a CA bundle, mirrors).
NETWORK_ENV = (
    *("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"),
    *("SSL_CERT_FILE", "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS"),
    *("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "npm_config_registry"),
)


ERROR_TAIL_LINES = 6


NO_NODE = "builder: node is not installed on this builder (Debian: apt-get install nodejs npm)"


ERROR_TAIL_CHARS = 800


class BuildError(ZatteraError):
    """A build step failed; the message is the build's error."""


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


def pack_directory(src: Path, *, only: str = "", exclude: str = "") -> tuple[bytes, str]:
    """A deterministic gzip'd tar of ``src`` (sorted, zero times and owners) and its uncompressed digest.

    ``only``/``exclude`` name one top-level entry: the dependency layer is ``only=<dir>``, the app layer the
    rest (``exclude=<dir>``)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(src.rglob("*")):
            relative = path.relative_to(src)
            if (only and relative.parts[0] != only) or (exclude and relative.parts[0] == exclude):
                continue
            info = tar.gettarinfo(str(path), arcname=relative.as_posix())
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


# The dependency layer's programs and modules, found from the directory the image is unpacked in (the runtime
# unpacks it under each instance's own directory: no absolute path can be baked in). An entrypoint, so a
# service's own command (which replaces only Cmd) gets them too.
RUN_ENTRYPOINT = [
    "/bin/sh",
    "-c",
    'd="$PWD"; export PATH="$d/.zattera/bin:$d/.zattera/python/bin:$d/node_modules/.bin:$PATH"'
    ' PYTHONPATH="$d/.zattera/python${PYTHONPATH:+:$PYTHONPATH}"; exec "$@"',
    "zattera-run",
]


def image_config(
    platform: str, plan: BuildPlan, diff_ids: Sequence[str], build_id: str, *, python: str = "", node: str = ""
) -> bytes:
    """``python``: the interpreter a Python app (or a static site's server) runs on, label
    ``dev.zattera.python``; ``node``: the ``node`` a Node app runs on, label ``dev.zattera.nodejs``. The docker
    runtime runs the image on a base image made from that program (``hostbase.py``, ``pythonbase.py``)."""
    os_name, _, arch = platform.partition("/")
    labels = {"dev.zattera.build-id": build_id, "dev.zattera.build-provider": plan.provider}
    if python:
        labels[PYTHON_LABEL] = python
    if node:
        labels[NODE_LABEL] = node
    doc = {
        "architecture": arch,
        "os": os_name,
        "config": {
            "Entrypoint": RUN_ENTRYPOINT if plan.dependency_dir else [],
            "Cmd": ["/bin/sh", "-c", plan.start] if plan.start else [],
            "Env": ["PYTHONUNBUFFERED=1", "PYTHONNOUSERSITE=1"] if python else [],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def unpack_layer(layer: bytes, dest: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(layer), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")


def write_interpreter_shims(src: Path, dependency_dir: str, interpreter: str) -> None:
    """``<dependency_dir>/bin/python`` and ``python3`` for the app's commands: the interpreter the packages were
    installed for. Written after the install step ran the app's code, so no path component is followed if
    it is a link (it could point anywhere on the node): such a shim is not written."""
    text = f'#!/bin/sh\nexec {shlex.quote(interpreter)} "$@"\n'.encode()
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    opened: list[int] = []
    try:
        opened.append(os.open(src, flags))
        for part in (*Path(dependency_dir).parts, "bin"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=opened[-1])
            opened.append(os.open(part, flags, dir_fd=opened[-1]))
        for name in ("python", "python3"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=opened[-1])
            creating = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            shim = os.open(name, creating, 0o755, dir_fd=opened[-1])
            try:
                os.write(shim, text)
                os.fchmod(shim, 0o755)
            finally:
                os.close(shim)
    except OSError as exc:
        log.warning("interpreter shims not written in %s/%s: %s", src, dependency_dir, exc)
    finally:
        for fd in opened:
            os.close(fd)


def tool_env(cache_dir: Path) -> dict[str, str]:
    """uv on PATH; the package managers' download caches kept under ``cache_dir``."""
    caches = cache_dir / "downloads"
    return {k: os.environ[k] for k in NETWORK_ENV if k in os.environ} | {
        "PATH": f"{Path(find_uv_bin()).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "UV_CACHE_DIR": str(caches / "uv"),
        "UV_LINK_MODE": "copy",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_PROGRESS": "1",
        "UV_SYSTEM_CERTS": "1",
        # Bytecode compiled at build time, so no instance compiles it at start; hash-checked .pyc files
        # (SOURCE_DATE_EPOCH), as the layer's files carry no modification times.
        "UV_COMPILE_BYTECODE": "1",
        "SOURCE_DATE_EPOCH": "0",  # the node's CA store: a TLS-inspecting proxy's CA is trusted as for pip
        "npm_config_cache": str(caches / "npm"),
        "npm_config_update_notifier": "false",
        "npm_config_fund": "false",
        "npm_config_audit": "false",
        "YARN_CACHE_FOLDER": str(caches / "yarn"),
        "npm_config_store_dir": str(caches / "pnpm"),
    }


async def command_output(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The first line a short command prints, or "" when it fails or is missing."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError:
        return ""
    out, _ = await proc.communicate()
    lines = out.decode(errors="replace").strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else ""


async def interpreter(own: str, request: str, env: Mapping[str, str], events: BuildEventPublisher) -> str:
    """The Python the app asks for when this node has it, else the node's own (the one the agent runs on,
    so every node of the platform has it): ``own``."""
    own_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not request or request == own_version:
        return own
    finder = [find_uv_bin(), "--no-cache", "python", "find", "--system", "--no-project", request]
    found = await command_output(finder, env)
    if found:
        return await asyncio.to_thread(os.path.realpath, found)
    await events.log(f"python {request} is not installed on this builder: using its Python {own_version}")
    return own


async def node_version(env: Mapping[str, str]) -> str:
    version = await command_output(["node", "--version"], env)
    if not version:
        raise BuildError(NO_NODE)
    return version


async def node_path(env: Mapping[str, str]) -> str:
    """The absolute path of the ``node`` the build runs (label ``dev.zattera.nodejs``)."""
    found = shutil.which("node", path=env.get("PATH"))
    if not found:
        raise BuildError(NO_NODE)
    return await asyncio.to_thread(os.path.realpath, found)


async def _fetch_url(url: str) -> bytes:
    import aiohttp  # only a source given by URL needs an HTTP client (PERFORMANCE.md "A lighter node")

    try:
        timeout = aiohttp.ClientTimeout(total=SOURCE_FETCH_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise BuildError(f"fetch source: source fetch: HTTP {response.status}")
            return await response.read()
    except aiohttp.ClientError as exc:
        raise BuildError(f"fetch source: {exc}") from exc


async def fetch_source(conn: Connection, request: cpb.RunBuildRequest) -> bytes:
    url = request.source_url
    try:
        if url.startswith(("http://", "https://")):
            return await _fetch_url(url)
        if url.startswith("sha256:"):
            data = await BlobStore(conn, SOURCES_STORE).get(url)
            if digest_of(data) != url.lower():
                raise BuildError(f"fetch source: content does not match {url}")
            return data
    except (RegistryError, TimeoutError) as exc:
        raise BuildError(f"fetch source: {exc}") from exc
    if request.git.clone_url:
        raise BuildError("fetch source: git sources are not supported by this builder")
    raise BuildError(f"fetch source: unsupported source url {url!r}")


async def run_command(
    command: str,
    cwd: Path,
    env: Mapping[str, str],
    events: BuildEventPublisher,
    *,
    step: str,
    keepalive: float,
    sandbox: Sandbox | None = None,
    confinement: Confinement | None = None,
) -> None:
    """Run one plan step (sandboxed when ``confinement`` is given), its output streamed as log lines; a
    failure's error ends with the last lines it printed (the package manager's own message), so the deploy
    output shows why."""
    await events.log(f"$ {command}")
    if confinement is not None and sandbox is not None:
        # What the builder wrote since (the source, generated files, a cached layer) becomes the step's.
        await asyncio.to_thread(give, cwd, confinement.uid, whole=True)
        wrapped = sandbox.wrap(confinement, ["/bin/sh", "-c", command], env)
        try:
            proc = await asyncio.create_subprocess_exec(
                *wrapped.argv,
                cwd=cwd,
                env=wrapped.env,
                pass_fds=wrapped.fds,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # cancelling kills its whole group, the sandbox with it
            )
        finally:
            wrapped.close()
    else:
        proc = await start_shell(
            command,
            cwd=cwd,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            own_session=True,  # cancelling kills its whole group
        )
    assert proc.stdout is not None
    last_lines: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
    try:
        silent_for = 0.0
        while True:
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), keepalive)
            except TimeoutError:
                silent_for += keepalive
                await events.log(f"… still building ({silent_for:.0f}s without output)")
                continue
            if not line:
                break
            silent_for = 0.0
            text = line.decode(errors="replace").rstrip("\r\n")
            if text:
                await events.log(text)
                last_lines.append(" ".join(text.split()))
        code = exit_status(await proc.wait()) if confinement is not None else await proc.wait()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    if code != 0:
        said = " / ".join(line for line in last_lines if line)[-ERROR_TAIL_CHARS:]
        raise BuildError(f"builder: {step} command exited with code {code}" + (f": {said}" if said else ""))
