"""A secured cluster of three servers, as ``zattera up --secure --tls --nats-cluster 3`` starts it: every
server verifies clients with the same accounts and serves TLS, and the routes between servers are never
open — a server without the route secret, or without a certificate of the cluster CA, is refused."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import nats
import pytest

from cli.up_cluster import Cluster
from shared.connection import connect
from shared.embedded import SERVER_DIR, EmbeddedNats, free_port, wait_meta_group
from shared.security import tls as tls_material
from shared.security.permissions import Role
from shared.security.setup import SecureSetup, prepare
from tests.waiting import eventually_sync


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, SecureSetup]]:
    base = tmp_path_factory.mktemp("secured-cluster")
    setup = prepare(base / "security", tls=True)
    cluster = Cluster(
        data_dir=base,
        nats_cluster=3,
        nats_extra_config=setup.server_config(resolver_dir=f"{SERVER_DIR}/jwt"),
        nats_routes=asdict(setup.route_security()),
    )
    cluster.start_nats()
    try:
        wait_meta_group(cluster.cluster_servers)
        yield cluster, setup
    finally:
        cluster.stop()


def routes_of(server: EmbeddedNats) -> int:
    with urllib.request.urlopen(f"http://{server.host}:{server.http_port}/routez", timeout=2) as resp:
        return int(json.loads(resp.read())["num_routes"])


async def test_every_server_serves_tls_and_refuses_the_unauthenticated(secured: tuple[Cluster, SecureSetup]) -> None:
    cluster, setup = secured
    assert setup.tls_ca is not None
    for server in cluster.cluster_servers:
        conn = await connect(server.url, name="tls", creds=str(setup.creds(Role.PROXY, "p1")), tls_ca=str(setup.tls_ca))
        try:
            assert conn.nc.is_connected
        finally:
            await conn.close()
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                server.url,
                tls=ssl.create_default_context(cafile=str(setup.tls_ca)),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )


def rogue(base: Path, cluster: Cluster, *, password: str, cluster_extra: str) -> EmbeddedNats:
    """A server configured to route to the cluster with the credentials and TLS given."""
    return EmbeddedNats(
        data_dir=base,
        name="rogue",
        cluster_name="zattera",
        cluster_port=free_port(),
        routes=[f"nats://127.0.0.1:{s.cluster_port}" for s in cluster.cluster_servers],
        route_user="route",
        route_password=password,
        cluster_extra=cluster_extra,
    )


@pytest.mark.parametrize("what", ["no route secret", "a foreign CA"])
def test_a_server_without_the_route_secret_or_a_cluster_certificate_cannot_join(
    secured: tuple[Cluster, SecureSetup], tmp_path: Path, what: str
) -> None:
    cluster, setup = secured
    routes = setup.route_security()
    before = [routes_of(s) for s in cluster.cluster_servers]
    if what == "no route secret":
        server = rogue(tmp_path, cluster, password="guessed", cluster_extra=routes.cluster_config)
    else:
        foreign = tls_material.generate(tmp_path / "foreign-tls", ["127.0.0.1"])
        authorization = routes.cluster_config.split("tls {")[0]
        server = rogue(
            tmp_path, cluster, password=routes.password, cluster_extra=authorization + foreign.route_config()
        )
    server.start()
    try:
        log = tmp_path / "nats.log"
        refusal = "Authorization Violation" if what == "no route secret" else "certificate"
        eventually_sync(lambda: refusal in log.read_text(), timeout=15, what="the cluster refuses the rogue route")
        assert routes_of(server) == 0
        assert [routes_of(s) for s in cluster.cluster_servers] == before
    finally:
        server.stop()


def test_the_cluster_is_one_jetstream_cluster_over_its_secured_routes(secured: tuple[Cluster, SecureSetup]) -> None:
    cluster, _ = secured
    wait_meta_group(cluster.cluster_servers, timeout=5)
    assert all(routes_of(s) > 0 for s in cluster.cluster_servers)
