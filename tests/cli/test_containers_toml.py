"""zattera.toml keys of the docker runtime (docs/containers.md): ``[build] dockerfile/context_dir/build_args``
make the app's builds Dockerfile builds; ``read_only_root`` reaches the env's service spec."""

from __future__ import annotations

import json
from pathlib import Path

from zattera.v1 import types_pb2 as pb

from tests.cli.test_cli import _state, cli  # noqa: F401  (cli is a fixture)

SPEC = """
project = "demo"
app = "web"

[build]
dockerfile = "deploy/web.Dockerfile"
context_dir = "."
build_args = { VERSION = "1.2" }

[env.production]
read_only_root = true
"""


def test_dockerfile_build_and_read_only_root_are_applied(cli, nats_url, tmp_path: Path) -> None:  # noqa: F811
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    result = cli("apps", "apply", str(spec), "--json")
    assert result.exit_code == 0, result.output
    applied = json.loads(result.stdout)

    async def check(conn, view, writer):
        app = view.app(applied["app_id"])
        assert app.build.type == pb.BUILD_TYPE_DOCKERFILE
        assert (app.build.dockerfile, app.build.context_dir) == ("deploy/web.Dockerfile", ".")
        assert dict(app.build.build_args) == {"VERSION": "1.2"}
        assert view.env(applied["env_ids"]["production"]).service.read_only_root

    _state(nats_url, check)

    spec.write_text(SPEC.replace('dockerfile = "deploy/web.Dockerfile"\n', ""))
    assert cli("apps", "apply", str(spec), "--json").exit_code == 0

    async def plain(conn, view, writer):
        assert view.app(applied["app_id"]).build.type == pb.BUILD_TYPE_UNSPECIFIED

    _state(nats_url, plain)
