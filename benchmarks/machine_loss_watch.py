"""Per-kill diagnostics of :mod:`benchmarks.machine_loss_bench`: what a surviving machine's NATS servers saw
(their routes to the lost machine's servers, the JetStream meta leader, the state stream's leader) and what
the control plane recorded (stream leaders, lease holders, the lost replicas' replacements), each change with
the seconds since the loss. Printed after each kill, so that a slow kill's seconds can be told apart."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from typing import Any

from tests.multinode.app import replicas
from tests.multinode.harness import Machine
from tests.multinode.machines import cli_env

MONITOR = """
import json, sys, time, urllib.request
ports, out, stop = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
import os
seen = {}
with open(out, "a") as log:
    while not os.path.exists(stop):
        for port in ports:
            base = "http://127.0.0.1:" + port
            try:
                routes = json.load(urllib.request.urlopen(base + "/routez", timeout=1))
                names = sorted({r.get("remote_name", "?") for r in routes.get("routes", [])})
                jsz = json.load(urllib.request.urlopen(base + "/jsz?accounts=true&streams=true", timeout=1))
                meta = (jsz.get("meta_cluster") or {}).get("leader", "")
                leaders = {}
                for account in jsz.get("account_details") or []:
                    for stream in account.get("stream_detail") or []:
                        leaders[stream["name"]] = (stream.get("cluster") or {}).get("leader", "")
                now = {"routes": names, "meta": meta, "state": leaders.get("STATE", "?")}
            except Exception as exc:
                now = {"error": type(exc).__name__}
            if seen.get(port) != now:
                seen[port] = now
                log.write(json.dumps({"t": time.monotonic(), "port": port, **now}) + "\\n")
                log.flush()
        time.sleep(0.25)
"""


def monitor_ports(machine: Machine) -> list[str]:
    """The monitoring ports of the machine's NATS servers (from their configuration files)."""
    ports = []
    for conf in sorted(machine.data_dir.glob("control/**/*.conf")):
        found = re.search(r'^http: "127\.0\.0\.1:(\d+)"', conf.read_text(), re.MULTILINE)
        if found:
            ports.append(found.group(1))
    return ports


class Watch:
    """Watches one kill from a surviving machine; :meth:`report` is the timeline, seconds from ``lost_at``."""

    def __init__(self, survivor: Machine, tmp: str, i: int) -> None:
        self.survivor = survivor
        self.lost_at = 0.0
        self.events: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._stopfile = f"{tmp}/watch-{i}.stop"
        self._out = f"{tmp}/watch-{i}.jsonl"
        ports = monitor_ports(survivor)
        inside = ("ip", "netns", "exec", survivor.netns, "python3", "-c", MONITOR)
        self._monitor = subprocess.Popen([*inside, ",".join(ports), self._out, self._stopfile])
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def note(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    def _poll(self) -> None:
        last_leases: dict[str, str] = {}
        last_replicas = ""
        while not self._stop.wait(1.0):
            done = self.survivor.zattera("cluster", "status", "--json", env=cli_env(self.survivor))
            if done.returncode == 0:
                status = json.loads(done.stdout)
                leases = {x["loop"]: x["holder"] for x in status.get("leaders", [])}
                leases |= {f"stream {s['name']}": s.get("leader", "") for s in status.get("streams", [])}
                changed = {k: v for k, v in leases.items() if last_leases.get(k) != v}
                if changed:
                    self.note(f"leaders {changed}")
                last_leases = leases
            now = " ".join(
                sorted(
                    f"{r['node_id']}:{r['desired'].removeprefix('ASSIGNMENT_DESIRED_')}:"
                    f"{r.get('observed', {}).get('state', '-').removeprefix('INSTANCE_STATE_')}"
                    for r in replicas(self.survivor)
                )
            )
            if now and now != last_replicas:
                self.note(f"replicas {now}")
                last_replicas = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with open(self._stopfile, "w"):
            pass
        self._monitor.wait(30)

    def report(self) -> str:
        lines: list[tuple[float, str]] = list(self.events)
        try:
            with open(self._out) as f:
                for line in f:
                    seen: dict[str, Any] = json.loads(line)
                    t, port = seen.pop("t"), seen.pop("port")
                    lines.append((t, f"nats :{port} {seen}"))
        except OSError:
            pass
        return "\n".join(f"  {t - self.lost_at:+7.1f} s  {what}" for t, what in sorted(lines))


STEP_DOWN = """
import asyncio, json, ssl, sys
import nats

async def main() -> None:
    url, creds, ca, preferred, streams = sys.argv[1:6]
    tls = ssl.create_default_context(cafile=ca)
    nc = await nats.connect(url, user_credentials=creds, tls=tls)
    for stream in streams.split(","):
        body = json.dumps({"placement": {"preferred": preferred}}).encode()
        reply = await nc.request("$JS.API.STREAM.LEADER.STEPDOWN." + stream, body, timeout=10)
        print(stream, reply.data.decode())
    await nc.close()

asyncio.run(main())
"""

LED_STREAMS = "KV_zattera-state,KV_zattera-live"
"""The streams whose leader :func:`lead_on` moves: the state (every write) and the live records (liveness)."""


def lead_on(through: Machine, server: str) -> str:
    """Ask the streams of :data:`LED_STREAMS` to elect their leader on NATS server ``server`` (the worst case
    for a kill of its machine: every write waits for the election)."""
    env = cli_env(through)
    done = through.exec(
        sys.executable,
        "-c",
        STEP_DOWN,
        env["ZATTERA_NATS_URL"],
        str(through.data_dir / "control" / "security" / "creds" / "control.creds"),
        env["ZATTERA_NATS_TLS_CA"],
        server,
        LED_STREAMS,
        check=False,
    )
    return (done.stdout + done.stderr).strip()
