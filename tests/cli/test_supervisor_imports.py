"""The supervisor ``zattera up`` execs (``python -m cli.up``) stays resident as long as the cluster runs: it must not
load the proxy or its settings (pydantic-settings), nor nats-py (it provisions from a short-lived child): together
~50 MB (PERFORMANCE.md, "footprint")."""

from __future__ import annotations

import subprocess
import sys

NOT_AT_IDLE = ("pydantic_settings", "services.proxy.server", "services.proxy.settings", "nats", "aiohttp", "asyncio")


def test_the_supervisor_loads_neither_the_proxy_nor_nats() -> None:
    probe = "import sys, cli.up; print('\\n'.join(sorted(sys.modules)))"
    listed = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    loaded = set(listed.split())
    assert not loaded & set(NOT_AT_IDLE)
