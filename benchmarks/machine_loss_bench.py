"""Machine loss on a cluster of machines in network namespaces (issue 34): three server machines
(``--secure --tls``, every stream at three copies: ``tests/multinode/machines.py``), an app of three replicas
spread over them, a client sending requests one at a time through two machines' proxies; then, kill after kill,
a whole server machine (m2 or m3, the one holding more replicas; the first machine's three JetStream seats are
not retired yet, docs/cluster.md) SIGKILLed with its link cut, brought back as a reboot would (its
``zattera up`` again, same data dir), and the next kill once it is back. Per kill:

* the survivors' first control-plane write: an operator write (``zattera nodes label``, the CLI in a surviving
  machine, its own start included: ~0.5 s) retried from the kill until one is acknowledged;
* the loss detected: the node marked DOWN (the liveness timeout, 30 s by default);
* the lost replicas replaced and serving elsewhere, measured from the detection;
* requests failed per kill, of those the client sent meanwhile (one at a time, every 20 ms).

Targets (issue 34): control-plane write p99 ≤ 10 s; replicas replaced and serving p99 ≤ 30 s after the loss
is detected. ``python -m benchmarks.machine_loss_bench [--full]``: quick, 2 kills (~8 min); full, 10 kills
(~25 min). Needs root and ``ip netns``, ``wg`` and kernel WireGuard or wireguard-go.

``ZATTERA_BENCH_KILLS=N``: N kills instead. ``ZATTERA_BENCH_VICTIM_LEADS=1``: before each kill, the state and
live streams elect their leader on the machine about to be killed (the worst case for the first write). Each
kill prints its timeline as seen from the first machine (``benchmarks/machine_loss_watch.py``): its servers'
routes and meta leader, the streams' leaders and the leases' holders, each CLI attempt, the replicas.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import Row, bench_main, percentile, row
from benchmarks.machine_loss_watch import LED_STREAMS, Watch, lead_on
from tests.multinode.app import CLIENT, deploy_three_replicas, node_status, serving_on
from tests.multinode.harness import Machine, Network, unavailable
from tests.multinode.machines import COMMON, cli_env, servers, three_servers
from tests.waiting import eventually_sync


def first_write(writer: Machine, started: float, i: int, watch: Watch, timeout: float = 120.0) -> float:
    """Seconds from ``started`` until an operator write through ``writer`` is acknowledged."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch.note("write: CLI started")
        done = writer.zattera("nodes", "label", writer.name, f"bench-kill={i}", env=cli_env(writer))
        said = (done.stderr.strip().splitlines() or [""])[-1][:200]
        watch.note(f"write: CLI exited {done.returncode} {said}")
        if done.returncode == 0:
            return time.monotonic() - started
    raise AssertionError(f"no write acknowledged within {timeout}s of the loss")


def run(quick: bool = True) -> list[Row]:
    why = unavailable()
    if why:
        raise RuntimeError(f"machine_loss_bench needs machines in namespaces: {why}")
    kills = int(os.environ.get("ZATTERA_BENCH_KILLS", 0)) or (2 if quick else 10)
    writes: list[float] = []
    detected: list[float] = []
    replaced: list[float] = []
    failed: list[int] = []
    sent: list[int] = []
    with tempfile.TemporaryDirectory(prefix="zattera-loss-bench-") as tmp:
        network = Network(Path(tmp))
        try:
            m1, m2, m3 = three_servers(network)
            deploy_three_replicas(m1, timeout=240)
            for i in range(kills):
                spread = serving_on(m1)
                victim = max((m2, m3), key=lambda m: spread.get(m.name, 0))
                survivor = m3 if victim is m2 else m2
                stop, out = Path(tmp) / f"client-{i}.stop", Path(tmp) / f"client-{i}.json"
                client = subprocess.Popen(
                    [
                        *("ip", "netns", "exec", m1.netns, "python3", "-c", CLIENT),
                        f"{m1.address},{survivor.address}",
                        str(stop),
                        str(out),
                    ]
                )
                if os.environ.get("ZATTERA_BENCH_VICTIM_LEADS"):
                    print(f"leaders of {LED_STREAMS} onto {victim.name}: {lead_on(m1, victim.name)}", flush=True)
                watch = Watch(m1, tmp, i)
                try:
                    time.sleep(3)  # steady traffic before the loss (the client's pace, not a product timer)
                    lost_at = watch.lost_at = time.monotonic()
                    victim.kill_all()
                    victim.link(False)
                    watch.note(f"{victim.name} killed, link cut")
                    writes.append(first_write(m1, lost_at, i, watch))
                    eventually_sync(
                        lambda v=victim: node_status(m1, v.name) == "NODE_STATUS_DOWN", timeout=120, what="down"
                    )
                    down_at = time.monotonic()
                    watch.note("node DOWN")
                    detected.append(down_at - lost_at)
                    eventually_sync(
                        lambda v=victim: sum(n for node, n in serving_on(m1).items() if node != v.name) == 3,
                        timeout=180,
                        what="the lost replicas serving on the other machines",
                    )
                    replaced.append(time.monotonic() - down_at)
                    watch.note("lost replicas serving elsewhere")
                finally:
                    stop.touch()
                    client.wait(60)
                    watch.stop()
                    print(f"kill {i + 1} timeline (from {m1.name}):\n{watch.report()}", flush=True)
                seen = json.loads(out.read_text())
                failed.append(int(seen["failed"]))
                sent.append(int(seen["ok"]) + int(seen["failed"]))
                print(
                    f"kill {i + 1} ({victim.name}): write {writes[-1]:.1f} s, down {detected[-1]:.1f} s, "
                    f"replaced {replaced[-1]:.1f} s after, {failed[-1]} of {sent[-1]} requests failed",
                    flush=True,
                )
                victim.link(True)
                victim.start("--secure", "--tls", *COMMON)
                eventually_sync(
                    lambda v=victim: node_status(m1, v.name) == "NODE_STATUS_ALIVE", timeout=240, what="back"
                )
                eventually_sync(lambda: servers(m1) == 5, timeout=180, what="its NATS server back")
        finally:
            network.close()
    per_kill = " / ".join(f"{w:.1f}" for w in writes)
    return [
        row(f"machine loss → first operator write acknowledged, p50 ({kills} kills)", percentile(writes, 50), "s"),
        row("machine loss → first operator write acknowledged, p99", percentile(writes, 99), "s", "≤ 10 s", per_kill),
        row("machine loss → node marked DOWN, p50", percentile(detected, 50), "s", "", "liveness timeout 30 s"),
        row("DOWN → lost replicas serving elsewhere, p50", percentile(replaced, 50), "s"),
        row(
            "DOWN → lost replicas serving elsewhere, p99",
            percentile(replaced, 99),
            "s",
            "≤ 30 s",
            " / ".join(f"{r:.1f}" for r in replaced),
        ),
        row(
            "requests failed per kill (one at a time every 20 ms)",
            max(failed) if failed else 0,
            "max",
            "",
            " / ".join(f"{f} of {s}" for f, s in zip(failed, sent, strict=True)),
        ),
    ]


if __name__ == "__main__":
    bench_main("Machine loss on machines in namespaces", run, __doc__, "10 kills instead of 2")
