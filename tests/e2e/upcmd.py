"""``zattera up`` as a user runs it, in a subprocess of its own process group, and the ``zattera`` command
beside it: the code of this tree by default, or another release's (``Release``, tests/upgrade)."""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.cluster import ROOT, cli_argv


@dataclass(frozen=True)
class Release:
    """Which Zattera runs: its ``zattera`` argv, the directory it runs from and what its environment adds."""

    argv: tuple[str, ...] = field(default_factory=lambda: tuple(cli_argv()))
    cwd: Path = ROOT
    env: Mapping[str, str] = field(default_factory=dict)


THIS = Release()


def listen_port() -> int:
    """A free port below the ephemeral range (32768 up), for a listener a test starts later: a port the
    kernel just handed out (``free_port``) is also what it hands to the next outgoing connection on a busy
    machine, which then holds it when the listener binds."""
    while True:
        port = random.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class Up:
    """One ``zattera up`` run as a subprocess (its own process group, as a terminal would start it)."""

    def __init__(
        self,
        data_dir: Path,
        nats_port: int,
        proxy_port: int,
        *,
        through_tee: bool = False,
        release: Release = THIS,
        options: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``through_tee``: run as ``zattera up 2>&1 | tee FILE`` in a shell (:meth:`ctrl_c_group`);
        ``options``: more ``zattera up`` options; ``env``: more variables (after every ``ZATTERA_*`` of the
        test's own is dropped)."""
        self.data_dir = data_dir
        self.nats_port = nats_port
        self.proxy_port = proxy_port
        self.release = release
        self.output = data_dir.parent / f"up-{time.monotonic_ns()}.out"
        self.env = {
            **os.environ,
            "COLUMNS": "200",
            "PYTHONUNBUFFERED": "1",
            "OTEL_TRACES_EXPORTER": "none",
        }
        for name in [k for k in self.env if k.startswith("ZATTERA_")]:
            del self.env[name]
        self.env.update(release.env)
        self.env.update(env or {})
        ports = ["--port", str(nats_port), "--proxy-port", str(proxy_port)]
        argv = [*release.argv, "up", "--data-dir", str(data_dir), *ports, *options]
        if through_tee:
            argv = ["/bin/sh", "-c", f"{shlex.join(argv)} 2>&1 | tee {shlex.quote(str(self.output))}"]
        with open(self.output, "wb") as sink:
            self.proc = subprocess.Popen(
                argv,
                cwd=release.cwd,
                env=self.env,
                stdout=subprocess.DEVNULL if through_tee else sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def ctrl_c_group(self, timeout: float = 60.0) -> None:
        """Ctrl-C as a terminal sends it: to the whole foreground group, tee included."""
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    @property
    def url(self) -> str:
        match = re.search(r"NATS:\s+(nats://\S+)", self.text())
        assert match, self.text()
        return match.group(1)

    def ctrl_c(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def cli(
        self, *args: str, timeout: float = 120.0, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``zattera ARGS`` of this run's release against its cluster (as its operator on a secured one);
        ``check``: exit status 0 asserted."""
        env = {**self.env, "ZATTERA_NATS_URL": self.url}
        creds = re.search(r"ZATTERA_NATS_CREDS=(\S+)", self.text().replace("\n", ""))
        if creds:
            env["ZATTERA_NATS_CREDS"] = creds.group(1)
        done = subprocess.run(
            [*self.release.argv, *args],
            cwd=self.release.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            input=stdin,
        )
        if check:
            assert done.returncode == 0, f"zattera {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done
