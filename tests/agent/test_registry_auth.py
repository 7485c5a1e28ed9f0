"""Registry credentials for ``docker://`` pulls: a real registry (Debian's ``docker-registry``, htpasswd
auth, on a free port: the daemon treats 127.0.0.0/8 as an insecure registry it may reach over HTTP) holds an
image only the right credentials may pull; the session's private daemon pulls it through the docker
launcher with them (``X-Registry-Auth``), refuses without them, and is never given them for another
registry. The pure rules (what is sent where, what stays out of the environment) are table tests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiodocker
import bcrypt
import pytest

from services.agent.docker_runtime import DockerLauncher
from services.agent.images import ImageError
from shared.appconfig import ConfigError
from shared.embedded import free_port
from shared.registryauth import (
    REGISTRY_AUTH_SECRET,
    auth_for,
    registry_auth_value,
    registry_of,
    split_registry_auth,
)
from tests.dockerd import BASE_IMAGE
from tests.waiting import eventually

USER, PASSWORD = "tester", "s3cret-pw-0f9a"


@pytest.mark.parametrize(
    ("image", "registry"),
    [
        ("nginx", "docker.io"),
        ("library/nginx:1", "docker.io"),
        ("ghcr.io/acme/web:2", "ghcr.io"),
        ("127.0.0.1:5000/acme/web", "127.0.0.1:5000"),
        ("localhost/web", "localhost"),
    ],
)
def test_the_registry_of_an_image_name(image: str, registry: str) -> None:
    assert registry_of(image) == registry


def test_credentials_go_only_to_their_registry_and_never_into_the_environment() -> None:
    value = registry_auth_value("ghcr.io", "me", PASSWORD)
    env, auth = split_registry_auth({"API_KEY": "k", REGISTRY_AUTH_SECRET: value})
    assert env == {"API_KEY": "k"}
    assert auth == {"serveraddress": "ghcr.io", "username": "me", "password": PASSWORD}
    assert auth_for("ghcr.io/acme/web:2", auth) == auth
    assert auth_for("acme/web:2", auth) is None  # Docker Hub is another registry
    assert split_registry_auth({REGISTRY_AUTH_SECRET: "not json"}) == ({}, None)
    assert json.loads(registry_auth_value("index.docker.io", "me", "pw"))["serveraddress"] == "docker.io"


@pytest.mark.parametrize(
    ("server", "username", "password", "field"),
    [
        ("https://ghcr.io/v2", "me", "pw", "server"),
        ("ghcr.io", "", "pw", "--username"),
        ("ghcr.io", "me", "", "password"),
    ],
)
def test_bad_credentials_name_the_field_and_never_the_password(server, username, password, field) -> None:
    with pytest.raises(ConfigError) as refused:
        registry_auth_value(server, username, password)
    assert str(refused.value).startswith(f"{field}:")
    assert not password or password not in str(refused.value)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """``host:port`` of a registry that wants ``USER``/``PASSWORD``."""
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.skip("docker-registry is not installed (make system-packages installs it)")
    port = free_port()
    (tmp_path / "htpasswd").write_bytes(USER.encode() + b":" + bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)))
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "data")}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": "test"},
        "auth": {"htpasswd": {"realm": "zattera-test", "path": str(tmp_path / "htpasswd")}},
    }
    (tmp_path / "registry.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    with (tmp_path / "registry.log").open("wb") as log:
        process = subprocess.Popen([binary, "serve", str(tmp_path / "registry.yml")], stdout=log, stderr=log)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def answers(address: str) -> bool:
    host, port = address.split(":")
    try:
        connection = http.client.HTTPConnection(host, int(port), timeout=1)
        connection.request("GET", "/v2/")
        return connection.getresponse().status == 401
    except OSError:
        return False


async def push_private_image(docker_host: str, registry: str) -> str:
    """The base image pushed to ``registry`` as ``acme/private:1`` and untagged from the daemon (which must
    then pull it, with the credentials); its name."""
    await eventually(lambda: asyncio.to_thread(answers, registry), 15, "the registry answers")
    name = f"{registry}/acme/private:1"
    docker = aiodocker.Docker(url=docker_host)
    try:
        await docker.images.tag(BASE_IMAGE, f"{registry}/acme/private", tag="1")
        await docker.images.push(name, auth={"serveraddress": registry, "username": USER, "password": PASSWORD})
        await docker.images.delete(name)
    finally:
        await docker.close()
    return name


async def test_the_daemon_pulls_a_private_image_only_with_the_credentials_for_its_registry(
    docker_host: str, registry: str, tmp_path: Path
) -> None:
    name = await push_private_image(docker_host, registry)
    auth = {"serveraddress": registry, "username": USER, "password": PASSWORD}

    launcher = DockerLauncher(docker_host, node_id="reg", base_image=BASE_IMAGE, pids_limit=64)
    try:
        ref = f"docker://{name}"
        with pytest.raises(ImageError) as refused:
            await launcher.prepare(None, ref, tmp_path, platform="linux/amd64")  # type: ignore[arg-type]
        assert "pull" in str(refused.value) and PASSWORD not in str(refused.value)
        elsewhere = {**auth, "serveraddress": "ghcr.io"}
        with pytest.raises(ImageError):  # credentials of another registry are not sent
            await launcher.prepare(None, ref, tmp_path, platform="linux/amd64", registry_auth=elsewhere)  # type: ignore[arg-type]
        image = await launcher.prepare(None, ref, tmp_path, platform="linux/amd64", registry_auth=auth)  # type: ignore[arg-type]
        assert image.ref == ref
        assert await launcher.has_image(name)
    finally:
        await launcher.docker.images.delete(name, force=True)
        await launcher.close()
