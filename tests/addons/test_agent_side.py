"""What the node's agent does for add-ons (services/agent/addon_env.py): the private address filled into an
attached database's URL, and a fork's volume seeded with a copy of the origin's repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.addon_env import expand_service_refs, seed_fork
from shared.addons import spec as addon


def test_service_references_are_filled_with_the_instances_own_values_and_nothing_else() -> None:
    env = {
        "ZATTERA_SERVICE_ORDERS_DB_HOST": "127.130.0.7",
        "ZATTERA_SERVICE_ORDERS_DB_PORT": "5432",
        "DATABASE_URL": "postgresql://app:p%24ss@${ZATTERA_SERVICE_ORDERS_DB_HOST}:${ZATTERA_SERVICE_ORDERS_DB_PORT}/app",
        "PGHOST": "${ZATTERA_SERVICE_ORDERS_DB_HOST}",
        "OTHER": "${HOME} and ${ZATTERA_SERVICE_GONE_DB_HOST}",
    }
    expand_service_refs(env)
    assert env["DATABASE_URL"] == "postgresql://app:p%24ss@127.130.0.7:5432/app"
    assert env["PGHOST"] == "127.130.0.7"
    assert env["OTHER"] == "${HOME} and ${ZATTERA_SERVICE_GONE_DB_HOST}"  # unknown and other names stay


async def test_a_fork_gets_a_copy_of_the_origins_repository_owned_like_its_volume(tmp_path: Path) -> None:
    volumes_dir = tmp_path / "volumes"
    origin_repo = volumes_dir / "01ORIGIN" / "repo"
    (origin_repo / "archive" / "orders").mkdir(parents=True)
    (origin_repo / "archive" / "orders" / "archive.info").write_text("x")
    data, backups = volumes_dir / "01DATA", volumes_dir / "01BACKUPS"
    data.mkdir()
    backups.mkdir()
    os.chown(backups, 65534, 65534)
    release = pb.Release()
    release.service.vars[addon.FORK_VOLUME_VAR] = "01ORIGIN"
    volumes = {"data": data, "backups": backups}
    await seed_fork(release, volumes, volumes_dir)
    copied = backups / "origin-repo" / "archive" / "orders" / "archive.info"
    assert copied.read_text() == "x" and copied.stat().st_uid == 65534
    assert (origin_repo / "archive" / "orders" / "archive.info").stat().st_uid == 0  # the origin only read
    # restored already: nothing is copied again
    (backups / "origin-repo").rename(backups / "moved")
    (data / "pgdata").mkdir()
    (data / "pgdata" / "PG_VERSION").write_text("15")
    await seed_fork(release, volumes, volumes_dir)
    assert not (backups / "origin-repo").exists()
    # an origin not on this node, or a bad id, fails the start with the reason
    (data / "pgdata" / "PG_VERSION").unlink()
    release.service.vars[addon.FORK_VOLUME_VAR] = "01ELSEWHERE"
    with pytest.raises(OSError, match="not on this node"):
        await seed_fork(release, volumes, volumes_dir)
    release.service.vars[addon.FORK_VOLUME_VAR] = "../etc"
    with pytest.raises(OSError, match="not a volume id"):
        await seed_fork(release, volumes, volumes_dir)
