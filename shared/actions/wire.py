"""Operator-action requests, results and refusals as bytes: what crosses a process boundary.

Requests and results are frozen dataclasses of plain values (strings, numbers, booleans, enums, lists,
dicts, None), so one codec (pydantic's ``TypeAdapter``, JSON) carries any of them; a refusal travels as
:meth:`~shared.actions.refusals.ActionRefused.to_dict`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from shared.actions.refusals import Invalid

T = TypeVar("T")


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    adapter = _ADAPTERS.get(cls)
    if adapter is None:
        adapter = _ADAPTERS[cls] = TypeAdapter(cls)
    return adapter


def encode(value: object) -> bytes:
    """``value`` (a request or result dataclass) as JSON."""
    return _adapter(type(value)).dump_json(value)


def decode(cls: type[T], data: bytes | str) -> T:
    """The ``cls`` that :func:`encode` wrote; anything else is an :class:`Invalid` request."""
    try:
        value: T = _adapter(cls).validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(whole)'}: {e['msg']}" for e in exc.errors())
        raise Invalid(cls.__name__, problems) from None
    return value
