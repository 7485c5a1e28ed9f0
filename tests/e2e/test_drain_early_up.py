"""A drain that ends when the work does (issue 42), on a real ``zattera up``: with the production drain
window of 600 s, a redeploy under a steady load through the proxy stops the old release within seconds of
the promotion — the route builder's snapshot, the proxy's heartbeat (its count of what is in flight to
endpoints no longer routed) and the orchestrator's drain all real — and no request fails."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from shared.clock import from_timestamp
from tests.e2e.cluster import E2ECluster, Load, app_source
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROD = "demo/hello/production"
HOST = "hello.localhost"
WINDOW = 600.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    root: Path = tmp_path_factory.mktemp("e2e-drain-early")
    c = E2ECluster(root, timers={"ZATTERA_DRAIN_WINDOW": f"{WINDOW:g}"})
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


async def test_a_redeploy_under_load_stops_the_old_release_long_before_the_window(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    sources = {v: app_source(tmp_path / v, v) for v in ("v1", "v2")}
    await cluster.acli("apps", "apply", str(sources["v1"] / "zattera.toml"))
    await cluster.acli("deploy", str(sources["v1"]), "--env", PROD)
    load = Load(cluster.proxy_port, HOST, rate=40).start()
    try:
        await eventually(lambda: load.ok >= 20, 30, "load is flowing")
        deployed = await cluster.acli("deploy", str(sources["v2"]), "--env", PROD)
        found = re.search(r"^deployment (\S+) created", deployed.stderr, re.MULTILINE)
        assert found, deployed.stderr
        async with cluster.state() as (_, view):

            def succeeded() -> bool:
                d = view.deployment(found.group(1))
                return d is not None and d.phase == pb.DEPLOYMENT_PHASE_SUCCEEDED

            await eventually(succeeded, 60, "the drain ended with the work, not after 600 s")
            d = view.deployment(found.group(1))
            assert d is not None
            lasted = from_timestamp(d.meta.updated_at) - from_timestamp(d.promoted_at)
            assert lasted < 60, lasted
            old = [a for a in view.assignments(d.environment_id) if a.release_id == d.previous_release_id]
            assert old and all(a.desired == pb.ASSIGNMENT_DESIRED_STOP for a in old), old
        seen = load.versions["v2"]
        await eventually(lambda: load.versions["v2"] >= seen + 20, 30, "v2 serves")
    finally:
        await load.stop()
    assert load.failures == [], load.summary()
    assert load.versions["v1"] > 0 and load.versions["v2"] > 0, load.summary()
