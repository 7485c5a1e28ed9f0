"""Invalid app specs and CLI arguments: the error names the field (hypothesis over out-of-range values)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli.main import app
from cli.spec import SpecError, validate

BASE: dict[str, Any] = {"project": "demo", "app": "hello", "env": {"production": {}}}

# (dotted path inside env.production, strategy of values that must be refused)
BAD_FIELDS: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("replicas.min", st.one_of(st.integers(max_value=-1), st.integers(min_value=1001), st.text(min_size=1))),
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
