"""Image artifacts for the process runtime: what an assignment runs, and from which directory.

Image refs the agent understands:

* **A registry ref** (``<project>/<app>:<tag>`` or ``<project>/<app>@sha256:<hex>``, an optional registry
  host is ignored): an image in the object-store registry (``shared/registry.py``). Its config is an OCI
  image config, of which the process runtime reads ``config.Entrypoint``, ``config.Cmd``, ``config.Env``
  (``["K=V", ...]``) and ``config.WorkingDir``; its layers are gzip'd tars applied in order into
  ``<instance>/rootfs``. There is no chroot: ``WorkingDir`` is taken relative to that rootfs and the
  command runs there. The agent's builder produces exactly this (the app directory; for a Python or Node app a
  dependency layer first).
* ``process://<absolute dir>?cmd=<percent-encoded shell command>`` (local development and tests): run the
  command in that directory as it is; nothing is copied.
* ``exec:<percent-encoded shell command>``: run the command in an empty directory of the instance.

Refs are percent-encoded because the deploy API refuses whitespace in an image ref. ``ServiceSpec.command``
(shell form), when set, replaces the image's ``Cmd`` (the entrypoint stays), as with Docker.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.files import write_atomic
from shared.registry import RegistryError, fetch_image

PROCESS_SCHEME = "process://"
EXEC_SCHEME = "exec:"
SHELL = "/bin/sh"
_MARKER = "image.json"


class ImageError(ZatteraError):
    """The image cannot be resolved, fetched or unpacked (counts as a failed start)."""


@dataclass(frozen=True)
class PreparedImage:
    """An image ready to run: its directory, command and environment."""

    ref: str
    workdir: Path
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def command(self, override: str = "") -> list[str]:
        """Entrypoint + Cmd, or entrypoint + ``sh -c <override>`` when the service sets a command."""
        if override:
            return [*self.entrypoint, SHELL, "-c", override]
        return [*self.entrypoint, *self.cmd]


def shell_command(text: str) -> list[str]:
    return [SHELL, "-c", text]


def _local_image(ref: str, instance_dir: Path) -> PreparedImage | None:
    if ref.startswith(PROCESS_SCHEME):
        parts = urlsplit(ref)
        directory = Path(unquote(parts.path))
        if not directory.is_absolute() or not directory.is_dir():
            raise ImageError(f"{ref}: {directory} is not an existing absolute directory")
        commands = parse_qs(parts.query).get("cmd", [])
        return PreparedImage(ref, directory, cmd=shell_command(commands[0]) if commands else [])
    if ref.startswith(EXEC_SCHEME):
        command = unquote(ref[len(EXEC_SCHEME) :])
        if not command.strip():
            raise ImageError(f"{ref}: empty command")
        workdir = instance_dir / "rootfs"
        workdir.mkdir(parents=True, exist_ok=True)
        return PreparedImage(ref, workdir, cmd=shell_command(command))
    return None


def _parse_config(ref: str, rootfs: Path, config: bytes) -> PreparedImage:
    try:
        doc = json.loads(config or b"{}")
        run = doc.get("config") or {}
        env = dict(item.split("=", 1) for item in run.get("Env") or [] if "=" in item)
        workdir = (rootfs / str(run.get("WorkingDir") or "").lstrip("/")).resolve()
        if workdir != rootfs.resolve() and rootfs.resolve() not in workdir.parents:
            raise ImageError(f"{ref}: WorkingDir {run.get('WorkingDir')!r} leaves the image's root filesystem")
        return PreparedImage(
            ref,
            workdir,
            entrypoint=[str(x) for x in run.get("Entrypoint") or []],
            cmd=[str(x) for x in run.get("Cmd") or []],
            env=env,
        )
    except (ValueError, TypeError, AttributeError) as exc:
        raise ImageError(f"{ref}: bad image config: {exc}") from exc


def unpack_layers(layers: Sequence[bytes], rootfs: Path) -> None:
    """Apply gzip'd tar layers in order; entries escaping the rootfs, devices and the like are refused."""
    for layer in layers:
        try:
            with tarfile.open(fileobj=io.BytesIO(layer), mode="r:*") as tar:
                tar.extractall(rootfs, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise ImageError(f"unpacking a layer: {exc}") from exc


async def prepare_image(conn: Connection, ref: str, instance_dir: Path, *, platform: str = "") -> PreparedImage:
    """Resolve ``ref`` and make its files available under ``instance_dir`` (kept across restarts)."""
    if not ref:
        raise ImageError("the release has no image yet")
    local = _local_image(ref, instance_dir)
    if local is not None:
        return local
    rootfs = instance_dir / "rootfs"
    marker = instance_dir / _MARKER
    try:
        stored = json.loads(marker.read_text())
        if stored.get("ref") == ref:
            return _parse_config(ref, rootfs, stored["config"].encode())
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    try:
        image = await fetch_image(conn, ref, platform=platform)
    except (RegistryError, KeyError, ValueError) as exc:
        raise ImageError(f"{ref}: {exc}") from exc
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.mkdir(parents=True)
    unpack_layers(image.layers, rootfs)
    prepared = _parse_config(ref, rootfs, image.config)
    write_atomic(marker, json.dumps({"ref": ref, "digest": image.digest, "config": image.config.decode()}))
    return prepared
