from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from tests.factories import assignment


def test_per_node_keys_round_trip():
    k = K.parse("assignment.n1.01ABC")
    assert (k.kind, k.node_id, k.id) == ("assignment", "n1", "01ABC")
    assert str(k) == "assignment.n1.01ABC"


@pytest.mark.parametrize("bad", ["nope.x", "node", "node.", "assignment.n1", "assignment.n1.a.b", "env.a.b"])
def test_malformed_keys_are_rejected(bad):
    with pytest.raises(K.BadKey):
        K.parse(bad)


def test_assignment_is_stored_without_its_observed_part():
    a = assignment("n1", "e1", "r1")
    a.observed.state = pb.INSTANCE_STATE_HEALTHY
    decoded = K.decode(K.ASSIGNMENT, K.encode(a))
    assert not decoded.HasField("observed")
    assert K.key_of(a) == f"assignment.n1.{a.meta.id}"
