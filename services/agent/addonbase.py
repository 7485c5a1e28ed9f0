"""The add-ons' base image of the docker runtime: managed databases (docs/addons.md) made from this node's
own packages, as the Python and Node bases are (``hostbase.py``): no registry image.

An add-on's release runs ``exec:sh zattera-addon.sh`` (``shared/addons/spec.py``): its command writes the
engine's entry script into its working directory and runs it. Under the docker runtime that runs on this
image, which holds, at the node's own paths:

* the node's busybox and its applets in ``/usr/local/bin`` (the entry scripts are POSIX sh with ``mkdir``,
  ``sed``, ``grep``, ``sleep`` …) and GNU ``find`` (``-printf``: the archiver report);
* each PostgreSQL version of :data:`shared.addons.spec.ENGINES` the node has: its ``bin``, its ``lib``
  (extension modules; not the LLVM JIT nor its bitcode: the server runs without JIT) and its ``share``
  directory (what ``initdb`` reads), with every library they load;
* ``pgbackrest``, ``redis-server`` and ``redis-cli`` with their libraries;
* the ``C.UTF-8`` locale (``initdb --locale=C.UTF-8``) and the time zone data (PostgreSQL reads the system's).

The working directory is ``/tmp`` (world-writable; a tmpfs on a read-only root). ``initdb`` needs a name for
its user: the launcher mounts an ``/etc/passwd`` naming the container's user over the image's
(``docker_runtime.py``). The tag is ``zattera/addons:<versions>-<digest>`` of the programs' paths and times:
an upgrade of a package makes another tag.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from services.agent.hostbase import BaseImageError, node_cafiles, program_rootfs_tar, tar_size
from shared.addons import spec as addon

WORKDIR = "/tmp"
PROGRAMS = ("pgbackrest", "redis-server", "redis-cli")
GNU_TOOLS = ("find",)
"""Host programs used instead of busybox's applet of that name (GNU options the scripts use)."""
LOCALES = ("/usr/lib/locale/C.utf8",)
ZONEINFO = "/usr/share/zoneinfo"
SKIPPED_LIB = ("bitcode", "llvmjit")


@dataclass(frozen=True)
class AddonPrograms:
    """What of the add-ons' programs this node has."""

    busybox: str
    programs: tuple[str, ...]
    """Absolute paths of pgbackrest, redis-server, redis-cli and the GNU tools."""
    postgres: tuple[str, ...]
    """The PostgreSQL versions present."""

    @property
    def tag(self) -> str:
        postgres = [addon.postgres_bin(v) + "/postgres" for v in self.postgres]
        stamp = "\n".join(f"{p}:{int(os.stat(p).st_mtime)}" for p in (self.busybox, *self.programs, *postgres))
        digest = hashlib.sha256(stamp.encode()).hexdigest()[:8]
        versions = "-".join(f"pg{v}" for v in self.postgres) or "nopg"
        return f"zattera/addons:{versions}-{digest}"


def inspect_addon_programs() -> AddonPrograms:
    """The node's busybox, PostgreSQL versions, pgBackRest and Redis (BaseImageError without busybox: the
    scripts' shell tools)."""
    found = shutil.which("busybox")
    if found is None:
        raise BaseImageError("the add-ons' image needs busybox on this node (make install-system)")
    # as found, symlinks kept: redis-server is a link whose name tells the binary what to be
    programs = tuple(p for p in (shutil.which(n) for n in (*PROGRAMS, *GNU_TOOLS)) if p)
    versions = tuple(v for v in addon.ENGINES[addon.POSTGRES] if os.path.isfile(addon.postgres_bin(v) + "/postgres"))
    return AddonPrograms(busybox=os.path.realpath(found), programs=programs, postgres=versions)


def _tree(root: str, skipped: tuple[str, ...] = ()) -> list[str]:
    files: list[str] = []
    for current, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skipped and not (current == root and d == "man")]
        files += [os.path.join(current, n) for n in names if not n.startswith(skipped)]
    return files


def addon_rootfs_tar(found: AddonPrograms) -> bytes:
    """The add-ons' base image's root filesystem as a tar (see the module docstring)."""
    listed = subprocess.run([found.busybox, "--list"], capture_output=True, text=True, check=False, timeout=30)
    applets = [n for n in listed.stdout.split() if n and "/" not in n and n not in GNU_TOOLS]
    files: list[str] = []
    for version in found.postgres:
        prefix = os.path.dirname(addon.postgres_bin(version))
        files += _tree(os.path.join(prefix, "bin")) + _tree(os.path.join(prefix, "lib"), SKIPPED_LIB)
        files += _tree(f"/usr/share/postgresql/{version}")
    for locale in LOCALES:
        files += _tree(locale)
    files += _tree(ZONEINFO)
    loaded = [f for f in files if f.endswith(".so") or os.path.dirname(f).endswith("/bin")]
    return program_rootfs_tar(
        found.busybox,
        applets,
        files=[*files, *found.programs],
        loaded=[*loaded, *found.programs],
        cafiles=node_cafiles(),
    )


def main() -> None:
    """``python -m services.agent.addonbase``: the add-ons' base image's size (PERFORMANCE.md)."""
    found = inspect_addon_programs()
    data = addon_rootfs_tar(found)
    print(f"{found.tag}: {tar_size(data) / 1e6:.1f} MB of files, tar {len(data) / 1e6:.1f} MB", file=sys.stdout)


if __name__ == "__main__":
    main()
