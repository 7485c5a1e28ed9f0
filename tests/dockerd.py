"""A private Docker daemon for tests and benchmarks, and the tiny base image its containers run on.

The daemon runs with the flags our machines allow (no iptables, no bridge, vfs storage) and its own data
root, exec root and socket under a temporary directory, so it never touches a daemon the machine may run.
The networks made on it (the agent's ``zattera`` bridge, a compose project's) take their subnets from a pool
of its own (:data:`ADDRESS_POOL`) and are removed with it: a daemon that stops leaves its bridges in the
kernel, and enough of them (one or two per test session) take every default pool, after which no daemon of
the machine can make a network.
No image registry is reachable: the base image is ``docker import``ed from a root filesystem holding the
static busybox of Debian's ``busybox-static`` (a shell, ``httpd``, ``nc``), ``/etc/passwd`` with
``nobody`` and a world-writable ``/tmp``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiodocker

from services.agent.docker_images import build_context

T = TypeVar("T")

BASE_IMAGE = "zattera/base:latest"
BUSYBOX = Path("/bin/busybox")
APPLETS = (
    "sh",
    "httpd",
    "nc",
    "cat",
    "ls",
    "sleep",
    "ps",
    "id",
    "echo",
    "mkdir",
    "dd",
    "head",
    "tr",
    "grep",
    "wc",
    "wget",
)
_START_TIMEOUT = 60.0
ADDRESS_POOL = "10.213.0.0/16"
"""Where the private daemons' networks get their /24s (docker's defaults, 172.17-31/16 and 192.168/16, are
also the machine's own daemon's)."""


class DockerUnavailableForTests(Exception):
    """dockerd or busybox-static is missing (``make system-packages`` installs them as root)."""


def base_rootfs_tar() -> bytes:
    """The base image's root filesystem as a tar: static busybox and its applets, passwd, /tmp."""
    if not BUSYBOX.is_file():
        raise DockerUnavailableForTests("busybox-static is not installed")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, mode in (("bin", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("proc", 0o755), ("sys", 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        tar.add(BUSYBOX, "bin/busybox")
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        passwd = b"root:x:0:0::/:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    return buffer.getvalue()


async def import_base_image(url: str, tag: str = BASE_IMAGE) -> None:
    docker = aiodocker.Docker(url=url)
    try:
        context = build_context("scratch", [base_rootfs_tar()], {})
        await docker.images.build(fileobj=io.BytesIO(context), encoding="gzip", tag=tag)
    finally:
        await docker.close()


def _run_apart(work: Callable[[str], Coroutine[Any, Any, T]], url: str) -> T:
    """``asyncio.run(work(url))`` on a thread of its own: the session fixture may be first asked for from
    inside a running test's event loop (``request.getfixturevalue``), where ``asyncio.run`` is refused."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(work(url))).result()


async def _answers(url: str) -> bool:
    docker = aiodocker.Docker(url=url)
    try:
        await docker.version()
        return True
    except (aiodocker.DockerError, OSError):
        return False
    finally:
        await docker.close()


@contextmanager
def private_dockerd(root: Path) -> Iterator[str]:
    """Start ``dockerd`` under ``root`` with the base image imported; yields its ``unix://`` address."""
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailableForTests("dockerd is not installed (Debian package docker.io)")
    if os.geteuid() != 0:
        raise DockerUnavailableForTests("dockerd needs root")
    root.mkdir(parents=True, exist_ok=True)
    url = f"unix://{root}/docker.sock"
    command = [
        dockerd,
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--storage-driver=vfs",
        f"--data-root={root}/data",
        f"--exec-root={root}/exec",
        f"--pidfile={root}/docker.pid",
        f"--default-address-pool=base={ADDRESS_POOL},size=24",
        "-H",
        url,
    ]
    with (root / "dockerd.log").open("ab") as log:
        daemon = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while not _run_apart(_answers, url):
            if daemon.poll() is not None or time.monotonic() > deadline:
                how = (
                    f"exited ({daemon.returncode})"
                    if daemon.poll() is not None
                    else f"did not answer in {_START_TIMEOUT:.0f}s"
                )
                tail = (root / "dockerd.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise DockerUnavailableForTests(f"dockerd {how}: {' | '.join(tail)} (see {root}/dockerd.log)")
            time.sleep(0.1)
        _run_apart(import_base_image, url)
        yield url
    finally:
        bridges = _run_apart(_remove_networks, url) if daemon.poll() is None else []
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        for bridge in bridges:  # what the daemon could not remove (a container it failed to stop)
            subprocess.run(["ip", "link", "delete", bridge], check=False, capture_output=True)
        _unmount_under(root)


async def _remove_networks(url: str) -> list[str]:
    """Remove every container and every network of the daemon at ``url``; the names of the networks' bridges
    (``br-<id>``, docker's name for a bridge network's interface)."""
    docker = aiodocker.Docker(url=url)
    try:
        for container in await docker.containers.list(all=True):
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)
        bridges = []
        for network in await docker.networks.list():
            if network["Name"] in ("bridge", "host", "none"):
                continue
            bridges.append(f"br-{network['Id'][:12]}")
            with contextlib.suppress(aiodocker.DockerError):
                await (await docker.networks.get(network["Id"])).delete()
        return bridges
    except (aiodocker.DockerError, OSError):
        return []
    finally:
        await docker.close()


def _unmount_under(root: Path) -> None:
    """What the daemon left mounted under its directories (network namespaces, overlays), deepest first, so
    the temporary directory can be removed."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
