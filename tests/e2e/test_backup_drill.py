"""The disaster-recovery drill through ``zattera up`` as an operator runs it: a cluster serving the example
app, whose release holds a sealed secret, backed up to a real S3 API server (moto on loopback); every
process stopped and the data directory deleted; ``zattera up`` on a new data directory, ``zattera restore``:
the app serves again through the new proxy, its replicas placed on the new machine and started with the
secret the restored key opens."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.embedded import free_port
from tests.backup.conftest import BUCKET, s3
from tests.e2e.cluster import EXAMPLE, kill_tree_under, version_of
from tests.e2e.test_up import hello, logs_of
from tests.e2e.upcmd import Up
from tests.waiting import eventually

__all__ = ["s3"]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = "demo/hello/production"
PASSPHRASE = {"ZATTERA_RECOVERY_PASSPHRASE": "drill recovery passphrase"}


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    old, new = tmp_path / "old-machine", tmp_path / "new-machine"
    yield old, new
    for directory in (old, new):
        kill_tree_under(directory, also_matching=str(directory))


async def test_backup_to_s3_then_restore_on_a_new_data_dir_serves_again(s3: str, dirs: tuple[Path, Path]) -> None:
    old, new = dirs
    nats_port, proxy_port = free_port(), free_port()
    target = f"s3://{BUCKET}/drill"

    async def served() -> bool:
        status, body = await hello(proxy_port)
        return status == 200 and version_of(body) == "v1"

    up = Up(old, nats_port, proxy_port, env=PASSPHRASE)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up")
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        up.cli("deploy", str(EXAMPLE), "--env", ENV)
        up.cli("secrets", "set", "API_TOKEN", "--env", ENV, stdin="drill-secret-value\n")
        await eventually(served, 90, "hello answers through the proxy")
        created = up.cli("backup", "create", "--to", target, "--data-dir", str(old))
        assert "objects" in created.stderr, created.stderr
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        print(logs_of(old))
        raise
    finally:
        up.kill()
    shutil.rmtree(old)

    up = Up(new, nats_port, proxy_port, env=PASSPHRASE)
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 60, "zattera up is up on the new machine")
        verified = up.cli("backup", "verify", "--from", target)
        assert "all intact" in verified.stderr, verified.stderr
        restored = up.cli("restore", "--from", target, "--data-dir", str(new))
        assert "restored" in restored.stderr, restored.stderr
        await eventually(served, 120, "hello answers again on the new machine")
        # A replica starts only once the secrets service opened its secrets: with the restored key.
        logs = "".join(p.read_text(errors="replace") for p in (new / "logs").glob("*.log"))
        assert "secrets: sealed 1 secret(s)" in logs, logs[-3000:]
        secrets = up.cli("secrets", "list", "--env", ENV)
        assert "API_TOKEN" in secrets.stdout and "drill-secret-value" not in secrets.stdout + secrets.stderr
        assert up.ctrl_c() == 0, up.text()
    except BaseException:
        print(up.text())
        print(logs_of(new))
        raise
    finally:
        up.kill()
