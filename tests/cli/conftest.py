from __future__ import annotations

import pytest

from tests.cli.rig import Invoke, initialised_cli


@pytest.fixture
def cli(nats_url: str) -> Invoke:
    return initialised_cli(nats_url)
