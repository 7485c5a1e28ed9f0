from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from tests.badinput.rig import Rig

_rig: Rig | None = None


@pytest.fixture(scope="session")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    global _rig
    r = Rig(tmp_path_factory.mktemp("badinput")).start()
    _rig = r
    try:
        yield r
    finally:
        _rig = None
        r.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the tail of every rig process's log and of the nats-server's."""
    report: pytest.TestReport = yield
    if report.failed and _rig is not None:
        for name in _rig.procs:
            report.sections.append((f"rig log: {name}", _rig.log(name)[-4000:]))
        nats_log = _rig.base / "nats" / "nats.log"
        if nats_log.exists():
            report.sections.append(("rig log: nats-server", nats_log.read_text(errors="replace")[-4000:]))
    return report
