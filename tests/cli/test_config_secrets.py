"""``zattera config`` / ``zattera secrets`` and ``[env.X.vars]`` against a real NATS server.

No secrets service runs here: a test publishes the cluster key's public half itself (``secretskey.cluster``)
and keeps the private half, so it can check that what the CLI stored opens to the value and that the value
appears in no output.
"""

from __future__ import annotations

import json
import secrets as pysecrets
from pathlib import Path
from typing import Any

import pytest
from nacl.public import PrivateKey
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.appconfig import MAX_VALUE_BYTES
from shared.secrets import CLUSTER_KEY, key_id, unseal
from shared.state.feed import StateView
from shared.txn import Writer
from tests.cli.rig import Invoke, state

SPEC = """
project = "demo"
app = "hello"

[run]
command = "python app.py"

[env.production]
[env.production.vars]
GREETING = "hi"
"""
ENV = "demo/hello/production"


def the_env(view: StateView) -> pb.Environment:
    return next(e for e in view.envs() if e.name == "production")


@pytest.fixture
def applied(cli: Invoke, tmp_path: Path) -> Path:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC)
    done = cli("apps", "apply", str(spec))
    assert done.exit_code == 0, done.output
    return spec


@pytest.fixture
def cluster_key(nats_url: str, applied: Path) -> PrivateKey:
    """The cluster key as the secrets service would publish it (its private half kept by the test)."""
    private = PrivateKey.generate()

    async def publish(conn: Any, view: StateView, writer: Writer) -> None:
        record = pb.SecretsKey(key_id=key_id(bytes(private.public_key)), public_key=bytes(private.public_key))
        record.meta.id = CLUSTER_KEY
        await writer.commit(writer.txn().create(record))

    state(nats_url, publish)
    return private


def deploy_release(nats_url: str) -> str:
    """Make the env run a release (as a finished deploy would), so a config change rolls out."""

    async def go(conn: Any, view: StateView, writer: Writer) -> str:
        env = the_env(view)
        release = pb.Release(environment_id=env.meta.id, app_id=env.app_id, project_id=env.project_id, version=1)
        release.meta.id = "01RELEASE1"
        release.image_ref = "demo/hello@sha256:" + "a" * 64
        release.service.CopyFrom(env.service)
        updated = pb.Environment()
        updated.CopyFrom(env)
        updated.active_release_id = release.meta.id
        await writer.commit(writer.txn().create(release).put(updated))
        return env.meta.id

    return str(state(nats_url, go))


def test_apply_sets_vars_and_a_later_apply_without_them_keeps_them(cli: Invoke, nats_url: str, applied: Path) -> None:
    assert json.loads(cli("config", "list", "--env", ENV, "--json").stdout)["vars"] == [
        {"name": "GREETING", "value": "hi", "running": False}
    ]
    applied.write_text(SPEC.replace('[env.production.vars]\nGREETING = "hi"\n', ""))
    assert cli("apps", "apply", str(applied)).exit_code == 0
    listed = json.loads(cli("config", "list", "--env", ENV, "--json").stdout)
    assert [v["name"] for v in listed["vars"]] == ["GREETING"] and listed["config_version"] == 1
    applied.write_text(SPEC.replace('GREETING = "hi"', 'GREETING = "hello"\nLEVEL = "debug"'))
    assert cli("apps", "apply", str(applied)).exit_code == 0
    listed = json.loads(cli("config", "list", "--env", ENV, "--json").stdout)
    assert {v["name"]: v["value"] for v in listed["vars"]} == {"GREETING": "hello", "LEVEL": "debug"}
    assert listed["config_version"] == 2


def test_config_set_and_unset_stage_without_a_release_and_roll_out_with_one(
    cli: Invoke, nats_url: str, applied: Path
) -> None:
    done = cli("config", "set", "--env", ENV, "A=1", "B=two words")
    assert done.exit_code == 0, done.output
    assert "used by the first deploy" in done.output
    env_id = deploy_release(nats_url)
    done = cli("config", "set", "--env", ENV, "A=3", "--no-watch")
    assert done.exit_code == 0, done.output
    assert "rolling out" in done.output
    done = cli("config", "unset", "--env", ENV, "B", "--no-deploy")
    assert done.exit_code == 0 and "staged for the next deploy" in done.output

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        env = the_env(view)
        assert dict(env.service.vars) == {"GREETING": "hi", "A": "3"} and env.service.config_version == 4
        releases = sorted(view.releases(env_id), key=lambda r: r.version)
        assert [r.version for r in releases] == [1, 2]  # the --no-deploy unset made no release
        new = releases[-1]
        assert dict(new.service.vars) == {"GREETING": "hi", "A": "3", "B": "two words"}
        assert new.image_ref == releases[0].image_ref and new.config_hash != releases[0].config_hash
        (deployment,) = [d for d in view.deployments(env_id) if d.release_id == new.meta.id]
        assert deployment.phase == pb.DEPLOYMENT_PHASE_PENDING and deployment.previous_release_id == "01RELEASE1"

    state(nats_url, check)
    table = cli("releases", "--env", ENV)
    assert "config" in table.output and "v3" in table.output


def test_secrets_set_seals_the_value_and_never_shows_it(
    cli: Invoke, nats_url: str, cluster_key: PrivateKey, tmp_path: Path
) -> None:
    value = "s3cr3t-" + pysecrets.token_hex(16)
    outputs = [cli("secrets", "set", "--env", ENV, "API_TOKEN", input=value + "\n")]
    source = tmp_path / "token"
    source.write_text(value + "-2")
    outputs.append(cli("secrets", "set", "--env", ENV, "API_TOKEN", "--from-file", str(source)))
    outputs.append(cli("secrets", "list", "--env", ENV))
    outputs.append(cli("secrets", "list", "--env", ENV, "--json"))
    assert all(o.exit_code == 0 for o in outputs), [o.output for o in outputs]
    assert not any(value in o.output for o in outputs)
    listed = json.loads(outputs[-1].stdout)
    assert [(s["name"], s["version"]) for s in listed["secrets"]] == [("API_TOKEN", 2)]

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        env = the_env(view)
        ref = env.service.secrets["API_TOKEN"]
        record = view.get(K.SECRET, ref.secret_id)
        assert isinstance(record, pb.SealedSecret) and record.version == 2
        assert record.key_id == key_id(bytes(cluster_key.public_key))
        assert value.encode() not in record.ciphertext
        assert unseal(cluster_key, record.ciphertext) == (value + "-2").encode()
        # v1 is used by no release and not staged any more: deleted in the same write as v2.
        assert [s.version for s in view.secrets(env.meta.id)] == [2]

    state(nats_url, check)
    assert cli("secrets", "unset", "--env", ENV, "API_TOKEN").exit_code == 0
    assert json.loads(cli("secrets", "list", "--env", ENV, "--json").stdout)["secrets"] == []


def test_a_secret_set_with_a_live_release_rolls_out_keeping_the_old_version_for_rollback(
    cli: Invoke, nats_url: str, cluster_key: PrivateKey
) -> None:
    assert cli("secrets", "set", "--env", ENV, "DB_PASSWORD", "--no-deploy", input="one").exit_code == 0
    env_id = deploy_release(nats_url)  # release v1 carries DB_PASSWORD v1
    done = cli("secrets", "set", "--env", ENV, "DB_PASSWORD", "--no-watch", input="two")
    assert done.exit_code == 0 and "rolling out" in done.output, done.output

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        by_version = {r.version: r for r in view.releases(env_id)}
        assert by_version[1].service.secrets["DB_PASSWORD"].version == 1
        assert by_version[2].service.secrets["DB_PASSWORD"].version == 2
        assert sorted(s.version for s in view.secrets(env_id)) == [1, 2]

    state(nats_url, check)


BIG = "x" * (MAX_VALUE_BYTES + 1)


@pytest.mark.parametrize(
    ("args", "stdin", "field"),
    [
        (("config", "set", "--env", ENV, "1ABC=x"), None, "vars.1ABC"),
        (("config", "set", "--env", ENV, "MY-VAR=x"), None, "vars.MY-VAR"),
        (("config", "set", "--env", ENV, "PORT=80"), None, "vars.PORT"),
        (("config", "set", "--env", ENV, "ZATTERA_NODE_ID=x"), None, "vars.ZATTERA_NODE_ID"),
        (("config", "set", "--env", ENV, "NOVALUE"), None, "NOVALUE: expected KEY=VALUE"),
        (("config", "set", "--env", ENV, f"BIG={BIG}"), None, "vars.BIG"),
        (("config", "set", "--env", ENV, *(f"V{i}={'y' * 60_000}" for i in range(20))), None, "vars: variables"),
        (("config", "set", "--env", "demo/hello/nope", "A=1"), None, "--env"),
        (("config", "unset", "--env", ENV, "MISSING"), None, "vars.MISSING: not set"),
        (("secrets", "set", "--env", ENV, "API_KEY"), "v", "secrets.API_KEY: no cluster secrets key"),
        (("secrets", "set", "--env", ENV, "9LIVES"), "v", "secrets.9LIVES"),
        (("secrets", "set", "--env", ENV, "ZATTERA_TOKEN"), "v", "secrets.ZATTERA_TOKEN"),
        (("secrets", "set", "--env", ENV, "HUGE"), BIG, "secrets.HUGE"),
        (("secrets", "set", "--env", ENV, "EMPTY"), "", "secrets.EMPTY: the value is empty"),
        (("secrets", "set", "--env", "nope", "API_KEY"), "v", "--env"),
        (("secrets", "set", "--env", ENV, "API_KEY", "--from-file", "/nonexistent/key"), None, "--from-file"),
        (("secrets", "unset", "--env", ENV, "API_KEY"), None, "secrets.API_KEY: not set"),
        (("secrets", "set", "--env", ENV, f"API_KEY={BIG}"), "v", "secrets.API_KEY: give the name only"),
        (("secrets", "unset", "--env", ENV, f"API_KEY={BIG}"), None, "secrets.API_KEY: give the name only"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    cli: Invoke, nats_url: str, applied: Path, args: tuple[str, ...], stdin: str | None, field: str
) -> None:
    async def snapshot(conn: Any, view: StateView, writer: Writer) -> tuple[int, int]:
        env = the_env(view)
        return view.rev(K.env(env.meta.id)), len(view.secrets(env.meta.id))

    before = state(nats_url, snapshot)
    done = cli(*args, input=stdin)
    assert done.exit_code != 0
    assert field in done.output, done.output
    assert "Traceback" not in done.output
    assert BIG not in done.output
    assert state(nats_url, snapshot) == before


def test_bad_vars_in_the_spec_are_refused_naming_the_field(cli: Invoke, tmp_path: Path) -> None:
    spec = tmp_path / "zattera.toml"
    spec.write_text(SPEC.replace('GREETING = "hi"', 'PORT = "80"'))
    done = cli("apps", "apply", str(spec))
    assert done.exit_code != 0 and "env.production.vars" in done.output and "reserved" in done.output


def test_a_name_cannot_be_both_a_variable_and_a_secret(cli: Invoke, nats_url: str, cluster_key: PrivateKey) -> None:
    done = cli("secrets", "set", "--env", ENV, "GREETING", input="x")
    assert done.exit_code != 0 and "secrets.GREETING: is a plain variable" in done.output
    assert cli("secrets", "set", "--env", ENV, "TOKEN", input="x").exit_code == 0
    done = cli("config", "set", "--env", ENV, "TOKEN=y")
    assert done.exit_code != 0 and "vars.TOKEN: is a secret" in done.output


def test_an_env_close_to_the_limit_is_written_and_rolls_out(cli: Invoke, nats_url: str, applied: Path) -> None:
    deploy_release(nats_url)
    big = [f"V{i}={chr(65 + i) * 60_000}" for i in range(17)]  # ~1,000,000 bytes, under 1 MiB
    done = cli("config", "set", "--env", ENV, *big, "--no-watch")
    assert done.exit_code == 0, done.output[-500:]
    assert "rolling out" in done.output

    async def check(conn: Any, view: StateView, writer: Writer) -> None:
        newest = max(view.releases(the_env(view).meta.id), key=lambda r: r.version)
        assert len(newest.service.vars) == 18

    state(nats_url, check)


def test_a_value_sealed_to_a_key_that_was_just_rotated_is_refused(nats_url: str, cluster_key: PrivateKey) -> None:
    """The write of a sealed value expects the revision of the key record it was sealed to."""
    from shared.actions.secrets import set_secret_edit
    from shared.txn import Conflict

    async def race(conn: Any, view: StateView, writer: Writer) -> None:
        env = pb.Environment()
        env.CopyFrom(the_env(view))
        txn = writer.txn()
        set_secret_edit(view, "API_TOKEN", "v")(env, txn)
        txn.put(env)
        rotated = pb.SecretsKey()
        rotated.CopyFrom(view.get(K.SECRETS_KEY, CLUSTER_KEY))  # type: ignore[arg-type]
        new_key = PrivateKey.generate()
        rotated.public_key, rotated.key_id = bytes(new_key.public_key), key_id(bytes(new_key.public_key))
        await writer.commit(writer.txn().put(rotated))
        with pytest.raises(Conflict):
            await writer.commit(txn)
        assert view.secrets(env.meta.id) == []

    state(nats_url, race)
