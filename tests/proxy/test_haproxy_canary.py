"""The HAProxy engine on a canary's weighted route (issue 41), real HAProxy and real NATS: the next step's
weights reach HAProxy through the runtime API without a reload, requests without a cookie follow them, and a
client keeping its cookie stays on one release."""

from __future__ import annotations

import aiohttp
import pytest
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.launch import haproxy_binary
from tests.proxy.harness import HOST, Backend, Routes, http_route, serving
from tests.proxy.test_haproxy import IngressFactory, make_ingress, serve, url

__all__ = ["make_ingress"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(haproxy_binary() is None, reason="haproxy is not installed (make system-packages)")


def step(stable: Backend, canary: Backend, canary_share: int, index: int) -> cpb.HTTPRoute:
    """The env's route at a canary step: the canary's share in basis points, the rest the stable's."""
    endpoints = [
        cpb.Endpoint(
            assignment_id=f"a-{release}",
            node_id="n1",
            addr=backend.addr,
            healthy=True,
            release_id=release,
            release_weight=share,
            step_tag=f"dep.{index}",
        )
        for backend, release, share in ((stable, "rel1", 10_000 - canary_share), (canary, "rel2", canary_share))
    ]
    return http_route(HOST, endpoints=endpoints)


async def canary_hits(target: str, requests: int, canary: Backend) -> int:
    before = canary.hits
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as fresh:
        for _ in range(requests):
            async with fresh.get(target, headers={"Host": HOST}) as response:
                assert response.status == 200
    return canary.hits - before


async def test_steps_change_weights_without_a_reload_and_a_cookie_keeps_a_user_on_one_release(
    make_ingress: IngressFactory, routes: Routes
) -> None:
    stable, canary = Backend("stable"), Backend("canary")
    async with serving(stable, canary):
        ingress = await make_ingress()
        target = url(ingress)
        await serve(routes, ingress, step(stable, canary, 1_000, 0))
        assert 10 <= await canary_hits(target, 400, canary) <= 90  # 10 %: 40 expected
        reloads = ingress.engine.reloads
        await serve(routes, ingress, step(stable, canary, 5_000, 1))
        assert ingress.engine.reloads == reloads  # the runtime API's weights, not a new worker
        assert 130 <= await canary_hits(target, 400, canary) <= 270  # 50 %: 200 expected
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as kept:
            answers = set()
            for _ in range(30):
                async with kept.get(target, headers={"Host": HOST}) as response:
                    answers.add(await response.text())
            assert len(answers) == 1, answers  # a user stays on one release within the step
