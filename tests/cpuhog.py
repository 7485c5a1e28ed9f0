"""CPU pressure for tests that must hold on a busy machine: one busy-looping process per core, at the same
priority as everything else, started and stopped by the test (``with cpu_hog(): ...``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def cpu_hog(processes: int | None = None) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Saturate every core (or ``processes`` of them) until the block ends; the hogs are killed on exit."""
    count = processes or os.cpu_count() or 1
    hogs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
