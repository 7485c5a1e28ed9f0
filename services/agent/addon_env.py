"""What the node does for managed databases (docs/addons.md) when it starts an instance:

* :func:`expand_service_refs`: a variable or secret value may name the private address of an env it may
  reach as ``${ZATTERA_SERVICE_<APP>_<ENV>_HOST}`` / ``_PORT`` (an attached database's ``DATABASE_URL``):
  the reference is replaced by this instance's own value of that variable (each consumer reaches an env
  at an address of its own, docs/networking.md). Only ``ZATTERA_SERVICE_*`` names are expanded, so no
  other value changes meaning; an unknown one stays as written.
* :func:`seed_fork`: before the first start of a PostgreSQL fork (``zattera addons restore``), the origin's
  pgBackRest repository (its ``backups`` volume on this node) is copied into the fork's own ``backups``
  volume as ``origin-repo``, owned like that volume, which the fork restores from and then removes: the
  fork's sandbox never sees the origin's volume, and the origin is only read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from shared.addons import spec as addon
from shared.ids import is_safe_id

log = logging.getLogger(__name__)

_REF = re.compile(r"\$\{(ZATTERA_SERVICE_[A-Z0-9_]+)\}")


def expand_service_refs(env: MutableMapping[str, str]) -> None:
    for name, value in list(env.items()):
        if "${ZATTERA_SERVICE_" in value:
            env[name] = _REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def _copy_repo(origin: Path, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(origin, partial, symlinks=True)
    owner = target.parent.stat()
    for root, dirs, files in os.walk(partial):
        for entry in (*dirs, *files):
            os.chown(os.path.join(root, entry), owner.st_uid, owner.st_gid, follow_symlinks=False)
    os.chown(partial, owner.st_uid, owner.st_gid)
    partial.rename(target)


async def seed_fork(release: pb.Release, volumes: Mapping[str, Path], volumes_dir: Path) -> None:
    origin_id = release.service.vars.get(addon.FORK_VOLUME_VAR, "")
    if not origin_id:
        return
    data, backups = volumes.get(addon.DATA_VOLUME), volumes.get(addon.BACKUPS_VOLUME)
    if data is None or backups is None or (data / "pgdata" / "PG_VERSION").exists():
        return  # restored already (or not an add-on's layout): nothing to copy
    target = backups / addon.ORIGIN_REPO_DIR
    if target.exists():
        return
    if not is_safe_id(origin_id):
        raise OSError(f"{addon.FORK_VOLUME_VAR}: not a volume id")
    origin = volumes_dir / origin_id / "repo"
    if not origin.is_dir():
        raise OSError(f"the origin's backups (volume {origin_id}) are not on this node")
    log.info("copying the origin's backups (volume %s) for a point-in-time restore", origin_id)
    await asyncio.to_thread(_copy_repo, origin, target)
