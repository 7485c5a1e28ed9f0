"""The first request to a cooled ``scale_to_zero`` env is held and answered 200, end to end: the whole
control plane, agents of each runtime (processes; containers on the session's private dockerd), and two
proxies, one per data plane (HAProxy with the Python hold handler behind it, and the Python engine).

The app declares no health check and listens a second after it starts (as most apps do: it answers once it
listens), so a replica reported healthy before it listens, or a request sent to a replica cooled a moment
ago, shows up as a 502/503. Each runtime's cluster wakes the env:

* right after it cooled: the requests go out, to both proxies at once, as soon as the env's replica count
  is written to 0, while the route change (its endpoint leaving) is still on its way to the proxies and the
  replica is being stopped;
* long after it cooled: the route has had no endpoint for a while, the replica is long gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.e2e.cluster import E2ECluster, env_by_name, running
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = "demo/cold/production"
HOST = "cold-production.localhost"
TOML = """
project = "demo"
app = "cold"

[env.production]
replicas = 1
scale_to_zero = true
idle_timeout = "2s"
"""
LISTENS_AFTER = 1.0
LONG_AFTER = 10.0
"""Seconds the env stays cold (its route without endpoint) before the "long after" request."""
SERVE = (
    f"/bin/busybox sleep {LISTENS_AFTER}; D=/tmp/cold-$ZATTERA_ASSIGNMENT_ID; /bin/busybox mkdir -p $D; "
    "echo cold-ok > $D/index.html; exec /bin/busybox httpd -f -p $ZATTERA_BIND_ADDR:$PORT -h $D"
)


@pytest.fixture(scope="module", params=["process", "docker"])
def cold_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    timers = {"ZATTERA_AGENT_RUNTIME": request.param}
    if request.param == "docker":
        timers["ZATTERA_AGENT_DOCKER_HOST"] = request.getfixturevalue("docker_host")
    c = E2ECluster(tmp_path_factory.mktemp(f"e2e-cold-{request.param}"), trace=False, timers=timers, python_proxy=True)
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


async def both_proxies(cluster: E2ECluster) -> list[tuple[int, str]]:
    """The same request through HAProxy and through the Python engine, at once."""
    return list(
        await asyncio.gather(
            cluster.get(HOST, timeout=60), cluster.get(HOST, timeout=60, port=cluster.python_proxy_port)
        )
    )


async def test_the_first_request_to_a_cooled_env_is_held_and_answered(cold_cluster: E2ECluster, tmp_path: Path) -> None:
    cluster = cold_cluster
    toml = tmp_path / "zattera.toml"
    toml.write_text(TOML)
    await cluster.acli("apps", "apply", str(toml))
    await cluster.acli("deploy", "--image", "exec:" + quote(SERVE, safe=""), "--env", ENV)
    async with cluster.state() as (_, view):
        env = env_by_name(view, "production")
        assert env is not None
        env_id = env.meta.id

        def cold() -> bool:
            e = view.env(env_id)
            return e is not None and e.effective_replicas == 0

        # Right after cooling: the moment the count is 0, the endpoint is still routed and being stopped.
        await eventually(cold, 60, "cooled to zero after the idle window")
        assert await both_proxies(cluster) == [(200, "cold-ok\n")] * 2, cluster.log_tail()

        # Long after cooling: no replica, no endpoint, for a while.
        await eventually(cold, 60, "cooled again")
        await eventually(lambda: not running(view, env_id), 30, "the replica stopped")
        await asyncio.sleep(LONG_AFTER)  # the scenario itself: nobody asks for the env for a while
        assert cold(), "woken by something else meanwhile"
        assert await both_proxies(cluster) == [(200, "cold-ok\n")] * 2, cluster.log_tail()
