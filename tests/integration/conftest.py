"""Fixtures of the integration tests: a three-server cluster whose servers a test may SIGSTOP (a machine lost
with its link cut), always continued and killed at the end."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.embedded import EmbeddedNats, start_cluster, wait_meta_group


@pytest.fixture
def stoppable_cluster(tmp_path: Path) -> Iterator[list[EmbeddedNats]]:
    servers = start_cluster(tmp_path, 3, name="stoppable")
    wait_meta_group(servers)
    try:
        yield servers
    finally:
        for server in servers:
            if server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGCONT)
            server.kill()
