"""The tests' private Docker daemon (``tests/dockerd.py``) leaves nothing behind in the machine's network: a
network made on it takes its subnet from the daemon's own pool, and its bridge is gone once the daemon stops
(a stopped daemon's bridges stay in the kernel, and enough of them take every pool docker knows)."""

from __future__ import annotations

import asyncio
import ipaddress
import subprocess

import aiodocker
import pytest

from tests.dockerd import ADDRESS_POOL, DockerUnavailableForTests, private_dockerd

pytestmark = pytest.mark.timeout(180)


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


async def _make_network(url: str) -> tuple[str, str]:
    docker = aiodocker.Docker(url=url)
    try:
        network = await docker.networks.create({"Name": "zattera", "Driver": "bridge"})
        info = await network.show()
        return f"br-{info['Id'][:12]}", str(info["IPAM"]["Config"][0]["Subnet"])
    finally:
        await docker.close()


def test_a_network_made_on_the_private_daemon_leaves_with_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    try:  # a short directory: containerd's sockets under it must fit a unix socket path
        with private_dockerd(tmp_path_factory.mktemp("dockerd")) as url:
            bridge, subnet = asyncio.run(_make_network(url))
            assert ipaddress.ip_network(subnet).subnet_of(ipaddress.ip_network(ADDRESS_POOL)), subnet
            assert _link_exists(bridge)
    except DockerUnavailableForTests as exc:
        pytest.skip(f"needs a Docker daemon: {exc} (make system-packages installs it)")
    assert not _link_exists(bridge), f"{bridge} outlived its daemon"
