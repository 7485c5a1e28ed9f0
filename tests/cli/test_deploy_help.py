"""``zattera deploy`` reads as ``zattera deploy DIR --env E``: its help and error hints never show the internal
``run`` subcommand, and ``deploy watch / cancel / list`` still work (against a real NATS server)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

USAGE = "Usage: zattera deploy DIR [--env E] [OPTIONS]"


def test_help_shows_the_deploy_itself_then_its_subcommands() -> None:
    runner = CliRunner()
    for args in (["deploy", "--help"], ["deploy"], ["deploy", "run", "--help"]):
        out = runner.invoke(app, args, env={"COLUMNS": "120"}, prog_name="zattera").output
        assert USAGE in out, args
        assert "zattera deploy --env E (--image REF | --build ID) [OPTIONS]" in out
        assert "DIR" in out and "--env" in out and "--image" in out and "--build" in out
        assert " run " not in out and "deploy run" not in out
    group = runner.invoke(app, ["deploy", "--help"], env={"COLUMNS": "120"}, prog_name="zattera").output
    for subcommand in ("watch", "cancel", "list"):
        assert f"│ {subcommand} " in group


def test_a_usage_error_points_at_deploy_help_not_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["deploy", str(tmp_path)], env={"COLUMNS": "120"}, prog_name="zattera")
    assert result.exit_code == 2
    assert USAGE in result.output and "Try 'zattera deploy --help' for help." in result.output
    assert "--env" in result.output


def test_deploy_and_its_subcommands_still_work(cli, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text('project = "demo"\napp = "hello"\n[env.production]\nreplicas = 1\n')
    assert cli("apps", "apply", str(spec)).exit_code == 0
    created = cli("deploy", "--env", "demo/hello/production", "--image", "registry/hello:1", "--no-watch")
    assert created.exit_code == 0, created.stderr
    deployment_id = created.stdout.strip()
    assert [d["meta"]["id"] for d in json.loads(cli("deploy", "list", "--json").stdout)] == [deployment_id]
    listed = cli("deploy", "list").stdout
    assert deployment_id in listed and "demo/hello/production" in listed
    assert cli("deploy", "cancel", deployment_id).exit_code == 0
    watched = cli("deploy", "watch", "NO-SUCH-DEPLOYMENT")  # the watch subcommand, not a DIR to deploy
    assert "deployment 'NO-SUCH-DEPLOYMENT' not found" in watched.stderr, watched.output
