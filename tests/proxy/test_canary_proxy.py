"""The Python proxy on a canary's weighted route (issue 41), real NATS and real upstreams: requests without a
cookie follow the weights, a client keeping its cookie stays on one release, and the heartbeat carries the
per-release counters of the step."""

from __future__ import annotations

import aiohttp
from zattera.cluster.v1 import cluster_pb2 as cpb

from services.proxy.balancer import STICKY_COOKIE
from tests.proxy.harness import HOST, Backend, ProxyFactory, Routes, http_route, serving


def weighted(addr: str, release: str, share: int) -> cpb.Endpoint:
    return cpb.Endpoint(
        assignment_id=f"a-{release}",
        node_id="n1",
        addr=addr,
        healthy=True,
        release_id=release,
        release_weight=share,
        step_tag="dep.0",
    )


async def test_weights_cookies_and_counters(make_proxy: ProxyFactory, routes: Routes) -> None:
    stable, canary = Backend("stable"), Backend("canary")
    async with serving(stable, canary):
        proxy = await make_proxy()
        route = http_route(HOST, endpoints=[weighted(stable.addr, "rel1", 8000), weighted(canary.addr, "rel2", 2000)])
        await routes.serve(proxy, route)
        url = f"http://127.0.0.1:{proxy.port}/"
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as fresh:
            for _ in range(400):
                async with fresh.get(url, headers={"Host": HOST}) as response:
                    assert response.status == 200
                    assert STICKY_COOKIE in response.cookies  # each answer pins its client
        assert 40 <= canary.hits <= 125, (canary.hits, stable.hits)
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as kept:
            answers = set()
            for _ in range(30):
                async with kept.get(url, headers={"Host": HOST}) as response:
                    answers.add(await response.text())
            assert len(answers) == 1, answers  # a user stays on one release
        traffic = {t.release_id: t for t in proxy.stats.releases.report()}
        assert traffic["rel2"].requests == canary.hits and traffic["rel1"].requests == stable.hits
        assert traffic["rel2"].step_tag == "dep.0" and traffic["rel2"].errors_5xx == 0
