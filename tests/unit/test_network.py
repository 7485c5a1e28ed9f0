"""Private networking, the pure part: names, addresses, policy, what an app is told, the toml key."""

from __future__ import annotations

import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb

from cli.spec import SpecError, validate
from cli.spec_proto import service_spec
from services.agent.network import (
    MAX_SLOTS,
    Consumer,
    NetworkError,
    SlotTable,
    Target,
    allowed,
    consumer_address,
    fqdn_path,
    listeners,
    resolve,
    resolver_address,
    service_env,
    slot_of_address,
    targets_of,
)

DB = Target("db-env", "shop-id", "shop/db/production", "127.128.3.9", (("db", 5432, False),), False)
API = Target("api-env", "partner-id", "partner/api/production", "127.128.0.2", (("http", 8080, True),), True)
WEB = Consumer("web-env", "shop-id")


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("db.production.shop.internal.", "shop/db/production"),
        ("DB.Production.Shop.internal", "shop/db/production"),
        ("a-b.c.d.internal", "d/a-b/c"),
    ],
)
def test_fqdn_path(name: str, path: str) -> None:
    assert fqdn_path(name) == path


@pytest.mark.parametrize(
    "name",
    [
        "db.shop.internal",
        "x.db.production.shop.internal",
        "db.production.shop.local",
        "db_1.p.s.internal",
        "-a.b.c.internal",
        "",
    ],
)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(NetworkError):
        fqdn_path(name)


def test_addresses_are_per_consumer_loopback_twins_of_the_vip() -> None:
    assert (consumer_address(1, "127.128.3.9"), consumer_address(126, "127.128.255.254")) == (
        "127.129.3.9",
        "127.254.255.254",
    )
    assert resolver_address(5) == "127.133.0.1"
    assert [slot_of_address(a) for a in ("127.129.3.9", "127.0.0.1", "127.97.0.2", "127.128.0.2")] == [
        1,
        None,
        None,
        None,
    ]
    for bad in ("127.128.0.1", "127.128.0.255", "nope"):
        with pytest.raises(NetworkError):
            consumer_address(1, bad)


@pytest.mark.parametrize(
    ("consumer", "target", "ok"),
    [
        (WEB, DB, True),
        (WEB, API, False),
        (Consumer("web-env", "shop-id", frozenset({"partner/api/production"})), API, True),
        (Consumer("web-env", "shop-id", frozenset({"partner/api/staging"})), API, False),
        (Consumer("x", "partner-id"), DB, False),
    ],
    ids=["own-project", "other-project-refused", "allowlisted", "other-env-of-allowlisted-app", "reverse"],
)
def test_policy(consumer: Consumer, target: Target, ok: bool) -> None:
    assert allowed(consumer, target) is ok
    assert (resolve(1, consumer, [DB, API], _fqdn(target)) is not None) is ok


def _fqdn(target: Target) -> str:
    project, app, env = target.path.split("/")
    return f"{app}.{env}.{project}.internal"


def test_listeners_are_the_allowed_pairs_only() -> None:
    slots = {1: WEB, 2: Consumer("blog-env", "blog-id", frozenset({"shop/db/production"}))}
    assert listeners(slots, [DB, API]) == {
        ("127.129.3.9", 5432): ("db-env", "db"),
        ("127.130.3.9", 5432): ("db-env", "db"),
    }


def test_service_env_names_own_project_envs_short_and_others_with_their_project() -> None:
    consumer = Consumer("web-env", "shop-id", frozenset({"partner/api/production"}))
    assert service_env(3, consumer, [DB, API], dns_port=53) == {
        "ZATTERA_DNS": "127.131.0.1:53",
        "ZATTERA_SERVICE_DB_PRODUCTION_HOST": "127.131.3.9",
        "ZATTERA_SERVICE_DB_PRODUCTION_PORT": "5432",
        "ZATTERA_SERVICE_DB_PRODUCTION_URL": "tcp://127.131.3.9:5432",
        "ZATTERA_SERVICE_DB_PRODUCTION_PORT_DB": "5432",
        "ZATTERA_SERVICE_PARTNER_API_PRODUCTION_HOST": "127.131.0.2",
        "ZATTERA_SERVICE_PARTNER_API_PRODUCTION_PORT": "8080",
        "ZATTERA_SERVICE_PARTNER_API_PRODUCTION_URL": "http://127.131.0.2:8080",
        "ZATTERA_SERVICE_PARTNER_API_PRODUCTION_PORT_HTTP": "8080",
    }


def test_slots_lowest_free_kept_per_env_and_freed_when_gone() -> None:
    table = SlotTable()
    assert [table.slot(Consumer(e, "p")) for e in ("a", "b", "a")] == [1, 2, 1]
    assert table.keep_only(["b"]) and not table.keep_only(["b"])
    assert table.slot(Consumer("c", "p")) == 1
    full = SlotTable({slot: Consumer(f"e{slot}", "p") for slot in range(1, MAX_SLOTS + 1)})
    with pytest.raises(NetworkError):
        full.slot(Consumer("one-too-many", "p"))


def test_targets_of_skips_malformed_services() -> None:
    snapshot = cpb.RouteSnapshot(
        internal_services=[
            cpb.InternalService(fqdn="db.production.shop.internal.", environment_id="ok", vip="127.128.0.3"),
            cpb.InternalService(fqdn="nonsense.", environment_id="bad-name", vip="127.128.0.4"),
            cpb.InternalService(fqdn="a.b.c.internal.", environment_id="bad-vip", vip="127.128.0.1"),
        ]
    )
    assert [t.env_id for t in targets_of(snapshot)] == ["ok"]


def test_an_http_port_without_a_number_is_served_on_80_and_another_is_not() -> None:
    service = cpb.InternalService(fqdn="web.production.shop.internal.", environment_id="e", vip="127.128.0.3")
    service.ports.add(name="http", port=0)
    service.ports.add(name="metrics", port=0)
    service.ports.add(name="db", port=5432)
    (target,) = targets_of(cpb.RouteSnapshot(internal_services=[service]))
    assert target.ports == (("http", 80, True), ("db", 5432, False))


def _toml(network: dict[str, object]) -> dict[str, object]:
    return {"project": "shop", "app": "web", "env": {"production": {"network": network}}}


def test_network_allow_is_written_to_the_spec() -> None:
    spec = validate(_toml({"allow": ["partner/api/production", "partner/api/production"]}))
    env = spec.env["production"]
    assert list(service_spec(spec, env).network.allow) == ["partner/api/production"]
    assert not service_spec(spec, validate(_toml({})).env["production"]).HasField("network")


@pytest.mark.parametrize(
    ("network", "says"),
    [
        ({"allow": ["partner/api"]}, "env.production.network.allow: 'partner/api' is not project/app/env"),
        ({"allow": ["Partner/api/prod"]}, "env.production.network.allow: 'Partner/api/prod' is not project/app/env"),
        ({"deny": []}, "env.production.network.deny"),
    ],
)
def test_bad_network_keys_name_the_field(network: dict[str, object], says: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate(_toml(network))
    assert says in str(caught.value)
