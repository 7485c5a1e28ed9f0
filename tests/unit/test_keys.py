from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from tests.factories import assignment


def test_per_node_keys_round_trip():
    k = K.parse("assignment.n1.01ABC")
    assert (k.kind, k.node_id, k.id) == ("assignment", "n1", "01ABC")
    assert str(k) == "assignment.n1.01ABC"


@pytest.mark.parametrize(
    "bad",
    [
        *("nope.x", "node", "node.", "assignment.n1", "assignment.n1.a.b", "env.a.b"),
        *("env.a b", "env.a\tb", "env.a*", "env.>", "vip.x\r\nPUB", "assignment.n 1.a", "env.\x00"),
    ],
)
def test_malformed_keys_are_rejected(bad):
    with pytest.raises(K.BadKey):
        K.parse(bad)


def test_assignment_is_stored_without_its_observed_part():
    a = assignment("n1", "e1", "r1")
    a.observed.state = pb.INSTANCE_STATE_HEALTHY
    decoded = K.decode(K.ASSIGNMENT, K.encode(a))
    assert not decoded.HasField("observed")
    assert K.key_of(a) == f"assignment.n1.{a.meta.id}"


def test_a_value_stored_under_another_key_is_told() -> None:
    env = pb.Environment()
    env.meta.id = "e1"
    assert K.names_another_key(env, "env.e1") == ""
    assert K.names_another_key(env, "env.e2") == "env.e1"
    vip = pb.ServiceVIP(environment_id="e1", vip="127.128.0.2")
    assert K.names_another_key(vip, "vip.e1") == "" and K.names_another_key(vip, "vip.e9") == "vip.e1"
    assert K.names_another_key(pb.AssignmentObserved(), "observed.n1.a1") == ""  # no rule: its key is its own
