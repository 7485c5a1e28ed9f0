"""Hypothesis strategies: key ids, raw payloads, and valid-but-absurd protobufs of any message type
(every field filled from its descriptor with extreme values: huge and negative numbers, unknown enum
numbers, odd unicode, deep repeated fields)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

IDS = st.from_regex(r"\A[A-Za-z0-9_-]{1,24}\Z")

_INTS: dict[int, st.SearchStrategy[int]] = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
}
_EXTREME_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)])


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        return st.one_of(_EXTREME_INTS.filter(lambda v: _fits(t, v)), _INTS[t])
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=40)
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.integers(-5, 1000)  # proto3 enums are open: unknown numbers are valid on the wire
    raise TypeError(t)


def _fits(t: int, v: int) -> bool:
    lo, hi = {
        FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
        FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
        FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
        FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    }.get(t, (-(2**63), 2**63 - 1))
    return lo <= v <= hi


def _fill(msg: Message, desc: Descriptor, draw: Any, depth: int) -> None:
    for field in desc.fields:
        if depth > 3 or not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 3))):
                k = draw(_scalar(key_f))
                target = getattr(msg, field.name)
                if val_f.message_type is not None:
                    _fill(target[k], val_f.message_type, draw, depth + 1)
                else:
                    target[k] = draw(_scalar(val_f))
            continue
        repeated = field.is_repeated
        count = draw(st.integers(0, 3)) if repeated else 1
        for _ in range(count):
            if field.message_type is not None:
                if field.message_type.full_name == "google.protobuf.Timestamp":
                    sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                    sub.seconds = draw(st.integers(-62135596800, 253402300799))
                    continue
                sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                _fill(sub, field.message_type, draw, depth + 1)
                if not repeated:
                    sub.SetInParent()
            elif repeated:
                getattr(msg, field.name).append(draw(_scalar(field)))
            else:
                setattr(msg, field.name, draw(_scalar(field)))


@st.composite
def absurd(draw: Any, cls: type[Message]) -> Message:
    msg = cls()
    _fill(msg, cls.DESCRIPTOR, draw, 0)
    return msg
