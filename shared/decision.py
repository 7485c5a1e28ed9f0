"""What a pure decision returns: the writes of ONE atomic batch and the events it announces.

Every leader loop's decision (the scheduler's evaluations, the orchestrator's phase steps) returns a
:class:`Decision`; the loop applies it with :meth:`Decision.txn` and one fenced commit, then publishes its
events (they are a log, not state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared.txn import Txn, Writer


@dataclass
class Decision:
    """``creates`` must not exist yet; ``puts`` and ``deletes`` expect the revisions the decision read;
    ``fence`` is re-written last whether it changed or not, so any concurrent change to it (an operator's
    cancel of the deployment, another leader) refuses the whole batch."""

    label: str
    creates: list[Message] = field(default_factory=list)
    puts: list[Message] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)
    events: list[pb.Event] = field(default_factory=list)
    fence: Message | None = None

    def __bool__(self) -> bool:
        return bool(self.creates or self.puts or self.deletes or self.fence is not None)

    def __len__(self) -> int:
        return len(self.creates) + len(self.puts) + len(self.deletes) + (self.fence is not None)

    def txn(self, writer: Writer) -> Txn:
        """The batch, expecting the view's current revisions: build it right after deciding (no await in
        between), so a change since the decision refuses it."""
        txn = writer.txn(self.label).extend(creates=self.creates, puts=self.puts, deletes=self.deletes)
        return txn if self.fence is None else txn.put(self.fence)
