"""A StateView fed directly (no connection), for pure tests of functions that read the view."""

from __future__ import annotations

from google.protobuf.message import Message

from shared import keys as K
from shared.view import StateView


class OfflineState:
    def __init__(self, *msgs: Message) -> None:
        self.view = StateView(None, name="offline")
        self._rev = 0
        self.put(*msgs)

    def put(self, *msgs: Message) -> OfflineState:
        for msg in msgs:
            self._rev += 1
            self.view.apply_local(K.key_of(msg), self._rev, msg)
        return self

    def delete(self, key: str) -> None:
        self._rev += 1
        self.view.apply_local(key, self._rev, None)

    def observe(self, node_id: str, assignment_id: str, state: int) -> None:
        from zattera.v1 import types_pb2 as pb

        self._rev += 1
        self.view.apply_local(K.observed(node_id, assignment_id), self._rev, pb.AssignmentObserved(state=state))  # type: ignore[arg-type]
