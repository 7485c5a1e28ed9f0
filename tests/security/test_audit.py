"""The audit log on a secured cluster (docs/audit.md): an operator's write is recorded by the relay with the
identity the server set — whatever the request claims —, the log is append-only for everybody (the operator
cannot even publish to it), and an entry holds no value."""

from __future__ import annotations

import json

import pytest
from nats.js.errors import APIError
from zattera.v1 import types_pb2 as pb

from cli.writer import CheckedWriter
from shared.audit import (
    ACTION_HEADER,
    REQUEST_ID_HEADER,
    USER_HEADER,
    AuditEntry,
    Auditor,
    read_entries,
)
from shared.connection import Connection
from shared.security.creds import read_user_jwt
from shared.security.join import JoinService
from shared.security.nkeyjwt import decode_claims
from shared.security.permissions import Role
from shared.security.relay import answer_outcome
from shared.state.feed import StateView
from shared.subjects import AUDIT_STREAM, STATE_PREFIX
from shared.watches import STATE_WATCH, open_watch
from tests.security.conftest import ConnectAs, SecureCluster, answered_request
from tests.waiting import eventually

CLUSTER_TOO = True  # also against a secured three-server cluster (conftest.py)
VALUE = "v4lue-that-must-never-be-audited"
FORGED_INFO = json.dumps({"acc": "AFORGED", "user": "UFORGED", "name_tag": "root", "host": "10.6.6.6"})


def operator_key(secure: SecureCluster) -> str:
    return str(decode_claims(read_user_jwt(str(secure.setup.operator_creds)))["sub"])


async def entry_of(conn: Connection, request_id: str) -> AuditEntry:
    """The entry of ``request_id``, read as the operator reads the log (a watch control opens)."""
    found: list[AuditEntry] = []

    async def recorded() -> bool:
        found[:] = [e for e in await read_entries(conn, idle=0.5) if e.request_id == request_id]
        return bool(found)

    await eventually(recorded, what=f"an audit entry of {request_id}")
    assert len(found) == 1, found
    return found[0]


async def test_an_operators_write_is_audited_with_the_servers_identity_not_the_claimed_one(
    secure: SecureCluster, operator: Connection, join_service: JoinService, watches: None
) -> None:
    forged = {
        "Nats-Request-Info": FORGED_INFO,  # replaced by the server
        USER_HEADER: "mallory@evil",
        ACTION_HEADER: "apps apply",
        REQUEST_ID_HEADER: "req-forged",
    }
    reply = await answered_request(operator, f"{STATE_PREFIX}env.audited", VALUE.encode(), forged)
    ack = json.loads(reply.data)
    assert ack.get("seq"), ack
    entry = await entry_of(operator, "req-forged")
    assert entry.user == "operator" and entry.verified and entry.verified_by == "nats-credential"
    assert entry.credential["user_key"] == operator_key(secure) and entry.credential["name"] == "operator"
    assert entry.credential["account"] != "AFORGED" and entry.address == "127.0.0.1"
    assert entry.claimed_user == "mallory@evil" and entry.action == "apps apply" and entry.action_claimed
    assert [(k.key, k.op) for k in entry.keys] == [("env.audited", "put")]
    assert entry.outcome == "ok" and entry.seq == ack["seq"] and entry.source == "cli"
    assert VALUE not in entry.to_json().decode()


async def test_the_clis_writer_is_audited_by_the_relay_one_entry_per_batch(
    secure: SecureCluster, operator: Connection, join_service: JoinService, watches: None
) -> None:
    async def open_state_watch() -> str:
        return await open_watch(operator, STATE_WATCH)

    view = StateView(operator, name="cli", open_consumer=open_state_watch)
    await view.load_snapshot(10)
    auditor = Auditor(source="cli", user="eve@laptop", verified=False, action="projects add", action_claimed=True)
    writer = CheckedWriter(operator, view, auditor, secured=True)
    txn = writer.txn()
    for name in ("one", "two"):
        project = pb.Project(name=name)
        project.meta.id = f"01AUDIT{name.upper()}"
        txn.create(project)
    await writer.commit(txn)
    entry = await entry_of(operator, auditor.request_id)
    assert entry.user == "operator" and entry.verified and entry.claimed_user == "eve@laptop"
    assert entry.action == "projects add" and entry.operation == "batch" and entry.outcome == "ok"
    assert sorted(k.key for k in entry.keys) == ["project.01AUDITONE", "project.01AUDITTWO"]
    stored = await operator.js.get_last_msg("KV_zattera-state", f"{STATE_PREFIX}project.01AUDITONE")
    assert USER_HEADER not in (stored.headers or {})  # the claims stop at the relay


async def test_a_write_the_relay_refuses_is_audited_as_refused(
    operator: Connection, join_service: JoinService, watches: None
) -> None:
    headers = {"KV-Operation": "PURGE", REQUEST_ID_HEADER: "req-purge"}
    reply = await answered_request(operator, f"{STATE_PREFIX}env.audited", b"", headers)
    assert "only DEL" in json.loads(reply.data)["error"]["description"]
    entry = await entry_of(operator, "req-purge")
    assert entry.outcome.startswith("refused: ") and "only DEL" in entry.outcome and entry.verified


@pytest.mark.parametrize(
    "subject",
    [
        f"$JS.API.STREAM.PURGE.{AUDIT_STREAM}",
        f"$JS.API.STREAM.DELETE.{AUDIT_STREAM}",
        f"$JS.API.STREAM.MSG.DELETE.{AUDIT_STREAM}",
        f"$JS.API.STREAM.UPDATE.{AUDIT_STREAM}",
        "zattera.audit.cli",
    ],
)
async def test_the_operator_can_neither_erase_nor_write_the_audit_log(connect_as: ConnectAs, subject: str) -> None:
    client = await connect_as(Role.OPERATOR, "auditor-test")
    await client.nc.publish(subject, b'{"seq": 1}', reply=client.nc.new_inbox())
    assert "permissions violation" in await client.refusal()


async def test_the_audit_log_is_append_only_even_for_control(
    control: Connection, operator: Connection, join_service: JoinService
) -> None:
    await answered_request(operator, f"{STATE_PREFIX}env.kept", b"x", {REQUEST_ID_HEADER: "req-kept"})
    info = await control.js.stream_info(AUDIT_STREAM)
    assert info.config.deny_delete and info.config.deny_purge and info.state.messages >= 1
    with pytest.raises(APIError):
        await control.js.purge_stream(AUDIT_STREAM)
    with pytest.raises(APIError):
        await control.js.delete_msg(AUDIT_STREAM, info.state.last_seq)
    assert (await control.js.stream_info(AUDIT_STREAM)).state.messages == info.state.messages


@pytest.mark.parametrize(
    ("answer", "outcome"),
    [
        (b'{"stream": "KV_zattera-state", "seq": 7}', ("ok", 7)),
        (b'{"error": {"code": 400, "err_code": 10071, "description": "wrong last sequence: 3"}}', None),
        (b'{"error": {"code": 503, "err_code": 10077, "description": "no quorum"}}', None),
        (b"not json", ("unconfirmed", 0)),
    ],
)
def test_the_streams_answer_is_the_entrys_outcome(answer: bytes, outcome: tuple[str, int] | None) -> None:
    got = answer_outcome(answer)
    if outcome is not None:
        assert got == outcome
    elif b"10071" in answer:
        assert got == ("conflict: wrong last sequence: 3 (code 10071)", 0)
    else:
        assert got == ("refused: no quorum (code 10077)", 0)
