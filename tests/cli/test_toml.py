"""zattera.toml keys added for the operator experience (docs/zattera-toml.md): the ``replicas = N``
shorthand and the per-env proxy middleware, applied against a real NATS server."""

from __future__ import annotations

import json
from pathlib import Path

import bcrypt
import pytest

from tests.cli.rig import state

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()

SPEC = f"""
project = "demo"
app = "hello"

[env.production]
replicas = 3
rate_limit = {{ requests_per_second = 20, burst = 40 }}
domains = ["hello.example.com"]

[env.production.middleware]
ip_allowlist = ["10.0.0.0/8", "192.0.2.7"]
basic_auth = [{{ username = "ops", password_hash = "{HASH}" }}, {{ username = "ci", password_hash = "{HASH}" }}]
max_body = "1MiB"
sticky_sessions = true
redirect_https = true
"""


def test_replicas_shorthand_and_middleware_are_written_to_the_env(cli, nats_url, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    result = cli("apps", "apply", str(spec), "--json")
    assert result.exit_code == 0, result.output
    env_id = json.loads(result.stdout)["env_ids"]["production"]

    async def check(conn, view, writer):
        env = view.env(env_id)
        assert (env.service.replicas.min, env.service.replicas.max) == (3, 0)
        m = env.middleware
        assert list(m.ip_allowlist) == ["10.0.0.0/8", "192.0.2.7"]
        assert (m.basic_auth_username, m.basic_auth_password_hash) == ("ops", HASH)  # every proxy version knows it
        assert [(u.username, u.password_hash) for u in m.basic_auth_users] == [("ci", HASH)]
        assert (m.max_body_bytes, m.sticky_sessions, m.redirect_https) == (1024 * 1024, True, True)
        assert (env.service.rate_limit.requests_per_second, env.service.rate_limit.burst) == (20, 40)

    state(nats_url, check)
    again = json.loads(cli("apps", "apply", str(spec), "--json").stdout)
    assert again["updated"] == [] and again["created"] == []

    spec.write_text(SPEC.split("[env.production.middleware]")[0])  # middleware removed from the file
    assert "env production" in json.loads(cli("apps", "apply", str(spec), "--json").stdout)["updated"]

    async def cleared(conn, view, writer):
        assert not view.env(env_id).HasField("middleware")

    state(nats_url, cleared)


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ('replicas = "two"', "env.p.replicas", "must be a number (replicas = 2) or a table"),
        ("replicas = -1", "env.p.replicas.min", "greater than or equal to 0"),
        ('middleware = { ip_allowlist = ["10.0.0.300/8"] }', "env.p.middleware.ip_allowlist", "not an IP"),
        (
            'middleware = { basic_auth = [{ username = "a", password_hash = "hunter2" }] }',
            "env.p.middleware.basic_auth.0.password_hash",
            "must be a bcrypt hash",
        ),
        ('middleware = { max_body = "a lot" }', "env.p.middleware.max_body", "not a size"),
        ("middleware = { gzip = true }", "env.p.middleware.gzip", "unknown key"),
        ('secrets = { API_KEY = "hunter2" }', "env.p.secrets", "secrets are never in zattera.toml"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_nothing_is_written(
    cli,
    nats_url,
    tmp_path: Path,
    body: str,
    field: str,
    says: str,
) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(f'project = "d"\napp = "a"\n[env.p]\n{body}\n')
    result = cli("apps", "apply", str(spec))
    assert result.exit_code == 1
    assert f": {field}: " in result.stderr and says in result.stderr
    assert "Value error" not in result.stderr
    assert "hunter2" not in result.stderr  # a password or secret put in the file is not printed back

    async def nothing(conn, view, writer):
        assert view.envs() == []

    state(nats_url, nothing)


def test_a_domain_of_another_env_is_refused_naming_the_field_and_that_env(cli, nats_url, tmp_path: Path) -> None:
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text('project = "demo"\napp = "a"\n[env.prod]\ndomains = ["shop.example.com"]\n')
    second.write_text('project = "demo"\napp = "b"\n[env.prod]\ndomains = ["shop.example.com"]\n')
    assert cli("apps", "apply", str(first)).exit_code == 0
    refused = cli("apps", "apply", str(second))
    assert refused.exit_code == 1
    assert "env.prod.domains: shop.example.com is already routed to demo/a/prod" in refused.stderr

    async def only_the_first(conn, view, writer):
        assert [a.name for a in view.all("app")] == ["a"]

    state(nats_url, only_the_first)
