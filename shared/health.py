"""A running process's heartbeat file: what its container's health check reads.

A process of the process shell (shared/process.py) started with ``ZATTERA_HEALTH_FILE`` touches that file
every :data:`HEARTBEAT` seconds once it runs, while its NATS connection is up (a process without one, the
proxy, while its event loop turns), and removes it when it stops. ``sh shared/health.sh FILE`` (beside this
module) is the check compose.yaml runs: healthy when the file was touched since the previous check.
"""

from __future__ import annotations

import os
from pathlib import Path

HEARTBEAT = 5.0
"""Seconds between two touches of the heartbeat file (a health check's interval must be longer)."""
CHECK = Path(__file__).with_name("health.sh")
"""The health check script (``sh CHECK FILE``)."""


def touch(path: Path) -> None:
    """One heartbeat: create ``path`` or move its modification time to now."""
    with open(path, "ab"):
        pass
    os.utime(path)


def clear(path: Path) -> None:
    """No heartbeat: what a stopping process leaves."""
    path.unlink(missing_ok=True)
