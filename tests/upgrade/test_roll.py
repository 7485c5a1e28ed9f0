"""``git pull && make up`` on a running single-machine cluster: the second ``zattera up`` asks the running
supervisor to roll its processes onto the code installed now and prints its progress; the control plane,
the agent and the proxy are new processes afterwards, the app's instances the same ones (nothing
redeployed, nothing restarted). Run again with nothing changed, nothing restarts. ~1 minute."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.embedded import free_port
from tests.e2e.cluster import EXAMPLE, ROOT, kill_tree_under, leftovers
from tests.e2e.upcmd import THIS, Up
from tests.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ENV = "demo/hello/production"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "data"
    kill_tree_under(tmp_path, also_matching=str(tmp_path / "data"))


def instances(up: Up) -> set[str]:
    """The app's running instances (``proc-<pid>-<start>``: one run of a replica)."""
    listed = json.loads(up.cli("ps", "--env", ENV, "--json").stdout)
    return {a["observed"].get("container_id", "") for a in listed}


def again(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``zattera up`` run a second time on the same data dir (as ``make up`` does)."""
    return subprocess.run(
        [*THIS.argv, "up", "--data-dir", str(data_dir)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("ZATTERA_")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


async def test_zattera_up_again_rolls_the_running_processes_and_keeps_the_apps(data_dir: Path) -> None:
    up = Up(data_dir, free_port(), free_port(), options=("--metrics-port", "0"))
    touched = ROOT / "cli" / "__init__.py"
    stat = touched.stat()
    try:
        await eventually(lambda: "Press Ctrl-C to stop." in up.text(), 120, "zattera up is up")
        up.cli("apps", "apply", str(EXAMPLE / "zattera.toml"))
        up.cli("deploy", str(EXAMPLE), "--env", ENV, timeout=300)
        before = instances(up)
        assert len(before) == 2 and "" not in before, before
        unchanged = again(data_dir)
        assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr
        assert "already running the code installed now: nothing restarted" in unchanged.stdout

        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # as a `git pull` would
        rolled = again(data_dir)
        assert rolled.returncode == 0, rolled.stdout + rolled.stderr
        lines = rolled.stdout.splitlines()
        for name in ("control-plane", "agent", "proxy"):
            assert any(f"{name} runs the new code" in line for line in lines), rolled.stdout
        assert lines[-1].strip().startswith("done: every process runs the code installed now"), rolled.stdout
        assert "upgrade: done:" in up.text()  # the supervisor's own terminal says so too
        await eventually(lambda: instances(up) == before, 60, "the same instances, adopted")
        assert (data_dir / "up.pid").read_text().strip() == str(up.proc.pid)

        url = up.url
        assert up.ctrl_c() == 0, up.text()
        assert leftovers(data_dir, also_matching=url) == []
    except BaseException:
        print(up.text())
        raise
    finally:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        up.kill()
