"""The wire contract's compatibility rules, as checks of this tree against an earlier release:

* protobuf: every message, field and enum value of the earlier ``.proto`` files is still there with the same
  number, name, type and cardinality (fields are only added; a removed field's number is never reused
  because it is never removed);
* streams: every stream the earlier release's cluster had still exists in this code's definition, and each
  subject it captured is still captured (a component of that release publishes there during an upgrade);
* subjects: each subject the earlier release's code built is built the same way today (a subject whose
  layout changes gets a new, versioned name instead, and the old one is served for a release).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2

FieldProto = descriptor_pb2.FieldDescriptorProto
CARDINALITY = {FieldProto.LABEL_REPEATED: "repeated", FieldProto.LABEL_OPTIONAL: "singular"}


def compile_protos(root: Path, files: Iterable[str], out: Path) -> descriptor_pb2.FileDescriptorSet:
    """``protoc`` (grpcio-tools) run on ``files`` under ``root``: their descriptors."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--descriptor_set_out={out}",
            *files,
        ],
        check=True,
        capture_output=True,
    )
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _messages(
    prefix: str, messages: Iterable[descriptor_pb2.DescriptorProto]
) -> dict[str, descriptor_pb2.DescriptorProto]:
    found = {}
    for message in messages:
        name = f"{prefix}.{message.name}"
        found[name] = message
        found.update(_messages(name, message.nested_type))
    return found


def _enums(prefix: str, file: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.EnumDescriptorProto]:
    found = {f"{prefix}.{e.name}": e for e in file.enum_type}
    for name, message in _messages(prefix, file.message_type).items():
        found.update({f"{name}.{e.name}": e for e in message.enum_type})
    return found


def _field_shape(field: descriptor_pb2.FieldDescriptorProto) -> str:
    type_name = FieldProto.Type.Name(field.type).removeprefix("TYPE_").lower()  # type: ignore[arg-type]
    if field.type_name:
        type_name = field.type_name.lstrip(".")
    oneof = " in a oneof" if field.HasField("oneof_index") and not field.proto3_optional else ""
    presence = " optional" if field.proto3_optional else ""
    return f"{CARDINALITY.get(field.label, 'required')}{presence} {type_name}{oneof}"


def proto_violations(
    old: Iterable[descriptor_pb2.FileDescriptorProto], new: Iterable[descriptor_pb2.FileDescriptorProto]
) -> list[str]:
    """What ``new`` breaks of ``old``: one line per removed message, enum or value, and per field removed,
    renumbered, renamed or retyped."""
    old_files = {f.name: f for f in old}
    new_files = {f.name: f for f in new}
    found = []
    for name, before in old_files.items():
        after = new_files.get(name)
        if after is None:
            found.append(f"{name}: file removed")
            continue
        prefix = before.package
        now_messages = _messages(prefix, after.message_type)
        for message_name, message in _messages(prefix, before.message_type).items():
            current = now_messages.get(message_name)
            if current is None:
                found.append(f"{message_name}: message removed")
                continue
            by_number = {f.number: f for f in current.field}
            for field in message.field:
                now = by_number.get(field.number)
                where = f"{message_name}.{field.name} = {field.number}"
                if now is None:
                    moved = [f.number for f in current.field if f.name == field.name]
                    found.append(f"{where}: renumbered to {moved[0]}" if moved else f"{where}: removed")
                    continue
                if now.name != field.name:
                    found.append(f"{where}: renamed {now.name}")
                if _field_shape(now) != _field_shape(field):
                    found.append(f"{where}: {_field_shape(field)} became {_field_shape(now)}")
        now_enums = _enums(prefix, after)
        for enum_name, enum in _enums(prefix, before).items():
            current_enum = now_enums.get(enum_name)
            if current_enum is None:
                found.append(f"{enum_name}: enum removed")
                continue
            values = {v.number: v.name for v in current_enum.value}
            for value in enum.value:
                if values.get(value.number) != value.name:
                    found.append(f"{enum_name}.{value.name} = {value.number}: removed or renamed")
    return found


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` one token, ``>`` one or more at the end."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def sample_subject(pattern: str) -> str:
    """A concrete subject a stream's pattern captures (each wildcard a token of its own)."""
    return ".".join("x" if token in ("*", ">") else token for token in pattern.split("."))


def stream_violations(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """Streams (name → subjects) of an earlier release that ``new`` lost, or whose subjects it no longer
    captures."""
    found = []
    for name, subjects in old.items():
        if name not in new:
            found.append(f"{name}: stream removed")
            continue
        for pattern in subjects:
            if not any(subject_matches(now, sample_subject(pattern)) for now in new[name]):
                found.append(f"{name}: {pattern} no longer captured (now {new[name]})")
    return found


def subject_violations(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Subject builders whose output changed (or that are gone) since an earlier release."""
    return [
        f"{name}: {subject!r} became {new.get(name)!r}" for name, subject in old.items() if new.get(name) != subject
    ]
