"""The end-to-end flow on a secured cluster (as ``zattera up --secure``): every process with its own
credential in its role's account — agents pull their view from control and write through the relay, the
proxy follows route snapshots and asks for activations through imports, the CLI runs as the operator.

The flow's tests are collected again here, on this module's secured cluster: deploy from source (a build on
the builder node), red/green redeploy under load, rollback, scale-to-zero and the wake on a request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import ROOT, E2ECluster, cli_argv
from tests.e2e.conftest import running
from tests.e2e.test_flow import (  # noqa: F401 - collected here on the secured cluster
    PROD,
    sources,
    test_deploy_from_source_is_served_through_the_proxy,
    test_red_green_redeploy_under_load_fails_no_request,
    test_rollback_returns_to_the_previous_release,
    test_scale_to_zero_after_idle_and_wake_on_request,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    yield from running(E2ECluster(tmp_path_factory.mktemp("e2e-secure"), secure=True))


async def _first_followed_line(cluster: E2ECluster, *args: str) -> dict[str, object]:
    """The first JSON line a following command prints; it is still following (running) afterwards."""
    proc = await asyncio.create_subprocess_exec(
        *cli_argv(),
        *args,
        cwd=ROOT,
        env=cluster.cli_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line, (await proc.communicate())[1].decode()
        assert proc.returncode is None  # following, not exited
        return dict(json.loads(line))
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def test_the_operators_watches_follow_without_creating_a_consumer(cluster: E2ECluster) -> None:
    """``logs -f`` and ``events -f`` pull watches the join service opens (the operator credential has no
    CONSUMER.CREATE: tests/security/test_watches.py); ``deploy`` followed its rollout the same way above."""
    logged = await _first_followed_line(cluster, "logs", "--env", PROD, "--json", "-f")
    assert logged.get("instance")
    event = await _first_followed_line(cluster, "events", "--json", "-f", "--last", "5")
    assert event
