from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.badinput.rig import Rig


@pytest.fixture(scope="session")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("badinput")).start()
    try:
        yield r
    finally:
        r.stop()
