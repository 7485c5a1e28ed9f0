"""One process simulating many node agents: ``python -m tests.sim.fleet --nats URL --nodes 5000``.

Registers the nodes (few large batches), heartbeats every node into ``zattera-live`` every
``--heartbeat-every`` seconds (pipelined in chunks), and converges the assignments of all its nodes by
writing their ``observed.*`` keys (``tests.agent_sim.AgentSim``: RUN → HEALTHY, STOP → STOPPED).
Prints ``READY <nodes>`` once every node is registered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from zattera.cluster.v1 import cluster_pb2 as cpb

from shared.connection import connect
from shared.live import publish_node_heartbeat
from tests.agent_sim import AgentSim
from tests.factories import node


def node_id(prefix: str, i: int) -> str:
    return f"{prefix}{i:05d}"


async def run(args: argparse.Namespace) -> None:
    conn = await connect(args.nats, name="sim-fleet")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = await AgentSim(conn, name="sim-fleet").start()
    ids = [node_id(args.prefix, i) for i in range(args.nodes)]
    txns = []
    for n in ids:
        if agent.view.node(n) is None:
            txns.append(agent.writer.txn("register").create(node(n, cpu=args.cpu, mem=args.mem)))
    for start in range(0, len(txns), 500):
        await agent.writer.commit_many(txns[start : start + 500])
    print(f"READY {len(ids)}", flush=True)

    async def heartbeats() -> None:
        while not stop.is_set():
            for start in range(0, len(ids), 250):
                chunk = []
                for n in ids[start : start + 250]:
                    hb = cpb.Heartbeat(node_id=n, cpu_percent=3.0)
                    hb.time.GetCurrentTime()
                    chunk.append(publish_node_heartbeat(conn, hb))
                await asyncio.gather(*chunk, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.heartbeat_every)

    beating = asyncio.create_task(heartbeats())
    await stop.wait()
    beating.cancel()
    await agent.stop()
    await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats", required=True)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--prefix", default="sim-")
    parser.add_argument("--cpu", type=int, default=16000)
    parser.add_argument("--mem", type=int, default=65536)
    parser.add_argument("--heartbeat-every", type=float, default=5.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
