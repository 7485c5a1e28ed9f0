"""Protobuf wire encoding written out by hand, for the route builder's hot path.

Building tens of thousands of ``HTTPRoute``/``Endpoint`` message objects only to serialize them costs
most of a full route build in CPython; writing the bytes directly is several times faster. Encoders
built from these helpers must produce exactly ``SerializeToString(deterministic=True)`` of the
equivalent message: fields in number order, proto3 defaults (empty string, 0, false, unset message)
left out. ``tests/routes/test_wire.py`` checks the route encoders against the generated classes on
random messages.

Only the wire types the route messages use appear here: varint (0) and length-delimited (2).
"""

from __future__ import annotations

from google.protobuf.message import Message

VARINT = 0
LEN = 2


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    """The key of a field (number and wire type), to be computed once per field."""
    return varint(field_number << 3 | wire_type)


_ONE_BYTE = [bytes((size,)) for size in range(0x80)]


def len_field(field_tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, sub-message, element of a repeated message field);
    present even when ``payload`` is empty, as a set sub-message or a repeated element is."""
    size = len(payload)
    return field_tag + (_ONE_BYTE[size] if size < 0x80 else varint(size)) + payload


def sized(payload: bytes) -> bytes:
    """``payload`` after its length prefix: a length-delimited field's value without its key, so that
    elements of one repeated field are ``key + key.join(sized values)``."""
    size = len(payload)
    return (_ONE_BYTE[size] if size < 0x80 else varint(size)) + payload


def repeated_field(field_tag: bytes, sized_elements: list[bytes]) -> bytes:
    """The elements of a repeated length-delimited field, each given by :func:`sized`."""
    return field_tag + field_tag.join(sized_elements) if sized_elements else b""


def string_field(field_tag: bytes, value: str) -> bytes:
    """A string field; empty = absent."""
    if not value:
        return b""
    data = value.encode()
    size = len(data)
    return field_tag + (_ONE_BYTE[size] if size < 0x80 else varint(size)) + data


def uint_field(field_tag: bytes, value: int) -> bytes:
    """A uint32/uint64 field; 0 = absent."""
    return field_tag + varint(value) if value else b""


def bool_field(field_tag: bytes, value: bool) -> bytes:
    """A bool field; false = absent."""
    return field_tag + b"\x01" if value else b""


def message_field(field_tag: bytes, message: Message | None) -> bytes:
    """An optional sub-message; None = absent (a set but empty one is present)."""
    if message is None:
        return b""
    return len_field(field_tag, message.SerializeToString(deterministic=True))
