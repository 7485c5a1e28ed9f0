"""The managed Redis instance on the real server, started as the agent starts it: keys survive a clean
restart and a crash (AOF, fsync every second), the snapshot pre-hook the script leaves in the volume
takes a BGSAVE and waits for it, and the password is in no process listing or file of the volume."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.addons import spec as addon
from shared.embedded import free_port
from tests.addons.pgserver import UID, own, wait_for


@dataclass
class RedisInstance:
    root: Path
    password: str = field(default_factory=addon.new_password)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    def start(self) -> None:
        own(self.root)
        own(self.data)
        spec = addon.service_spec(addon.REDIS, "7", "cache")
        script = self.root / "zattera-addon.sh"
        script.write_text(spec.vars[addon.ENTRY_VAR])
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ZATTERA_VOLUME_DATA": str(self.data),
            "HOST": "127.0.0.1",
            "PORT_REDIS": str(self.port),
            addon.REDIS_PASSWORD: self.password,
        }
        with (self.root / "instance.log").open("ab") as out:
            self.process = subprocess.Popen(
                ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "sh", str(script)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )
        wait_for(lambda: self.cli("PING") == "PONG", 30, "redis answering")

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            ["redis-cli", "--no-auth-warning", "-h", "127.0.0.1", "-p", str(self.port), *args],
            env={"REDISCLI_AUTH": self.password, "PATH": os.environ.get("PATH", "")},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.send_signal(sig)
            self.process.wait(30)
        self.process = None


@pytest.fixture
def redis() -> Iterator[RedisInstance]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make install-system)")
    root = Path(tempfile.mkdtemp(prefix="zattera-redis-"))
    root.chmod(0o755)
    instance = RedisInstance(root / "r")
    yield instance
    instance.stop(signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def test_keys_survive_a_restart_and_a_crash(redis: RedisInstance) -> None:
    redis.start()
    assert redis.cli("SET", "a", "1") == "OK"
    redis.stop()
    redis.start()
    assert redis.cli("GET", "a") == "1"
    assert redis.cli("SET", "b", "2") == "OK"
    time.sleep(1.2)  # appendfsync everysec: what was written a second ago is on disk
    redis.stop(signal.SIGKILL)  # the whole instance, server and script, dies at once
    redis.start()
    assert (redis.cli("GET", "a"), redis.cli("GET", "b")) == ("1", "2")
    # without the password nothing is answered
    done = subprocess.run(["redis-cli", "-p", str(redis.port), "GET", "a"], capture_output=True, text=True, check=False)
    assert "NOAUTH" in done.stdout + done.stderr


def test_the_snapshot_pre_hook_takes_a_bgsave_and_no_password_leaks(redis: RedisInstance) -> None:
    redis.start()
    redis.cli("SET", "k", "v")
    hook = subprocess.run(
        ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "sh", "-c", "sh zattera-bgsave.sh"],
        cwd=redis.data,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert hook.returncode == 0, hook.stderr
    assert (redis.data / "dump.rdb").stat().st_size > 0
    # a second one in the same second completes too
    again = subprocess.run(
        ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "sh", "zattera-bgsave.sh"],
        cwd=redis.data,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert redis.password not in listing
    for path in redis.root.rglob("*"):
        if path.is_file():
            assert redis.password.encode() not in path.read_bytes(), path
