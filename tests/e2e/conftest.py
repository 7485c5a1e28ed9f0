"""Fixtures of the end-to-end tests: one shared cluster per module, its logs attached to any failure."""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests.e2e.cluster import E2ECluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    yield from running(E2ECluster(tmp_path_factory.mktemp("e2e")))


def running(c: E2ECluster) -> Iterator[E2ECluster]:
    """Start ``c``, wait until it serves, yield it, stop it (its logs in the error if it never came up)."""
    try:
        c.start()
        try:
            asyncio.run(c.wait_ready())
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"the e2e cluster did not come up: {exc!r}\n{c.log_tail()}") from None
        yield c
    finally:
        c.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        funcargs = getattr(item, "funcargs", {})
        c = funcargs.get("cluster")
        if isinstance(c, E2ECluster) and c.logs.exists():
            report.sections.append(("cluster logs (last lines)", c.log_tail()))
