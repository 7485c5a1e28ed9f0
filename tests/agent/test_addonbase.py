"""The add-ons' base image's root filesystem (services/agent/addonbase.py), without a daemon: what the entry
scripts and the servers need is there at the node's paths, and what the servers never load is not."""

from __future__ import annotations

import io
import tarfile

from services.agent.addonbase import addon_rootfs_tar, inspect_addon_programs
from shared.addons import spec as addon


def test_the_addons_rootfs_holds_the_nodes_servers_their_data_and_the_shells_tools() -> None:
    found = inspect_addon_programs()
    assert found.postgres == ("15",) and found.tag.startswith("zattera/addons:pg15-")
    with tarfile.open(fileobj=io.BytesIO(addon_rootfs_tar(found))) as tar:
        members = {m.name: m for m in tar.getmembers()}
    bin_dir = addon.postgres_bin("15").lstrip("/")
    for name in (f"{bin_dir}/postgres", f"{bin_dir}/initdb", f"{bin_dir}/psql", f"{bin_dir}/pg_ctl"):
        assert members[name].isfile(), name
    assert "usr/share/postgresql/15/postgres.bki" in members  # what initdb reads
    assert any(n.startswith("usr/lib/locale/C.utf8/") for n in members)
    assert "usr/share/zoneinfo/UTC" in members or "usr/share/zoneinfo/Etc/UTC" in members
    assert members["usr/bin/redis-server"].issym()  # its name tells the binary what to be
    assert members["usr/bin/pgbackrest"].isfile() and members["usr/bin/redis-cli"].isfile()
    assert members["usr/bin/find"].isfile() and "usr/local/bin/find" not in members  # GNU find: -printf
    assert members["usr/local/bin/sed"].issym() and members["etc/passwd"].isfile()
    assert not any("llvmjit" in n or "/bitcode/" in n for n in members)
    assert not any(n.startswith("usr/share/postgresql/15/man") for n in members)
