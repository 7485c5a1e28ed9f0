"""Machines in network namespaces (harness.py): skipped with the reason where the machine does not allow them,
a failure in CI (``CI=true``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multinode.harness import Network, unavailable


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    why = unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"machines in namespaces: {why}")
        pytest.skip(f"machines in namespaces: {why}")
    net = Network(Path(tmp_path_factory.mktemp("machines")))
    try:
        yield net
    finally:
        net.close()
