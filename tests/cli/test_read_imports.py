"""A plain read (``zattera status``, ``zattera ps``) run as the operator runs it, a new process against a real
cluster, imports none of the heavy modules it does not need (PERFORMANCE.md "CLI start-up": interpreter
start-up and imports are most of a read's time). A module listed here coming back on the read path is a
regression of start-up time, found here without a timing assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.rig import Invoke
from tests.e2e.cluster import ROOT

HEAVY = (
    "pydantic",  # typer's adapters for plain str/bool options; the contexts file's models (no file: not read)
    "pydantic_core",
    "pydantic_settings",  # the platform's settings (the CLI reads its three connection settings by hand)
    "typer._adapters",
    "aiohttp",  # nats-py's websocket transport
    "cryptography",  # security and secrets commands
    "nacl",
    "opentelemetry",  # the API too: instruments are made at their first use, spans when traces are exported
    "ulid",  # a read mints no id
    "prometheus_client",
    "psutil",
    "cli.deploy_cmds",  # other command groups
    "cli.secrets_cmds",
    "cli.up",
    "typer",  # a plain read runs without typer (cli/main.py READS); its vendored click with it
    "cli.app",
    "cli.env_cmds",
    "cli.inspect_cmds",
    "importlib.metadata",  # nats-py's version is read from its .dist-info name (cli/startup.py)
    "cli.writer",  # the write path: made at the first write
    "shared.txn",
    "shared.retry",
    "shared.actions.context",
    "shared.actions.deletion",
    "shared.actions.envs",
    "shared.provisioning",
    "shared.migrations",
    "shared.skew",
    "packaging",
    "google.protobuf.json_format",  # only `--json` of messages
)

PROBE = """
import atexit, json, os, sys
atexit.register(lambda: open(os.environ["MODULES_OUT"], "w").write(json.dumps(sorted(sys.modules))))
from cli.main import main
main()
"""


@pytest.mark.parametrize(
    ("argv", "shown"),
    [(["status"], "demo/hello/production"), (["ps"], "assignments"), (["status", "--json"], "demo/hello/production")],
    ids=["status", "ps", "status-json"],
)
def test_a_plain_read_imports_no_heavy_module(
    cli: Invoke, nats_url: str, tmp_path: Path, argv: list[str], shown: str
) -> None:
    assert cli("apps", "apply", str(ROOT / "examples" / "hello" / "zattera.toml")).exit_code == 0
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZATTERA_", "OTEL_"))}
    env |= {"ZATTERA_NATS_URL": nats_url, "ZATTERA_CONFIG_DIR": str(tmp_path / "cli"), "MODULES_OUT": str(out)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert shown in done.stdout  # the read did read the cluster
    loaded = set(json.loads(out.read_text()))
    heavy = sorted(m for m in loaded for h in HEAVY if m == h or m.startswith(h + "."))
    assert heavy == [], f"`zattera {' '.join(argv)}` imports {heavy} (PERFORMANCE.md 'CLI start-up')"


def test_options_coerced_without_pydantic_keep_typer_s_rules() -> None:
    """The CLI coerces plain str and bool options itself (cli/app.py); everything else, and a bool given as
    text (an environment variable), still goes through typer's adapter, with its messages."""
    import typer
    from typer.testing import CliRunner

    import cli.app  # noqa: F401  (installs the coercion)

    assert typer.core.build_runtime_param.__module__ == "cli.app"  # installed: typer's internals are as expected

    seen: list[tuple[str, bool, int]] = []
    app = typer.Typer()

    @app.command()
    def show(
        name: str = typer.Option("", "--name"),
        flag: bool = typer.Option(False, "--flag", envvar="PROBE_FLAG"),
        count: int = typer.Option(1, "--count"),
    ) -> None:
        seen.append((name, flag, count))

    runner = CliRunner()
    assert runner.invoke(app, ["--name", "a b", "--flag", "--count", "3"]).exit_code == 0
    assert runner.invoke(app, [], env={"PROBE_FLAG": "yes"}).exit_code == 0
    assert runner.invoke(app, [], env={"PROBE_FLAG": "0"}).exit_code == 0
    assert seen == [("a b", True, 3), ("", True, 1), ("", False, 1)]
    bad = runner.invoke(app, ["--count", "three"])
    assert bad.exit_code == 2 and "--count" in bad.output


def test_version_loads_no_nats(tmp_path: Path) -> None:
    """``--version`` goes through typer but connects to nothing: nats-py (with asyncio) is imported before a
    command's module or the root options, not with the app."""
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZATTERA_", "OTEL_"))} | {"MODULES_OUT": str(out)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("zattera ")
    loaded = sorted(m for m in json.loads(out.read_text()) if m.split(".")[0] in ("nats", "asyncio", "google"))
    assert loaded == []
