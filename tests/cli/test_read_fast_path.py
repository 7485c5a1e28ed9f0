"""A plain read run directly (``cli/main.py`` ``READS``, without typer) takes exactly the command lines its typer
command takes, and answers them exactly as typer does: same output, same errors, same exit codes. Anything else
is typer's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from cli.app import app
from cli.main import NATS_ENV, READS, ROOT_OPTIONS, direct_read
from tests.cli.rig import Invoke
from tests.e2e.cluster import ROOT

DIRECT = "from cli.main import main; main()"
THROUGH_TYPER = "from cli.app import app; app(prog_name='zattera')"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["status"], ("status", "", {})),
        (["status", "--json"], ("status", "", {"as_json": True})),
        (["status", "--env", "p/a/e", "--json"], ("status", "", {"env": "p/a/e", "as_json": True})),
        (["status", "--env=p/a/e"], ("status", "", {"env": "p/a/e"})),
        (["status", "--env", "a", "--env", "b"], ("status", "", {"env": "b"})),
        (["--nats", "nats://h:1", "ps", "--wide"], ("ps", "nats://h:1", {"wide": True})),
        (["--nats=nats://h:1", "ps", "--json", "--env", "x"], ("ps", "nats://h:1", {"as_json": True, "env": "x"})),
    ],
)
def test_a_plain_read_is_run_directly(argv: list[str], expected: tuple[str, str, dict[str, object]]) -> None:
    assert direct_read(argv) == expected


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--version"],
        ["--help"],
        ["status", "--help"],
        ["status", "extra"],
        ["status", "--wide"],  # ps has it, status does not
        ["status", "--env"],  # no value
        ["status", "--env", "--json"],  # typer would take "--json" as the value
        ["status", "--json=yes"],
        ["--nats"],
        ["ps", "--nats", "nats://h:1"],  # a root option after the command
        ["routes"],
        ["deploy", "status"],
    ],
)
def test_anything_else_goes_to_typer(argv: list[str]) -> None:
    assert direct_read(argv) is None


def test_shell_completion_goes_to_typer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_ZATTERA_COMPLETE", "bash_complete")
    assert direct_read(["status"]) is None


def test_the_nats_url_comes_from_the_environment_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NATS_ENV, "nats://env:1")
    assert direct_read(["status"]) == ("status", "nats://env:1", {})
    assert direct_read(["--nats", "nats://cli:1", "status"]) == ("status", "nats://cli:1", {})


def _options(command: Any) -> dict[str, tuple[bool, object]]:
    """Every option of a typer command: its long name → (is a flag, default); typer's own (help, shell
    completion) are left out: those command lines go to typer."""
    own = {"--help", "--install-completion", "--show-completion"}
    return {
        opt: (bool(param.is_flag), param.default)
        for param in command.params
        for opt in param.opts
        if opt.startswith("--") and opt not in own and not param.is_eager
    }


def test_the_direct_reads_take_the_options_of_their_typer_commands() -> None:
    group = typer.main.get_command(app)
    assert _options(group) == dict.fromkeys(ROOT_OPTIONS, (False, ""))
    assert [p.envvar for p in group.params if "--nats" in p.opts] == [NATS_ENV]
    for name, (_, valued, flags) in READS.items():
        command = group.get_command(None, name)  # type: ignore[attr-defined]
        assert command.params and not [p for p in command.params if p.param_type_name == "argument"]
        expected = {opt: (False, "") for opt in valued} | {opt: (True, False) for opt in flags}
        assert _options(command) == expected, name


def _zattera(code: str, argv: list[str], nats_url: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZATTERA_", "OTEL_"))}
    env |= {NATS_ENV: nats_url, "ZATTERA_CONFIG_DIR": str(config), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["status"], 0),
        (["status", "--json"], 0),
        (["status", "--env", "demo/hello/production"], 0),
        (["ps", "--wide"], 0),
        (["ps", "--json", "--env", "demo/hello/production"], 0),
        (["status", "--env", "demo/hello/nosuch"], 1),  # a refusal: one line on stderr
        (["--nats", "nats://127.0.0.1:1", "ps"], 3),  # no server
    ],
    ids=["status", "status-json", "status-env", "ps-wide", "ps-json-env", "unknown-env", "no-server"],
)
def test_a_direct_read_answers_as_typer_does(
    cli: Invoke, nats_url: str, tmp_path: Path, argv: list[str], code: int
) -> None:
    assert cli("apps", "apply", str(ROOT / "examples" / "hello" / "zattera.toml")).exit_code == 0
    assert direct_read(argv) is not None
    direct = _zattera(DIRECT, argv, nats_url, tmp_path / "cli")
    typed = _zattera(THROUGH_TYPER, argv, nats_url, tmp_path / "cli")
    assert (direct.returncode, direct.stdout, direct.stderr) == (typed.returncode, typed.stdout, typed.stderr)
    assert direct.returncode == code, direct.stderr
    assert (direct.stdout if code == 0 else direct.stderr).strip()  # it did answer
