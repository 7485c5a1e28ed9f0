"""The CLI's writer: the fenced-write layer with the version-skew check before its first write. Loaded when a
command writes (:attr:`cli.client.Control.writer`), so a read imports none of the write path."""

from __future__ import annotations

from collections.abc import Sequence

from shared.connection import Connection
from shared.migrations.registry import SCHEMA
from shared.provisioning import recorded_config
from shared.skew import Component, SkewRefused, Verdict, judge
from shared.state.feed import StateView
from shared.txn import Txn, TxnError, Writer
from shared.version import VERSION


class CheckedWriter(Writer):
    """The CLI's writer: its first write is preceded by the version-skew check (``shared/skew.py``). A CLI
    too old for the cluster, or needing a schema the cluster is not at yet, writes nothing and says why in
    one line; reads are never checked (they change nothing, and stay one round trip)."""

    def __init__(self, conn: Connection, view: StateView) -> None:
        super().__init__(conn, view)
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
