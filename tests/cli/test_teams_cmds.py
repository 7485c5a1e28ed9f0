"""``zattera users update`` and ``zattera tokens revoke`` on a name the cluster has no record of (the commands
against a real cluster: tests/security/test_teams.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import typer

from cli import teams_cmds


@pytest.mark.parametrize(
    ("command", "args", "kind"),
    [(teams_cmds.users_update, ("ghost", True), "user"), (teams_cmds.tokens_revoke, ("ghost",), "token")],
)
def test_an_unknown_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: Callable[..., None],
    args: tuple[Any, ...],
    kind: str,
) -> None:
    monkeypatch.setattr(teams_cmds, "run", lambda go: None)  # the cluster has no record of that name
    with pytest.raises(typer.Exit) as exited:
        command(*args)
    assert exited.value.exit_code == 1
    captured = capsys.readouterr()
    assert f"name 'ghost': no such {kind}" in captured.err
    assert captured.out == ""
