"""``zattera deploy DIR``: DIR's zattera.toml decides which app it is (a folder of another app is refused unless
forced, one env named is the default ``--env``), and a source a build would refuse is refused before the upload,
with the builder's own message (against a real NATS server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared.buildplan import PlanError, detect, read_source
from shared.connection import connect
from shared.streams import object_store_stream
from shared.subjects import SOURCES_STORE
from tests.cli.rig import Invoke, state

EXPRESS = 'project = "demo"\napp = "express"\n[env.production]\n[run]\ncommand = "node server.js"\n'
ENVDUMP = 'project = "walk"\napp = "envdump"\n[env.production]\n[run]\ncommand = "python app.py"\n'


def folder(root: Path, name: str, toml: str) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "zattera.toml").write_text(toml)
    (directory / "app.py").write_text("print('hi')\n")
    return directory


def flat(text: str) -> str:
    """A usage error's text without the frame and line breaks of its panel."""
    return " ".join(text.replace("│", " ").split())


def applied(cli: Invoke, directory: Path) -> None:
    assert cli("apps", "apply", str(directory / "zattera.toml")).exit_code == 0


def uploads(nats_url: str) -> int:
    async def go() -> int:
        conn = await connect(nats_url, name="t")
        try:
            return (await conn.js.stream_info(object_store_stream(SOURCES_STORE))).state.messages
        finally:
            await conn.close()

    return asyncio.run(go())


def deployments(nats_url: str) -> list[str]:
    async def go(conn, view, writer) -> list[str]:
        return [d.environment_id for d in view.deployments()]

    return state(nats_url, go)


def test_a_folder_of_another_app_is_refused_naming_both_unless_forced(
    cli: Invoke, nats_url: str, tmp_path: Path
) -> None:
    express, envdump = folder(tmp_path, "express", EXPRESS), folder(tmp_path, "envdump", ENVDUMP)
    applied(cli, express)
    applied(cli, envdump)
    refused = cli("deploy", str(envdump), "--env", "demo/express/production", "--no-watch")
    assert refused.exit_code == 1
    assert "names walk/envdump, not demo/express (--env demo/express/production)" in refused.stderr
    assert "--env walk/envdump/production" in refused.stderr and "--force" in refused.stderr
    assert deployments(nats_url) == [] and uploads(nats_url) == 0
    forced = cli("deploy", str(envdump), "--env", "demo/express/production", "--no-watch", "--force")
    assert forced.exit_code == 0, forced.stderr
    assert (
        "--force: deploying walk/envdump's source into demo/express/production, replacing nothing yet" in forced.stderr
    )
    assert len(deployments(nats_url)) == 1
    own = cli("deploy", str(envdump), "--env", "walk/envdump/production", "--no-watch")
    assert own.exit_code == 0, own.stderr


def test_the_one_env_the_toml_names_is_the_default_env(cli: Invoke, nats_url: str, tmp_path: Path) -> None:
    express = folder(tmp_path, "express", EXPRESS)
    applied(cli, express)
    created = cli("deploy", str(express), "--no-watch")
    assert created.exit_code == 0, created.stderr
    assert "of demo/express/production" in created.stderr
    two = folder(tmp_path, "two", EXPRESS + "[env.staging]\n")
    ambiguous = cli("deploy", str(two), "--no-watch")
    assert ambiguous.exit_code == 2
    assert "names 2 envs (production, staging)" in flat(ambiguous.output)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "index.html").write_text("<p>hi</p>")
    assert "--env: not given, and" in flat(cli("deploy", str(bare), "--no-watch").output)


@pytest.mark.parametrize(
    "toml",
    [
        'project = "demo"\napp = "express"\n[env.production\n',  # not TOML
        EXPRESS.replace('command = "node server.js"', "command = 3"),  # a step that is not a command
        'project = "demo"\napp = "express"\n[env.production]\n[build]\ninstall = ["npm", "ci"]\n',
    ],
    ids=["syntax", "run-command-not-a-string", "install-not-a-string"],
)
def test_a_source_the_build_would_refuse_is_refused_before_the_upload_with_the_builders_message(
    cli: Invoke, nats_url: str, tmp_path: Path, toml: str
) -> None:
    applied(cli, folder(tmp_path, "good", EXPRESS))
    broken = folder(tmp_path, "broken", toml)
    with pytest.raises(PlanError) as builder:  # what the builder (services/agent/builder.py) fails the build with
        detect(read_source(broken))
    refused = cli("deploy", str(broken), "--env", "demo/express/production", "--no-watch")
    assert refused.exit_code == 1
    assert str(builder.value) in refused.stderr and "nothing was uploaded" in refused.stderr
    assert deployments(nats_url) == [] and uploads(nats_url) == 0
