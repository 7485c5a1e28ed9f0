"""The agent and the proxy run on every machine for as long as it is in the cluster: what they import at start
stays resident. The cryptography library (~7 MB resident) is loaded only by the work that needs it (a sealed
volume snapshot, a fallback certificate made in a short-lived child), never at start (PERFORMANCE.md,
"A lighter node")."""

from __future__ import annotations

import subprocess
import sys

import pytest

NOT_AT_START = ("cryptography",)


@pytest.mark.parametrize("module", ["services.agent.__main__", "services.proxy.__main__"])
def test_node_processes_start_without_cryptography(module: str) -> None:
    probe = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    )
    assert "services.agent.mesh" in loaded or "services.proxy.haproxy_certs" in loaded  # the probe imported the process
    assert not {name for name in loaded if name.split(".")[0] in NOT_AT_START}
