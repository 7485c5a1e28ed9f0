"""Why an operator action was refused: one small hierarchy that every adapter maps to its own answer.

An action refuses by raising one :class:`ActionRefused`; its ``kind`` says what sort of refusal it is
(the CLI answers exit status 1 to every kind, the console an HTTP status per kind). The message names what
was wrong; ``field`` names the request field it is about ("" when none), which an adapter may spell its own
way (:meth:`ActionRefused.said_as`: ``--env``, ``JOB_ID``). A refusal crosses a process boundary as
:meth:`ActionRefused.to_dict` / :func:`refusal_from_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, ClassVar

from shared.errors import ZatteraError


class Refusal(StrEnum):
    NOT_FOUND = "not_found"
    """What the request names does not exist."""
    INVALID = "invalid"
    """The request itself is wrong, whatever the state (a bad value, a missing option)."""
    CONFLICT = "conflict"
    """The state does not allow it now (a deployment under way, a job already ended, kept changing)."""
    FORBIDDEN = "forbidden"
    """The actor may not do this."""
    UNAVAILABLE = "unavailable"
    """A service or node the action needs did not answer."""


class ActionRefused(ZatteraError):
    """An operator action refused; nothing it would have written was written."""

    kind: ClassVar[Refusal] = Refusal.CONFLICT

    def __init__(self, problem: str, *, field: str = "", message: str = "") -> None:
        super().__init__(message or problem)
        self.field = field
        self.problem = problem

    def said_as(self, labels: Mapping[str, str]) -> str:
        """The message with its field spelled as ``labels`` says (``--env: no environment 'x'``); a label ""
        gives the problem alone; a field without a label keeps the message as it is."""
        if not self.field or self.field not in labels:
            return str(self)
        label = labels[self.field]
        return f"{label}: {self.problem}" if label else self.problem

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind.value, "field": self.field, "problem": self.problem, "message": str(self)}


class NotFound(ActionRefused):
    kind = Refusal.NOT_FOUND


class Invalid(ActionRefused, ValueError):
    """A bad request field: the message is ``<field>: <problem>``, or ``<said>: <problem>`` when the field
    is better said otherwise (``REPLICAS 9``, ``--max``; "" for the problem alone)."""

    kind = Refusal.INVALID

    def __init__(self, field: str, problem: str, *, said: str | None = None) -> None:
        subject = field if said is None else said
        super().__init__(problem, field=field, message=f"{subject}: {problem}" if subject else problem)


class Conflicting(ActionRefused):
    kind = Refusal.CONFLICT


class Forbidden(ActionRefused):
    kind = Refusal.FORBIDDEN


class Unavailable(ActionRefused):
    kind = Refusal.UNAVAILABLE


async def ask_service(nc: Any, subject: str, body: bytes, timeout: float, *, unavailable: str) -> bytes:
    """One request to a control-side service (the join service, the secrets service): its answer, or
    :class:`Unavailable` saying ``unavailable`` (``{error}`` in it: the error's type) when none came."""
    from nats.errors import Error as NatsError

    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except (NatsError, TimeoutError) as exc:
        raise Unavailable(unavailable.format(error=type(exc).__name__)) from None
    return bytes(msg.data or b"")


_BY_KIND: dict[Refusal, type[ActionRefused]] = {
    cls.kind: cls for cls in (NotFound, Invalid, Conflicting, Forbidden, Unavailable)
}


def refusal_from_dict(data: dict[str, str]) -> ActionRefused:
    """The refusal :meth:`ActionRefused.to_dict` described (an unknown kind reads as a conflict)."""
    try:
        kind = Refusal(data.get("kind", ""))
    except ValueError:
        kind = Refusal.CONFLICT
    field, problem = data.get("field", ""), data.get("problem", "")
    refused = _BY_KIND[kind].__new__(_BY_KIND[kind])
    ActionRefused.__init__(refused, problem, field=field, message=data.get("message", ""))
    return refused
