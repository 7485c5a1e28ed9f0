"""This tree keeps the wire contract of the previous release (tests/compat/wire.py says the rules): its
``.proto`` files, its streams' subjects and its subject builders, captured from that release in
``tests/compat/releases/<release>/``. Plus table tests showing each rule catches what it should."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from shared.applogs import LogLimits, app_logs_stream_config
from shared.console_users import USERS_BUCKET
from shared.streams import OBJECT_STORES, ClusterConfig, object_store_stream
from tests.compat import capture
from tests.compat.releases import PER_ENV, PREVIOUS, RELEASES, streams
from tests.compat.wire import (
    compile_protos,
    proto_violations,
    stream_violations,
    subject_matches,
    subject_violations,
)

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ("zattera/v1/types.proto", "zattera/cluster/v1/cluster.proto")


Files = list[descriptor_pb2.FileDescriptorProto]


@pytest.fixture(scope="module")
def previous_and_now(tmp_path_factory: pytest.TempPathFactory) -> tuple[Files, Files]:
    out = tmp_path_factory.mktemp("protos")
    before = compile_protos(RELEASES / PREVIOUS / "proto", PROTOS, out / "before.pb")
    now = compile_protos(ROOT / "proto", PROTOS, out / "now.pb")
    return list(before.file), list(now.file)


def test_every_message_field_and_enum_value_of_the_previous_release_is_kept(
    previous_and_now: tuple[Files, Files],
) -> None:
    before, now = previous_and_now
    assert [f.name for f in before if f.name in PROTOS] == list(PROTOS)
    assert proto_violations(before, now) == []


def _changed(files: Files, message: str, edit: str) -> Files:
    """A copy of ``files`` where ``message``'s first field is edited (``edit``)."""
    copies = []
    for file in files:
        copy = descriptor_pb2.FileDescriptorProto()
        copy.CopyFrom(file)
        for msg in copy.message_type:
            if msg.name == message:
                field = msg.field[0]
                if edit == "remove":
                    del msg.field[0]
                elif edit == "renumber":
                    field.number = 999
                elif edit == "rename":
                    field.name = "renamed"
                elif edit == "retype":
                    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    field.ClearField("type_name")
                elif edit == "repeat":
                    field.label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                elif edit == "add":
                    msg.field.add(name="brand_new", number=5000, type=field.type, label=field.label)
        copies.append(copy)
    return copies


@pytest.mark.parametrize(
    ("edit", "violation"),
    [
        ("remove", "zattera.v1.Lease.holder = 1: removed"),
        ("renumber", "zattera.v1.Lease.holder = 1: renumbered to 999"),
        ("rename", "zattera.v1.Lease.holder = 1: renamed renamed"),
        ("retype", "zattera.v1.Lease.holder = 1: singular string became singular bytes"),
        ("repeat", "zattera.v1.Lease.holder = 1: singular string became repeated string"),
        ("add", None),
    ],
)
def test_the_protobuf_rules_catch_a_removed_renumbered_renamed_or_retyped_field(
    previous_and_now: tuple[Files, Files],
    edit: str,
    violation: str | None,
) -> None:
    before, _ = previous_and_now
    found = proto_violations(before, _changed(before, "Lease", edit))
    assert found == ([violation] if violation else [])


def test_a_removed_enum_value_or_message_is_caught(
    previous_and_now: tuple[Files, Files],
) -> None:
    before, _ = previous_and_now
    edited = []
    for file in before:
        copy = descriptor_pb2.FileDescriptorProto()
        copy.CopyFrom(file)
        for enum in copy.enum_type:
            if enum.name == "NodeStatus":
                del enum.value[-1]
        kept = [m for m in copy.message_type if m.name != "ServiceVIP"]
        del copy.message_type[:]
        copy.message_type.extend(kept)
        edited.append(copy)
    found = proto_violations(before, edited)
    assert "zattera.v1.ServiceVIP: message removed" in found
    assert any(line.startswith("zattera.v1.NodeStatus.") and "removed or renamed" in line for line in found)


def _streams_now() -> dict[str, list[str]]:
    """Every stream this code makes: the provisioned ones, object stores, and those services make on use."""
    made = {str(c.name): list(c.subjects or []) for c in ClusterConfig().stream_configs()}
    made.update({object_store_stream(b): [f"$O.{b}.C.>", f"$O.{b}.M.>"] for b in OBJECT_STORES})
    per_env = app_logs_stream_config(PER_ENV, retention=LogLimits(max_bytes=1 << 20, max_age=3600.0), replicas=1)
    made[str(per_env.name)] = list(per_env.subjects or [])
    made[f"KV_{USERS_BUCKET}"] = [f"$KV.{USERS_BUCKET}.>"]
    return made


def test_every_stream_and_subject_of_the_previous_release_is_still_captured() -> None:
    before = {name: list(s["config"]["subjects"]) for name, s in streams(PREVIOUS).items()}
    assert stream_violations(before, _streams_now()) == []


def test_the_stream_rule_catches_a_subject_no_longer_captured() -> None:
    """What issue 44 was: the build events' subjects gained a token, and the old ones were no longer
    captured by the stream (the rule the first migration had to repair)."""
    old = {"ZATTERA_BUILD_EVENTS": ["zattera.builds.*.events"], "GONE": ["a.b"]}
    new = {"ZATTERA_BUILD_EVENTS": ["zattera.builds.*.events.*"]}
    assert stream_violations(old, new) == [
        "ZATTERA_BUILD_EVENTS: zattera.builds.*.events no longer captured (now ['zattera.builds.*.events.*'])",
        "GONE: stream removed",
    ]
    assert subject_matches("zattera.builds.*.events.*", "zattera.builds.B.events.n1")
    assert subject_matches("$KV.zattera-state.>", "$KV.zattera-state.node.n1")
    assert not subject_matches("zattera.builds.*.events.*", "zattera.builds.B.events")


def test_every_subject_the_previous_release_built_is_built_the_same_way() -> None:
    before = json.loads((RELEASES / PREVIOUS / "subjects.json").read_text())
    assert subject_violations(before, capture.subjects()) == []
    assert subject_violations({"x": "a.b"}, {"x": "a.b.c"}) == ["x: 'a.b' became 'a.b.c'"]
