"""``git push`` of a small Flask app (examples/flask) → the new commit serving through the proxy (issue 37).

One ``zattera up`` (its own data dir and free ports, every setting its default), the example applied with
``git_branch = "main"`` and a console user. A first push builds the app with its dependencies (cold: pip
installs Flask and gunicorn). Then each warm push changes the text ``/`` answers, commits, and times
``git push`` (build from the cached dependency layer, rollout, promotion: the push returns once the deploy
is live) and the moment the proxy answers with the new text.

``python -m benchmarks.git_bench [--full]``: quick, 3 warm pushes (~1.5 min with the cluster's start);
full, 10.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import Row, bench_main, percentile, row
from shared.embedded import free_port
from tests.e2e.cluster import ROOT, kill_tree_under
from tests.e2e.upcmd import Up, listen_port
from tests.waiting import eventually

HOST = "flask.localhost"
ENV = "demo/flask/production"
PASSWORD = "bench-push-password"
TARGET = 5.0


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cwd.parent),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "Bench",
        "GIT_AUTHOR_EMAIL": "bench@example.com",
        "GIT_COMMITTER_NAME": "Bench",
        "GIT_COMMITTER_EMAIL": "bench@example.com",
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}")
    return done


def _answer(proxy_port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/", headers={"Host": HOST})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.read().decode(errors="replace")
    except OSError:
        return ""


def _until_serves(proxy_port: int, text: str, timeout: float = 120.0) -> float:
    """Seconds until the proxy answers ``text`` (polled every 20 ms)."""
    started = time.monotonic()
    while text not in _answer(proxy_port):
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{HOST} did not answer {text!r} within {timeout:g}s")
        time.sleep(0.02)
    return time.monotonic() - started


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def run(quick: bool = True) -> list[Row]:
    pushes = 3 if quick else 10
    with tempfile.TemporaryDirectory(prefix="zattera-git-bench-") as tmp:
        root = Path(tmp)
        data_dir = root / "data"
        console_port = listen_port()
        up = Up(data_dir, free_port(), free_port(), env={"ZATTERA_CONSOLE_PORT": str(console_port)})
        try:
            asyncio.run(eventually(lambda: "Press Ctrl-C to stop." in up.text(), 120, "zattera up is up"))
            work = root / "flask"
            shutil.copytree(ROOT / "examples" / "flask", work)
            with open(work / "zattera.toml", "a") as fh:
                fh.write('git_branch = "main"\n')
            _git(work, "init", "-q", "-b", "main")
            up.cli("apps", "apply", str(work / "zattera.toml"))
            # The console creates its users bucket and records its URL once it runs.
            asyncio.run(
                eventually(lambda: up.cli("git", "remote", "--env", ENV, check=False).returncode == 0, 60, "console")
            )
            up.cli("console", "add-user", "bench", "--role", "admin", stdin=PASSWORD + "\n")
            remote = f"http://bench:{PASSWORD}@127.0.0.1:{console_port}/git/demo/flask.git"

            def push(n: int) -> tuple[float, float]:
                text = f"hello from flask, push {n}"
                app = work / "app.py"
                lines = app.read_text().splitlines()
                at = next(i for i, line in enumerate(lines) if "hello from flask" in line)
                lines[at] = f'    return "{text}\\n"'
                app.write_text("\n".join(lines) + "\n")
                _git(work, "add", "-A")
                _git(work, "commit", "-qm", f"push {n}")
                started = time.monotonic()
                _git(work, "push", "-q", remote, "HEAD:refs/heads/main")
                pushed = time.monotonic() - started
                served = pushed + _until_serves(up.proxy_port, text)
                _progress(f"push {n}: git push {pushed:.2f}s, serving {served:.2f}s")
                return pushed, served

            _, cold_served = push(0)
            warm = [push(n) for n in range(1, pushes + 1)]
            # The same with a release phase: a command run to its end before the green replicas are placed.
            with open(work / "zattera.toml", "a") as fh:
                fh.write('release_command = "echo migrated"\n')
            up.cli("apps", "apply", str(work / "zattera.toml"))
            released = [push(n) for n in range(pushes + 1, 2 * pushes + 1)]
        finally:
            up.kill()
            kill_tree_under(data_dir, also_matching=str(data_dir))
    served = [s for _, s in warm]
    returned = [p for p, _ in warm]
    return [
        row("git push (cold: pip install) → new commit serving", cold_served, "s", "", "first push of the app"),
        row(
            f"git push (warm) → new commit serving, median of {len(served)}",
            statistics.median(served),
            "s",
            f"≤ {TARGET:g}",
            "build from the cached layer, release, rollout, promotion, proxy",
        ),
        row(f"git push (warm) → new commit serving, max of {len(served)}", max(served), "s", f"≤ {TARGET:g}"),
        row("git push (warm): the push itself returns, p50", percentile(returned, 50), "s", "", "waits for live"),
        row(
            f"git push (warm, release_command) → new commit serving, median of {len(released)}",
            statistics.median([s for _, s in released]),
            "s",
            f"≤ {TARGET:g}",
            "`echo migrated` as the release phase",
        ),
    ]


def main() -> None:
    bench_main("git push → serving", run, __doc__, "10 warm pushes")


if __name__ == "__main__":
    main()
