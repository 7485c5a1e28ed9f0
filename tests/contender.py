"""A lease contender process for failover tests.

Campaigns for ``lease.<loop>``; while leading it creates a key (``node.<ulid>`` named ``pid:term``)
with a fenced write every ``--write-every`` seconds, and appends one JSON line per event to ``--out``:
{"ev": "lead", "term": ..., "t": ...} at the start of a term, {"ev": "write", "term": ..., "ok": bool}
per write attempt, {"ev": "lost", "term": ...} on loss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from zattera.v1 import types_pb2 as pb

from shared.connection import connect
from shared.ids import new_id
from shared.lease import Leadership, run_while_leading
from shared.provisioning import provision
from shared.state.feed import StateView
from shared.txn import Conflict, Writer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats", required=True)
    parser.add_argument("--loop", default="contended")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--renew", type=float, default=0.3)
    parser.add_argument("--write-every", type=float, default=0.1)
    args = parser.parse_args()
    asyncio.run(run(args))


async def run(args: argparse.Namespace) -> None:
    conn = await connect(args.nats, name=f"contender-{os.getpid()}")
    await provision(conn.js)
    view = StateView(conn, name="contender")
    await view.start()
    me = f"pid{os.getpid()}"

    def log(**event: object) -> None:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n")

    async def lead(leadership: Leadership) -> None:
        term = leadership.term
        log(ev="lead", term=term)
        writer = Writer(conn, view, lease=leadership.lease)
        try:
            while True:
                node = pb.Node(name=f"{me}:{term}")
                node.meta.id = new_id()
                try:
                    await writer.commit(writer.txn().create(node))
                    log(ev="write", term=term, ok=True)
                except Conflict:
                    log(ev="write", term=term, ok=False)
                await asyncio.sleep(args.write_every)
        finally:
            log(ev="lost", term=term)

    await run_while_leading(conn, args.loop, lead, holder=me, ttl=args.ttl, renew_interval=args.renew)


if __name__ == "__main__":
    main()
