"""Invalid app specs and CLI arguments: the error names the field (hypothesis over out-of-range values), in
one line, without a traceback; commands that need the cluster run against the bad-input rig's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner, Result

from cli.main import app
from cli.spec import Env, SpecError, validate
from tests.badinput.rig import AGENT_NODE, Rig

BASE: dict[str, Any] = {"project": "demo", "app": "hello", "env": {"production": {}}}

# Text that is not a number: the spec model coerces numeric strings ("3", " +1 ", "1_000", "1.0") to ints
# (pydantic's lax mode), which is lenient but not wrong, so those are not "bad input".
NOT_A_NUMBER = st.text(min_size=1).filter(lambda s: not re.fullmatch(r"\s*[+-]?[\d_]+(\.0*)?\s*", s))

# (dotted path inside env.production, strategy of values that must be refused)
BAD_FIELDS: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("replicas.min", st.one_of(st.integers(max_value=-1), st.integers(min_value=1001), NOT_A_NUMBER)),
    ("replicas.max", st.one_of(st.integers(max_value=-1), st.integers(min_value=1001))),
    ("resources.cpu_millis", st.one_of(st.integers(max_value=-1), st.integers(min_value=1_000_001))),
    ("resources.memory_mb", st.integers(min_value=10_000_001)),
    ("max_concurrency", st.one_of(st.integers(max_value=-1), st.integers(min_value=100_001))),
    ("autoscale.target_cpu_percent", st.one_of(st.integers(max_value=-1), st.integers(min_value=101))),
    ("healthcheck.unhealthy_threshold", st.one_of(st.integers(max_value=0), st.integers(min_value=101))),
    ("healthcheck.type", st.text(min_size=1).filter(lambda s: s not in ("http", "tcp", "exec", "auto"))),
    ("rate_limit.requests_per_second", st.integers(max_value=0)),
]


def nested(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cursor = out
    parts = path.split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), which=st.integers(0, len(BAD_FIELDS) - 1))
def test_an_out_of_range_spec_value_is_refused_naming_its_field(data: st.DataObject, which: int) -> None:
    path, strategy = BAD_FIELDS[which]
    value = data.draw(strategy)
    raw = {**BASE, "env": {"production": nested(path, value)}}
    if path.startswith("rate_limit."):
        raw["env"]["production"]["rate_limit"].setdefault("burst", 0)
    try:
        validate(raw)
    except SpecError as exc:
        assert f"env.production.{path}" in str(exc), str(exc)
    else:
        raise AssertionError(f"{path} = {value!r} was accepted")


def boolean_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every boolean field of a spec model and the models it holds (so a new flag is checked too)."""
    found = []
    for name, info in model.model_fields.items():
        kinds = [info.annotation, *get_args(info.annotation)]
        if bool in kinds:
            found.append(prefix + name)
        found += [
            path
            for kind in kinds
            if isinstance(kind, type) and issubclass(kind, BaseModel)
            for path in boolean_fields(kind, f"{prefix}{name}.")
        ]
    return found


@pytest.mark.parametrize("path", boolean_fields(Env))
@pytest.mark.parametrize("value", ["yes", "true", "false", 1, 0])
def test_a_boolean_is_a_toml_boolean_and_anything_else_is_refused_naming_its_field(path: str, value: Any) -> None:
    with pytest.raises(SpecError, match=rf"env\.production\.{re.escape(path)}: must be true or false"):
        validate({**BASE, "env": {"production": nested(path, value)}})
    assert validate({**BASE, "env": {"production": nested(path, False)}})


def test_the_spec_has_the_flags_the_docs_describe() -> None:
    assert {"scale_to_zero", "stateful", "middleware.sticky_sessions", "middleware.redirect_https"} <= set(
        boolean_fields(Env)
    )


@settings(max_examples=40, deadline=None)
@given(name=st.text(min_size=1, max_size=80).filter(lambda s: not s.isascii() or not s.islower() or len(s) > 63))
def test_a_bad_project_name_is_refused_naming_the_field(name: str) -> None:
    try:
        validate({**BASE, "project": name})
    except SpecError as exc:
        assert "project" in str(exc)
    else:
        assert name.isascii()  # a lowercase ascii name may be valid


@settings(max_examples=20, deadline=None)
@given(count=st.one_of(st.integers(max_value=0), st.integers(min_value=6)))
def test_up_refuses_an_out_of_range_nats_cluster_naming_the_option(count: int) -> None:
    result = CliRunner().invoke(app, ["up", "--nats-cluster", str(count)])
    assert result.exit_code != 0
    assert "--nats-cluster" in result.output


# ------------------------------------------------------------------------ invalid CLI arguments, live cluster


def zattera(rig: Rig, *args: str) -> Result:
    return CliRunner().invoke(app, ["--nats", rig.server.url, *args])


def assert_refused(result: Result, *names: str) -> None:
    """Exit non-zero with one line ``error: …`` naming the bad argument, and no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.fixture(scope="module")
def cli_files(rig: Rig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An app applied through the CLI (``badcli/hello/production``) and the files the ``apps apply`` cases read."""
    directory = tmp_path_factory.mktemp("cli")
    (directory / "ok.toml").write_text('project = "badcli"\napp = "hello"\n\n[env.production]\n')
    (directory / "broken.toml").write_text('project = "badcli"\napp = \n')
    (directory / "latin1.toml").write_bytes('project = "caf\xe9"\n'.encode("latin-1"))
    (directory / "a-directory.toml").mkdir()
    applied = zattera(rig, "apps", "apply", str(directory / "ok.toml"))
    assert applied.exit_code == 0, applied.output
    return directory


ENV = "badcli/hello/production"
CLI_CASES: list[tuple[list[str], list[str]]] = [
    # (arguments; what the one error line must name) — "{dir}" is the cli_files directory
    (["deploy", "--env", "no-such-env", "--image", "nginx:1", "--no-watch"], ["--env", "'no-such-env'"]),
    (["deploy", "--env", "badcli/hello", "--image", "nginx:1", "--no-watch"], ["--env", "'badcli/hello'"]),
    (["deploy", "--env", f"{ENV}/extra", "--image", "nginx:1", "--no-watch"], ["--env", f"'{ENV}/extra'"]),
    (["deploy", "--env", "badcli/nope/production", "--image", "nginx:1", "--no-watch"], ["--env"]),
    (["deploy", "--env", ENV, "--image", "two words", "--no-watch"], ["--image", "'two words'"]),
    (["deploy", "--env", ENV, "--build", "01JNOSUCHBUILD000000000000", "--no-watch"], ["--build", "01JNOSUCHBUILD"]),
    (["rollback", "--env", ENV, "--to", "01JNOSUCHRELEASE0000000000", "--no-watch"], ["--to", "01JNOSUCHRELEASE"]),
    (["rollback", "--env", ENV, "--to", "../etc", "--no-watch"], ["--to", "'../etc'"]),
    (["rollback", "--env", "no-such-env", "--to", "r1", "--no-watch"], ["--env", "'no-such-env'"]),
    (["nodes", "label", AGENT_NODE, "zone"], ["labels", "'zone'", "key=value"]),
    (["nodes", "label", AGENT_NODE, "=eu"], ["labels", "'=eu'", "key=value"]),
    (["nodes", "label", "no-such-node", "zone=eu"], ["node", "'no-such-node'"]),
    (["builds", "logs", "no-such-build"], ["build", "'no-such-build'", "not found"]),
    (["builds", "logs", "no-such-build", "--follow"], ["build", "'no-such-build'", "not found"]),
    (["builds", "logs", "a.b*"], ["build id", "'a.b*'"]),
    (["volumes", "restore", "no-such-volume", "01JSNAP"], ["volume", "no-such-volume"]),
    (["apps", "apply", "{dir}/missing.toml"], ["missing.toml", "no such file"]),
    (["apps", "apply", "{dir}/broken.toml"], ["broken.toml", "not valid TOML", "line 2"]),
    (["apps", "apply", "{dir}/a-directory.toml"], ["a-directory.toml", "cannot read"]),
    (["apps", "apply", "{dir}/latin1.toml"], ["latin1.toml", "cannot read"]),
    (["run", "--env", "no-such-env", "--", "true"], ["--env", "'no-such-env'"]),
    (["run", "--env", ENV, "--", "true"], ["--env", ENV, "no active release"]),
    (["run", "--env", ENV, "--", "x" * 5000], ["command", "4096-byte limit"]),
    (["jobs", "show", "a.b*"], ["job id", "'a.b*'"]),
    (["jobs", "cancel", "01JNOSUCHJOB00000000000000"], ["JOB_ID", "no job '01JNOSUCHJOB00000000000000'"]),
    (["jobs", "list", "--env", "no-such-env"], ["--env", "'no-such-env'"]),
]


@pytest.mark.parametrize(
    ("args", "names"), CLI_CASES, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in enumerate(CLI_CASES)]
)
def test_an_invalid_cli_argument_is_refused_in_one_line_naming_it(
    rig: Rig, cli_files: Path, args: list[str], names: list[str]
) -> None:
    result = zattera(rig, *(a.replace("{dir}", str(cli_files)) for a in args))
    assert_refused(result, *names)
    assert not rig.dead()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(label=st.text(min_size=0, max_size=30).filter(lambda s: ("=" not in s or s.startswith("=")) and s[:1] != "-"))
def test_nodes_label_refuses_a_malformed_key_value_naming_it(rig: Rig, label: str) -> None:
    assert_refused(zattera(rig, "nodes", "label", AGENT_NODE, label), "labels", repr(label), "key=value")
