"""A state store filled directly (no NATS), for pure tests of what reads the state.

Every write gets the next revision, as the state stream would give it; ``store`` is what a decision
reads (a :class:`shared.state.reader.StateReader`).
"""

from __future__ import annotations

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.state.store import StateStore


class MemoryState:
    def __init__(self, *msgs: Message, name: str = "memory") -> None:
        self.store = StateStore(name=name)
        self.revision = 0
        self.put(*msgs)

    def write(self, key: str, msg: Message | None) -> int:
        """Write (or with None delete) one key; returns its revision."""
        self.revision += 1
        self.store.apply_local(key, self.revision, msg)
        return self.revision

    def put(self, *msgs: Message) -> MemoryState:
        """Write messages under their own keys (:func:`shared.keys.key_of`)."""
        for msg in msgs:
            self.write(K.key_of(msg), msg)
        return self

    def delete(self, key: str) -> None:
        self.write(key, None)

    def observe(self, node_id: str, assignment_id: str, observed: pb.AssignmentObserved) -> None:
        """The agent's report of an assignment (``observed.<node>.<id>``), joined into it."""
        self.write(K.observed(node_id, assignment_id), observed)
