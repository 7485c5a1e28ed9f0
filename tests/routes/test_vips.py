"""VIP allocation: the pure plan as table tests, the leader loop against real NATS."""

from __future__ import annotations

import ipaddress

import pytest
from zattera.v1 import types_pb2 as pb

from services.agent.network import slot_of_address
from services.routes.vips import VipAllocator, plan_vips, vip_pool
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.routes import state as S


def env(env_id: str, ports: int) -> pb.Environment:
    _, msg = S.env(env_id, ports=[S.http_port(f"p{i}") for i in range(ports)])
    assert isinstance(msg, pb.Environment)
    return msg


def vip(env_id: str, address: str) -> pb.ServiceVIP:
    return pb.ServiceVIP(environment_id=env_id, vip=address)


@pytest.mark.parametrize(
    ("envs", "vips", "allocate", "free"),
    [
        ([env("e1", 1), env("e2", 2), env("e3", 0)], [], {"e1": "127.128.0.2", "e2": "127.128.0.3"}, []),
        ([env("e1", 1)], [vip("e1", "127.128.0.7")], {}, []),
        ([env("e1", 1), env("e2", 0)], [vip("e1", "127.128.0.2"), vip("e2", "127.128.0.3")], {}, ["e2"]),
        ([env("e1", 1)], [vip("gone", "127.128.0.2")], {"e1": "127.128.0.2"}, ["gone"]),
        ([env("e1", 1), env("e2", 1)], [vip("e1", "127.128.0.2")], {"e2": "127.128.0.3"}, []),
        ([env("e1", 1), env("e2", 1)], [vip("e2", "127.128.0.2")], {"e1": "127.128.0.3"}, []),
        ([env("e1", 1)], [vip("e1", "")], {"e1": "127.128.0.2"}, []),
        ([env("e1", 1), env("e2", 1)], [vip("e1", "10.97.0.2")], {"e2": "127.128.0.3"}, []),
    ],
    ids=[
        "envs-with-ports-get-distinct-vips-from-127.128.0.2",
        "an-env-keeps-its-vip",
        "no-ports-frees-the-vip",
        "vip-of-a-deleted-env-is-freed-and-reused",
        "next-free-address-skips-held-ones",
        "lower-addresses-held-by-others-are-skipped",
        "empty-vip-counts-as-none",
        "a-vip-of-the-earlier-range-keeps-its-host-part-taken",
    ],
)
def test_plan(envs: list[pb.Environment], vips: list[pb.ServiceVIP], allocate: dict[str, str], free: list[str]) -> None:
    plan = plan_vips(envs, vips)
    assert (plan.allocate, plan.free, plan.exhausted) == (allocate, free, [])


def test_pool_spans_127_128_skipping_network_gateway_and_broadcast() -> None:
    pool = list(vip_pool())
    assert (len(pool), pool[0], pool[252], pool[253], pool[-1]) == (
        256 * 253,
        "127.128.0.2",
        "127.128.0.254",
        "127.128.1.2",
        "127.128.255.254",
    )


def test_every_vip_is_loopback_and_no_consumer_or_resolver_address() -> None:
    """A VIP never leaves the machine (127/8 is routed to ``lo``, never onto a wire) so it cannot reach a
    real network's host, and it is no app's address of another env nor a resolver's."""
    for address in vip_pool():
        assert ipaddress.IPv4Address(address).is_loopback, address
        assert slot_of_address(address) is None, address


def test_exhausted_pool_skips_the_env() -> None:
    held = [vip(f"h{i:05d}", address) for i, address in enumerate(vip_pool())]
    plan = plan_vips([env(v.environment_id, 1) for v in held] + [env("late", 1)], held)
    assert (plan.allocate, plan.exhausted) == ({}, ["late"])


async def test_allocate_and_free(conn: Connection, view: StateView, writer: Writer) -> None:
    await S.commit(writer, S.env("e1", ports=[S.http_port()]), S.env("e2", ports=[S.http_port(), S.http_port("b")]))
    await S.commit(writer, S.env("e3", ports=[]))
    loop = VipAllocator(LoopDeps(conn, view, FakeClock()))
    loop.writer = writer
    await loop.pass_once()
    e1, e2 = view.vip("e1"), view.vip("e2")
    assert e1 is not None and e2 is not None and e1.vip and e2.vip and e1.vip != e2.vip
    assert view.vip("e3") is None
    await loop.pass_once()
    assert view.vip("e1") == e1
    await S.commit(writer, S.env("e2", ports=[]))
    await loop.pass_once()
    assert (view.vip("e1"), view.vip("e2")) == (e1, None)
