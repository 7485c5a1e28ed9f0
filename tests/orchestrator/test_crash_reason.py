"""A failed deployment's error names the failed instance, how its process ended and its last stderr lines."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.orchestrator.model import deployment_of, failed_instance_reason
from tests.orchestrator.test_phases import T0, place_green, red_green_board


def crashed(a: pb.Assignment, *, code: int = 3, signal: int = 0, tail: tuple[str, ...] = ()) -> pb.Assignment:
    out = pb.Assignment()
    out.CopyFrom(a)
    out.observed.state = pb.INSTANCE_STATE_FAILED
    out.observed.last_exit.stderr_tail.extend(tail)
    if signal:
        out.observed.last_exit.signal = signal
        out.observed.last_exit.oom_suspected = signal == 9
    else:
        out.observed.last_exit.code_known = True
        out.observed.last_exit.code = code
    return out


def test_the_deployment_error_carries_the_exit_and_the_stderr_tail() -> None:
    b = red_green_board()
    green = place_green(b)
    failed = crashed(green[1], tail=("starting", "fatal: DATABASE_URL not set"))
    b.state.observe(failed.node_id, failed.meta.id, failed.observed)
    t = b.decide(T0 + 5)
    assert t is not None and deployment_of(t).phase == pb.DEPLOYMENT_PHASE_FAILED
    assert deployment_of(t).error == (
        f"a green instance failed to start: instance {failed.meta.id} on {failed.node_id}: exit code 3; "
        "last stderr: starting | fatal: DATABASE_URL not set"
    )


def test_reason_table() -> None:
    base = pb.Assignment(node_id="n1")
    base.meta.id = "I1"
    many = tuple(f"line {i}" for i in range(8))
    long_line = ("x" * 500,)
    unreported = pb.Assignment()
    unreported.CopyFrom(base)
    unreported.observed.state = pb.INSTANCE_STATE_FAILED
    with_message = pb.Assignment()
    with_message.CopyFrom(unreported)
    with_message.observed.message = "image: not found"
    cases = [
        ([crashed(base, signal=9)], "R: instance I1 on n1: killed by SIGKILL (likely out of memory)"),
        ([crashed(base, tail=many)], "R: instance I1 on n1: exit code 3; last stderr: " + " | ".join(many[-5:])),
        ([crashed(base, tail=long_line)], "R: instance I1 on n1: exit code 3; last stderr: " + "x" * 200),
        ([unreported], "R"),
        ([with_message], "R: instance I1 on n1: image: not found"),
        ([base], "R"),
    ]
    for instances, expected in cases:
        assert failed_instance_reason("R", instances) == expected
