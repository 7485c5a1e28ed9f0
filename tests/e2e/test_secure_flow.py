"""The end-to-end flow on a secured cluster (as ``zattera up --secure``): every process with its own
credential in its role's account — agents pull their view from control and write through the relay, the
proxy follows route snapshots and asks for activations through imports, the CLI runs as the operator.

The flow's tests are collected again here, on this module's secured cluster: deploy from source (a build on
the builder node), red/green redeploy under load, rollback, scale-to-zero and the wake on a request.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import E2ECluster
from tests.e2e.conftest import running
from tests.e2e.test_flow import (  # noqa: F401 - collected here on the secured cluster
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
