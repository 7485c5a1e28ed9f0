"""A removal asked again (same request id) gets its first asking's answer and runs once: the join bucket's
records on a real NATS server; the asking side sends again while no answer came."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.kv import KeyValue

from shared.connection import Connection
from shared.errors import ZatteraError
from shared.security.join import ensure_join_bucket
from shared.security.machine_service import Machines, at_step
from shared.security.membership import issued_keys
from shared.security.removal_answers import RecordedAnswers, ask_removal, new_request_id
from tests.waiting import eventually


@pytest.fixture
async def kv(conn: Connection) -> KeyValue:
    return await ensure_join_bucket(conn)


class Removal:
    """A removal that counts its runs and finishes when told."""

    def __init__(self, answer: dict[str, Any] | Exception) -> None:
        self.answer = answer
        self.runs = 0
        self.go = asyncio.Event()
        self.go.set()

    async def __call__(self) -> dict[str, Any]:
        self.runs += 1
        await self.go.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_asked_again_the_first_answer_is_read_not_run_again(kv: KeyValue) -> None:
    answers = RecordedAnswers(kv, wait=5)
    removal = Removal({"node_id": "m4", "revoked": ["UA1"]})
    request_id = new_request_id()
    assert await answers.once(request_id, removal) == {"node_id": "m4", "revoked": ["UA1"]}
    assert await answers.once(request_id, removal) == {"node_id": "m4", "revoked": ["UA1"], "repeated": True}
    assert removal.runs == 1
    other = new_request_id()  # the command run again: a new id, a new removal
    assert "repeated" not in await answers.once(other, removal)
    assert removal.runs == 2
    assert await issued_keys(kv, "m4") == [], "the records are no tokens"


async def test_asked_again_while_the_first_runs_waits_for_its_answer(kv: KeyValue) -> None:
    removal = Removal({"node_id": "m4"})
    removal.go.clear()
    request_id = new_request_id()
    first = asyncio.create_task(RecordedAnswers(kv, wait=30).once(request_id, removal))
    await eventually(lambda: removal.runs == 1, what="the first asking running")
    polled = asyncio.Event()

    async def pause(seconds: float) -> None:
        polled.set()
        await asyncio.sleep(seconds)

    second = asyncio.create_task(RecordedAnswers(kv, wait=30, pause=pause).once(request_id, removal))
    await asyncio.wait_for(polled.wait(), 10)  # it read the record running, and waits
    assert not second.done() and removal.runs == 1
    removal.go.set()
    assert await first == {"node_id": "m4"}
    assert await second == {"node_id": "m4", "repeated": True}
    assert removal.runs == 1


async def test_a_refusal_is_recorded_and_a_nats_failure_is_not(kv: KeyValue) -> None:
    answers = RecordedAnswers(kv, wait=5)
    refused = Removal(ZatteraError("removing m3 would leave 2 server machine(s)"))
    request_id = new_request_id()
    for _ in range(2):
        with pytest.raises(ZatteraError, match="would leave 2 server machine"):
            await answers.once(request_id, refused)
    assert refused.runs == 1
    failed = Removal(TimeoutError("nats: timeout"))
    lost = new_request_id()
    with pytest.raises(TimeoutError):
        await answers.once(lost, failed)
    failed.answer = {"node_id": "m4"}
    assert await answers.once(lost, failed) == {"node_id": "m4"}, "the record went: asked again, run again"
    assert failed.runs == 2


async def test_a_first_asking_that_never_ends_is_waited_for_a_bounded_time(kv: KeyValue) -> None:
    now = [0.0]

    async def pause(seconds: float) -> None:
        now[0] += seconds

    request_id = new_request_id()
    await kv.create(f"removal.{request_id}", json.dumps({"state": "running"}).encode())  # its service died
    answers = RecordedAnswers(kv, wait=110, pause=pause, monotonic=lambda: now[0])
    removal = Removal({"node_id": "m4"})
    with pytest.raises(ZatteraError, match="still running after 110 s"):
        await answers.once(request_id, removal)
    assert removal.runs == 0 and now[0] > 110


async def test_a_malformed_request_id_is_refused(kv: KeyValue) -> None:
    with pytest.raises(ZatteraError, match="request_id"):
        await RecordedAnswers(kv, wait=5).once("a.b", Removal({}))


async def test_the_asking_side_sends_again_with_the_same_id_while_no_answer_came(conn: Connection) -> None:
    seen: list[dict[str, Any]] = []

    async def answer_the_second(msg: Msg) -> None:  # the first answer lost on its way back
        seen.append(json.loads(msg.data))
        if len(seen) >= 2:
            await msg.respond(json.dumps({"node_id": "m4", "asked": len(seen)}).encode())

    sub = await conn.nc.subscribe("test.removal", cb=answer_the_second)
    try:
        data = await ask_removal(conn.nc, "test.removal", {"node_id": "m4"}, timeout=10, every=0.2)
    finally:
        await sub.unsubscribe()
    assert json.loads(data) == {"node_id": "m4", "asked": 2}
    assert seen[0] == seen[1] and seen[0]["node_id"] == "m4" and len(seen[0]["request_id"]) == 32
    with pytest.raises(NoRespondersError):
        await ask_removal(conn.nc, "test.removal", {"node_id": "m4"}, timeout=10, every=0.2)
    silent = await conn.nc.subscribe("test.silent")
    try:
        with pytest.raises(TimeoutError):
            await ask_removal(conn.nc, "test.silent", {"node_id": "m4"}, timeout=0.5, every=0.2)
    finally:
        await silent.unsubscribe()


async def test_a_removal_past_its_bound_is_cut_naming_its_step_and_asking_again_runs_it(
    conn: Connection, kv: KeyValue, tmp_path: Path
) -> None:
    machines = Machines(conn, "", tmp_path, answer_within=0.0)
    stuck = asyncio.Event()  # never set: a request that hangs past every bound of its own

    async def hanging() -> dict[str, Any]:
        async with machines.bounded("removing m4", grace=0.05):
            at_step("peer-removing its servers m4")
            at_step("waiting for every stream's copies on the servers left")
            await stuck.wait()
        return {}

    answers = RecordedAnswers(kv, wait=5)
    request_id = new_request_id()
    cut = "removing m4 was cut after 0 s while waiting for every stream's copies on the servers left"
    with pytest.raises(TimeoutError, match=cut):
        await answers.once(request_id, hanging)
    removal = Removal({"node_id": "m4"})
    assert await answers.once(request_id, removal) == {"node_id": "m4"}, "a cut removal is not recorded"
    assert removal.runs == 1

    async def own_timeout() -> dict[str, Any]:
        async with machines.bounded("removing m5"):
            at_step("pushing the revocations to the servers")
            raise TimeoutError("a request of its own")

    with pytest.raises(TimeoutError, match=r"^a request of its own$"):
        await own_timeout()
