"""A volume's snapshot policy (shared/actions/volumes.py) on real NATS, and every request, result and refusal
of the action layer through its wire codec (shared/actions/wire.py)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zattera.v1 import types_pb2 as pb

import shared.actions
from shared.actions.context import ActionContext
from shared.actions.envs import Scale
from shared.actions.refusals import ActionRefused, Conflicting, Invalid, NotFound, Refusal, refusal_from_dict
from shared.actions.volumes import SetSnapshotPolicy, set_snapshot_policy
from shared.actions.wire import decode, encode
from shared.txn import Writer
from tests.actions.conftest import ENV_ID


def _volume() -> pb.Volume:
    volume = pb.Volume(environment_id=ENV_ID, name="data", node_id="n1")
    volume.meta.id = "VOL1"
    return volume


async def test_a_policy_changes_only_the_fields_given(ctx: ActionContext, writer: Writer) -> None:
    await writer.commit(writer.txn().create(_volume()))
    done = await set_snapshot_policy(ctx, SetSnapshotPolicy("VOL1", schedule=" @daily ", keep_last=3))
    assert (done.name, done.schedule, done.keep_last, done.pre_hook) == ("data", "@daily", 3, "")
    hooked = await set_snapshot_policy(ctx, SetSnapshotPolicy("VOL1", pre_hook="sync"))
    assert (hooked.schedule, hooked.keep_last, hooked.pre_hook) == ("@daily", 3, "sync")


@pytest.mark.parametrize(
    ("request_", "refusal", "message"),
    [
        (SetSnapshotPolicy("VOL1"), Invalid, "give at least one of --schedule, --keep-last, --pre-hook or --offsite"),
        (SetSnapshotPolicy("VOL1", schedule="every day"), Invalid, "schedule: expected exactly 5 fields"),
        (SetSnapshotPolicy("VOL1", keep_last=1001), Invalid, "keep_last: must be 0 to 1000"),
        (SetSnapshotPolicy("nope", keep_last=1), NotFound, "volume 'nope' not found"),
    ],
)
async def test_a_bad_policy_is_refused_naming_the_field(
    ctx: ActionContext, writer: Writer, request_: SetSnapshotPolicy, refusal: type[ActionRefused], message: str
) -> None:
    await writer.commit(writer.txn().create(_volume()))
    with pytest.raises(refusal, match=message):
        await set_snapshot_policy(ctx, request_)


def _wire_types() -> list[type[Any]]:
    """Every frozen dataclass the action modules define: their requests and results (the context aside)."""
    found = []
    for info in pkgutil.iter_modules(shared.actions.__path__):
        if info.name == "context":
            continue
        module = importlib.import_module(f"shared.actions.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and dataclasses.is_dataclass(value)
                and value.__module__ == module.__name__
                and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
            ):
                found.append(value)
    return sorted(found, key=lambda cls: cls.__qualname__)


WIRE_TYPES = _wire_types()


def test_every_area_has_its_requests_and_results_on_the_wire() -> None:
    names = {cls.__name__ for cls in WIRE_TYPES}
    assert {
        "Scale",
        "Scaled",
        "Delete",
        "EditNode",
        "SetSecret",
        "Deploy",
        "RunJob",
        "TakeSnapshot",
        "AddDomain",
    } <= names


@pytest.mark.parametrize("cls", WIRE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_requests_and_results_round_trip_as_json(cls: type[Any], data: st.DataObject) -> None:
    value = data.draw(_finite_builds(cls))
    assert decode(cls, encode(value)) == value


def _finite_builds(cls: type[Any]) -> st.SearchStrategy[Any]:
    """``st.builds(cls)`` with finite floats, in nested dataclasses too: JSON has no infinity nor NaN (and
    NaN != NaN), so a time or a ratio on the wire is a finite number."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if hint is float:
            fields[f.name] = st.floats(allow_nan=False, allow_infinity=False)
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            fields[f.name] = _finite_builds(hint)
    return st.builds(cls, **fields)


def test_a_malformed_request_is_invalid_naming_what_is_wrong() -> None:
    with pytest.raises(Invalid, match=r"^Scale: replicas: Input should be a valid integer"):
        decode(Scale, b'{"env": "e", "replicas": "three"}')


@pytest.mark.parametrize(
    "refused",
    [
        NotFound("no environment 'x' (use an id or project/app/env)", field="env"),
        Invalid("replicas", "outside --min 2 / --max 4", said="REPLICAS 9"),
        Conflicting("job J already ended (succeeded)", field="job_id"),
    ],
)
def test_a_refusal_crosses_the_wire_with_its_kind_field_and_message(refused: ActionRefused) -> None:
    again = refusal_from_dict(refused.to_dict())
    assert (type(again), again.kind, again.field, again.problem, str(again)) == (
        type(refused),
        refused.kind,
        refused.field,
        refused.problem,
        str(refused),
    )
    assert refusal_from_dict({"kind": "from the future", "problem": "p"}).kind is Refusal.CONFLICT
