"""``zattera images import`` of a ``docker save`` tarball (from the session's private dockerd) into the
cluster registry, and its one-line errors."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import aiodocker
import pytest
from typer.testing import CliRunner, Result

from cli.main import app
from shared.connection import connect
from shared.imagearchive import ROOTFS_LABEL
from shared.registry import fetch_image
from tests.dockerd import BASE_IMAGE

SPEC = 'project = "demo"\napp = "web"\n\n[env.production]\n'

Invoke = Callable[..., Result]


@pytest.fixture
def cli(nats_url: str, tmp_path: Path) -> Invoke:
    runner = CliRunner()
    assert runner.invoke(app, ["--nats", nats_url, "cluster", "init"]).exit_code == 0

    def invoke(*args: str) -> Result:
        return runner.invoke(app, ["--nats", nats_url, *args], catch_exceptions=False)

    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    assert invoke("apps", "apply", str(spec)).exit_code == 0
    return invoke


def docker_save(docker_host: str, dest: Path) -> Path:
    async def go() -> bytes:
        docker = aiodocker.Docker(url=docker_host)
        try:
            async with docker.images.export_image(BASE_IMAGE) as exported:
                return bytes(await exported.read())
        finally:
            await docker.close()

    dest.write_bytes(asyncio.run(go()))
    return dest


def test_a_docker_save_tarball_is_imported_and_printed_as_a_deployable_ref(
    cli: Invoke, docker_host: str, nats_url: str, tmp_path: Path
) -> None:
    archive = docker_save(docker_host, tmp_path / "base.tar")
    done = cli("images", "import", str(archive), "--app", "demo/web", "--tag", "v1", "--json")
    assert done.exit_code == 0, done.output
    ref = json.loads(done.stdout)["ref"]
    assert "@sha256:" in ref

    async def stored() -> tuple[dict[str, object], int]:
        conn = await connect(nats_url, name="t")
        try:
            image = await fetch_image(conn, ref)
            return json.loads(image.config), len(image.layers)
        finally:
            await conn.close()

    config, layers = asyncio.run(stored())
    assert layers == 1 and config["config"]["Labels"][ROOTFS_LABEL] == "full"  # type: ignore[index]


def tiny_docker_save(dest: Path) -> Path:
    """A ``docker save`` tarball of a one-file image."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    files = {
        "config.json": json.dumps({"os": "linux", "architecture": "amd64", "config": {"Cmd": ["cat"]}}).encode(),
        "abc/layer.tar": layer.getvalue(),
        "manifest.json": json.dumps([{"Config": "config.json", "Layers": ["abc/layer.tar"]}]).encode(),
    }
    with tarfile.open(dest, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return dest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--app", "demo"], "--app: expected project/app, got 'demo'"),
        (["--app", "demo/nope"], "--app: no app 'demo/nope'"),
        (["--app", "demo/web", "--tag", "bad tag"], "--tag: 'bad tag' is not a valid tag"),
    ],
)
def test_bad_options_fail_in_one_line(cli: Invoke, tmp_path: Path, args: list[str], message: str) -> None:
    done = cli("images", "import", str(tiny_docker_save(tmp_path / "tiny.tar")), *args)
    assert done.exit_code == 1
    assert message in done.output and done.output.count("\n") == 1, done.output


def test_a_file_that_is_no_image_archive_fails_in_one_line(cli: Invoke, tmp_path: Path) -> None:
    archive = tmp_path / "junk.tar"
    archive.write_bytes(b"junk")
    done = cli("images", "import", str(archive), "--app", "demo/web")
    assert done.exit_code == 1 and done.output.count("\n") == 1
    assert "error: archive: not a tar archive" in done.output


def test_a_docker_save_without_docker_is_read_too(cli: Invoke, tmp_path: Path) -> None:
    done = cli("images", "import", str(tiny_docker_save(tmp_path / "tiny.tar")), "--app", "demo/web")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip().endswith(tuple("0123456789abcdef")) and "@sha256:" in done.stdout
