"""A server that stops answering on its routes (its machine lost with the link cut: the connections stay
open, nothing comes back) is dropped by the other servers within seconds, with its subscriptions: a request
to a subscriber that was only there then finds "no responders" instead of timing out (what a lease's probe
relies on, ``shared.lease``). Real nats-server cluster; the lost machine is a server stopped with SIGSTOP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request

import nats.errors
import pytest
from nats.aio.msg import Msg

from shared.connection import connect
from shared.embedded import EmbeddedNats
from tests.waiting import eventually_sync

DROPPED_WITHIN = 10.0
"""nats-server's defaults (a ping every 2 min, 2 unanswered) keep such a route for minutes."""


def route_names(server: EmbeddedNats) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/routez", timeout=2) as resp:
        return {r.get("remote_name", "") for r in json.loads(resp.read()).get("routes", [])}


async def test_a_server_that_stopped_answering_is_dropped_with_its_subscriptions_within_seconds(
    stoppable_cluster: list[EmbeddedNats],
) -> None:
    survivor, _, lost = stoppable_cluster
    eventually_sync(lambda: lost.name in route_names(survivor), timeout=30, what="the full mesh")
    holder = await connect(lost.url, name="holder-on-the-lost-server")
    asker = await connect(survivor.url, name="asker")
    try:

        async def here(msg: Msg) -> None:
            await msg.respond(b"here")

        await holder.nc.subscribe("probe.holder", cb=here)
        await holder.nc.flush()

        async def answered() -> bool:
            try:
                return (await asker.nc.request("probe.holder", b"", timeout=1)).data == b"here"
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                return False

        deadline = time.monotonic() + 10
        while not await answered():
            assert time.monotonic() < deadline, "the holder's interest never reached the asker's server"

        assert lost.pid is not None
        os.kill(lost.pid, signal.SIGSTOP)  # its connections stay open; nothing it receives is answered
        stopped = time.monotonic()
        eventually_sync(
            lambda: lost.name not in route_names(survivor),
            timeout=DROPPED_WITHIN,
            what="the stopped server's route dropped",
        )
        took = time.monotonic() - stopped
        with pytest.raises(nats.errors.NoRespondersError):
            await asker.nc.request("probe.holder", b"", timeout=2)
        assert took < DROPPED_WITHIN
    finally:
        await asker.close()
        with contextlib.suppress(Exception):
            await holder.nc.close()
