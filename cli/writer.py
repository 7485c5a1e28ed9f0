"""The CLI's writer: the fenced-write layer with the version-skew check before its first write. Loaded when a
command writes (:attr:`cli.client.Control.writer`), so a read imports none of the write path."""

from __future__ import annotations

from collections.abc import Sequence

from shared.audit import ACTION_HEADER, REQUEST_ID_HEADER, USER_HEADER, AuditedWriter, AuditLog, Auditor
from shared.connection import Connection
from shared.migrations.registry import SCHEMA
from shared.provisioning import recorded_config
from shared.skew import Component, SkewRefused, Verdict, judge
from shared.state.feed import StateView
from shared.txn import Txn, TxnError
from shared.version import VERSION


class CheckedWriter(AuditedWriter):
    """The CLI's writer: its first write is preceded by the version-skew check (``shared/skew.py``). A CLI
    too old for the cluster, or needing a schema the cluster is not at yet, writes nothing and says why in
    one line; reads are never checked (they change nothing, and stay one round trip).

    Its writes are audited (docs/audit.md): on a secured cluster (``secured``: a credential) by the relay,
    which takes the identity from the server and this writer's headers only as claims; on an open cluster by
    this writer itself, as ``verified: false``."""

    def __init__(
        self, conn: Connection, view: StateView, auditor: Auditor | None = None, secured: bool = False
    ) -> None:
        auditor = auditor or Auditor(source="cli", user="", verified=False)
        super().__init__(conn, view, auditor, None if secured else AuditLog(conn))
        if secured:
            self.extra_headers = {
                USER_HEADER: auditor.claimed_user or auditor.user,
                ACTION_HEADER: auditor.action,
                REQUEST_ID_HEADER: auditor.request_id,
            }
        self._cli_conn = conn
        self._allowed = False

    async def commit_many(self, txns: Sequence[Txn]) -> list[TxnError | None]:
        if not self._allowed:
            recorded = await recorded_config(self._cli_conn.js)
            if recorded is not None:
                skew = judge(Component.CLI, VERSION, SCHEMA, recorded.version, recorded.schema)
                if skew.refused or skew.verdict is Verdict.WAIT:
                    raise SkewRefused(f"{skew.message}; nothing was written")
            self._allowed = True
        return await super().commit_many(txns)
