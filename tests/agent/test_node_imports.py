"""The agent and the proxy run on every machine for as long as it is in the cluster: what they import at start
stays resident. The cryptography library (~7 MB resident) is loaded only by the work that needs it (a sealed
volume snapshot, a fallback certificate made in a short-lived child), never at start; nor are aiohttp (~11 MB:
a build's URL source, the proxy's HTTP side behind HAProxy at its first held connection, a ``ws://`` NATS URL)
and the Docker client (a node whose Docker daemon may answer) (PERFORMANCE.md, "A lighter node")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NOT_AT_START = ("cryptography", "aiohttp", "aiodocker", "multidict", "yarl")


@pytest.mark.parametrize("module", ["services.agent.__main__", "services.proxy.__main__"])
def test_node_processes_start_without_cryptography_aiohttp_or_the_docker_client(module: str) -> None:
    probe = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    )
    assert "services.agent.mesh" in loaded or "services.proxy.haproxy_certs" in loaded  # the probe imported the process
    assert not {name for name in loaded if name.split(".")[0] in NOT_AT_START}


def test_a_node_without_a_docker_socket_runs_processes_without_loading_the_docker_client(tmp_path: Path) -> None:
    probe = (
        "import asyncio, sys\n"
        "from shared.lean import import_nats\n"
        "import_nats()\n"
        "from services.agent.runtime_choice import choose_launcher\n"
        "from services.agent.settings import AgentSettings\n"
        f"settings = AgentSettings(node_id='x', runtime='', docker_host='unix://{tmp_path}/no.sock')\n"
        "choice = asyncio.run(choose_launcher(settings))\n"
        "print(choice.launcher.name, 'aiodocker' in sys.modules, 'aiohttp' in sys.modules)\n"
        "print(choice.reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.splitlines()
    missing = f"unix://{tmp_path}/no.sock"
    assert out == [
        "process False False",
        f"no Docker daemon answers at {missing}: apps run as processes, without containers' memory and CPU limits",
    ]


def test_settle_hands_the_heap_back_and_freezes_what_lives_on() -> None:
    probe = (
        "import gc\n"
        "from shared.lean import import_nats, settle\n"
        "import_nats()\n"
        "import services.proxy.__main__\n"
        "settle()\n"
        "print(gc.get_freeze_count() > 0, gc.isenabled())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["True", "True"]
