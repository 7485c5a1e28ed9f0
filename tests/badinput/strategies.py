"""Hypothesis strategies: key ids, raw payloads, valid-but-absurd protobufs of any message type (every field
filled from its descriptor with extreme values: huge and negative numbers, unknown enum numbers, odd
unicode, deep and optionally huge repeated fields), absurd JSON values and absurd message headers."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

M = TypeVar("M", bound=Message)

IDS = st.from_regex(r"\A[A-Za-z0-9_-]{1,24}\Z")

ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\x00\x01\x7f",
    "\u202eevil\u202c",  # right-to-left override
    "\u200b\u200d\ufeff",  # zero-width characters, byte-order mark
    "e\u0301\u0301\u0301",  # stacked combining accents
    "\U0001f4a9\U0001f3f3\ufe0f\u200d\U0001f308",  # astral-plane emoji, a ZWJ sequence
    "\uffff\ufffe\ufffd",  # noncharacters, replacement character
    "Ω≈ç√∫˜µ≤≥÷",
    "%s%n%x{0}${PATH}$(true)",
    "\t\r\n\v\f",
    "x" * 4096,
]
ODD_TEXT = st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=40))
"""Strings with the usual suspects: control characters, bidi overrides, zero-width, combining, astral, long."""

_RANGES: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_INTS: dict[int, st.SearchStrategy[int]] = {t: st.integers(lo, hi) for t, (lo, hi) in _RANGES.items()}
_EXTREME_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1])
# proto3 enums are open: any int32 is valid on the wire, named or not
_ENUMS = st.one_of(st.integers(-5, 1000), st.sampled_from([2**31 - 1, -(2**31)]))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        return st.one_of(_EXTREME_INTS.filter(lambda v: _fits(t, v)), _INTS[t])
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return ODD_TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_ENUM:
        return _ENUMS
    raise TypeError(t)


def _fits(t: int, v: int) -> bool:
    lo, hi = _RANGES[t]
    return lo <= v <= hi


def _fill(msg: Message, desc: Descriptor, draw: Any, depth: int, huge: int) -> None:
    # Huge only on the message's own fields: one drawn huge in every nested message too ran past Hypothesis's
    # entropy budget for most requests of a message with many repeated fields (FailedHealthCheck).
    counts = st.one_of(st.integers(0, 3), st.just(huge)) if huge and depth == 0 else st.integers(0, 3)
    for field in desc.fields:
        if depth > 3 or not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for _ in range(draw(counts)):
                k = draw(_scalar(key_f))
                target = getattr(msg, field.name)
                if val_f.message_type is not None:
                    _fill(target[k], val_f.message_type, draw, depth + 1, huge)
                else:
                    target[k] = draw(_scalar(val_f))
            continue
        repeated = field.is_repeated
        count = draw(counts) if repeated else 1
        for _ in range(count):
            if field.message_type is not None:
                if field.message_type.full_name == "google.protobuf.Timestamp":
                    sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                    sub.seconds = draw(st.integers(-62135596800, 253402300799))
                    continue
                sub = getattr(msg, field.name).add() if repeated else getattr(msg, field.name)
                _fill(sub, field.message_type, draw, depth + 1, huge)
                if not repeated:
                    sub.SetInParent()
            elif repeated:
                getattr(msg, field.name).append(draw(_scalar(field)))
            else:
                setattr(msg, field.name, draw(_scalar(field)))


@st.composite
def absurd(draw: Any, cls: type[M], huge: int = 0) -> M:
    """A ``cls`` with random fields set to extreme values; ``huge`` > 0 lets a repeated or map field of ``cls``
    itself hold that many entries (a huge repeated field) instead of 0-3."""
    msg = cls()
    _fill(msg, cast(Descriptor, cls.DESCRIPTOR), draw, 0, huge)
    return msg


HUGE_NUMBERS = [2**63, -(2**63) - 1, 2**64, 10**400, -(10**400)]
"""Integers a JSON parser accepts and a 64-bit field (or ``float()``) does not."""

_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN/Infinity; json.loads reads them
    ODD_TEXT,
    st.just("\ud800"),  # a lone surrogate: valid in JSON text, not encodable as UTF-8
)
JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(ODD_TEXT, inner, max_size=4)),
    max_leaves=12,
)


def json_object(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with any of ``fields`` (absurd values) and maybe stray keys."""
    return st.fixed_dictionaries({}, optional={f: JSON_VALUES for f in fields}).flatmap(
        lambda known: st.dictionaries(ODD_TEXT, JSON_VALUES, max_size=2).map(lambda extra: {**extra, **known})
    )


HEADER_NAMES = [
    "traceparent",
    "tracestate",
    "Content-Encoding",
    "Zattera-Routes-Version",
    "Zattera-Routes-Digest",
    "Zattera-Routes-Chunk",
    "Zattera-Routes-Unchanged",
    "Zattera-Error",
    "Zattera-Build-End",
    "Zattera-Event-Seq",
    "Nats-Service-Error-Code",
]
_HEADER_VALUES = st.one_of(
    ODD_TEXT,
    st.sampled_from(["zstd", "gzip", "br", "identity", "00-" + "f" * 32 + "-" + "0" * 16 + "-ff", "-1"]),
    st.integers().map(str),
    st.sampled_from([str(n) for n in HUGE_NUMBERS]),
)
ABSURD_HEADERS: st.SearchStrategy[dict[str, str]] = st.dictionaries(
    st.one_of(st.sampled_from(HEADER_NAMES), st.from_regex(r"\A[A-Za-z][A-Za-z0-9-]{0,30}\Z")),
    _HEADER_VALUES,
    max_size=4,
)
"""Request headers with absurd values (nats-py refuses names outside RFC 7230 tokens and folds newlines)."""
