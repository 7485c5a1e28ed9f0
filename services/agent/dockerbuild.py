"""Dockerfile builds on a builder node, through its Docker daemon (``BUILD_TYPE_DOCKERFILE``).

The build context is ``BuildConfig.context_dir`` of the unpacked source (default: its root; it may not
leave the source), the Dockerfile ``BuildConfig.dockerfile`` relative to that context (default
``Dockerfile``), ``build_args`` become ``--build-arg``\\ s. The daemon's output is streamed line by line as
build log lines; the image is then exported (``docker save``), read into an OCI config and layers
(``shared.imagearchive``) for the cluster registry, and removed from the daemon.
"""

from __future__ import annotations

import io
import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from services.agent.runtime_choice import docker_url
from shared.errors import ZatteraError
from shared.imagearchive import ArchiveImage, ImageArchiveError, read_image_archive

DEFAULT_DOCKERFILE = "Dockerfile"


class DockerBuildError(ZatteraError):
    """The context is unusable, the daemon is unreachable or the Dockerfile failed (one line)."""


def build_context_dir(src: Path, context_dir: str) -> Path:
    """``context_dir`` inside ``src``; refuses one that leaves it or does not exist."""
    context = (src / context_dir.strip("/")).resolve() if context_dir else src.resolve()
    if not context.is_relative_to(src.resolve()):
        raise DockerBuildError(f"context_dir {context_dir!r} leaves the source")
    if not context.is_dir():
        raise DockerBuildError(f"context_dir {context_dir!r} is not a directory of the source")
    return context


def _log_lines(chunk: Mapping[str, object]) -> list[str]:
    text = str(chunk.get("stream") or chunk.get("status") or "")
    return [line for line in text.splitlines() if line.strip()]


async def build_dockerfile(
    docker_host: str,
    context: bytes,
    *,
    tag: str,
    dockerfile: str,
    build_args: Mapping[str, str],
    log: Callable[[str], Awaitable[None]],
    platform: str,
) -> ArchiveImage:
    """Build ``context`` (a gzip'd tar), streaming the daemon's output to ``log``; the image as the registry
    stores it."""
    import aiodocker  # only a Dockerfile build needs the Docker client (PERFORMANCE.md "A lighter node")

    docker = aiodocker.Docker(url=docker_url(docker_host))
    try:
        try:
            async for chunk in docker.images.build(
                fileobj=io.BytesIO(context),
                encoding="gzip",
                tag=tag,
                path_dockerfile=dockerfile or DEFAULT_DOCKERFILE,
                buildargs=dict(build_args) or None,
                rm=True,
                forcerm=True,
                stream=True,
            ):
                for line in _log_lines(chunk):
                    await log(line)
            async with docker.images.export_image(tag) as exported:
                archive = await exported.read()
        except aiodocker.DockerError as exc:
            raise DockerBuildError(f"docker build: {_one_line(exc.message)}") from exc
        except OSError as exc:
            raise DockerBuildError(f"docker build: no Docker daemon at {docker_url(docker_host)}: {exc}") from exc
        finally:
            try:
                await docker.images.delete(tag, force=True)
            except (aiodocker.DockerError, OSError):
                pass  # never built, or the daemon is gone
        try:
            return read_image_archive(archive, platform=platform)
        except ImageArchiveError as exc:
            raise DockerBuildError(f"docker build: the exported image: {exc}") from exc
    finally:
        await docker.close()


def _one_line(message: object) -> str:
    text = message if isinstance(message, str) else json.dumps(message)
    return " ".join(text.split())
