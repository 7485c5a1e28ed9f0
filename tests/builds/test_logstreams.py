"""The log-streams loop: one stream per environment, sized by its retention, gone with the environment."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NotFoundError
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from services.builds.logstreams import LogStreams, plan_log_streams
from shared import keys as K
from shared.applogs import LogLimits, app_log_subject, app_logs_stream
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests.factories import env

DEFAULT = LogLimits(max_bytes=8 * 1024 * 1024, max_age=3600.0)


def with_logs(e: pb.Environment, max_bytes: int = 0, max_age: float = 0.0) -> pb.Environment:
    e.logs.max_bytes = max_bytes
    if max_age:
        e.logs.max_age.FromMilliseconds(int(max_age * 1000))
    return e


@pytest.mark.parametrize(
    ("envs", "existing", "upserts", "deletes"),
    [
        ([env("e1")], {}, {"e1": DEFAULT}, []),
        ([env("e1")], {"e1": DEFAULT}, {}, []),
        ([with_logs(env("e1"), 1 << 20)], {"e1": DEFAULT}, {"e1": LogLimits(1 << 20, 3600.0)}, []),
        ([with_logs(env("e1"), max_age=60.0)], {}, {"e1": LogLimits(DEFAULT.max_bytes, 60.0)}, []),
        ([], {"gone": DEFAULT}, {}, ["gone"]),
        # limits that are not positive (garbage: apps apply refuses them) count as unset, not as a stream
        # the server refuses ("max age can not be negative") on every pass
        ([with_logs(env("e1"), max_age=-2.0)], {}, {"e1": DEFAULT}, []),
    ],
    ids=["new env", "unchanged", "bytes override", "age override", "env gone", "negative age is unset"],
)
def test_plan(
    envs: list[pb.Environment], existing: dict[str, LogLimits], upserts: dict[str, LogLimits], deletes: list[str]
) -> None:
    plan = plan_log_streams(envs, existing, DEFAULT)
    assert plan.upserts == upserts
    assert plan.deletes == deletes


async def test_streams_follow_the_envs_and_the_byte_limit_is_enforced(
    conn: Connection, view: StateView, writer: Writer
) -> None:
    small = with_logs(env("E2"), max_bytes=1024 * 1024, max_age=600.0)
    await writer.commit(writer.txn().put(env("E1")).put(small))
    loop = LogStreams(LoopDeps(conn, view, FakeClock()), default=DEFAULT, replicas=1)
    await loop.pass_once()

    first = await conn.js.stream_info(app_logs_stream("E1"))
    assert (first.config.max_bytes, first.config.max_age) == (DEFAULT.max_bytes, DEFAULT.max_age)
    second = await conn.js.stream_info(app_logs_stream("E2"))
    assert (second.config.max_bytes, second.config.max_age) == (1024 * 1024, 600.0)

    line = pb.LogLine(line="x" * 1000, stream="stdout")
    batch = cpb.InstanceLogBatch(environment_id="E2", instance_id="I1", lines=[line] * 60).SerializeToString()
    await asyncio.gather(*(conn.js.publish(app_log_subject("E2", "I1"), batch) for _ in range(40)))  # ~2.4 MB
    info = await conn.js.stream_info(app_logs_stream("E2"))
    assert 0 < info.state.bytes <= 1024 * 1024
    assert info.state.first_seq > 1  # the oldest went first

    await writer.commit(writer.txn().delete(K.env("E2")))
    await loop.pass_once()
    with pytest.raises(NotFoundError):
        await conn.js.stream_info(app_logs_stream("E2"))
    await conn.js.stream_info(app_logs_stream("E1"))
