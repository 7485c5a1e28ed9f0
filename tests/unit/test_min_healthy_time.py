"""``min_healthy_time`` in zattera.toml → ``ServiceSpec.min_healthy_time``: unset stays unset (the agent's
default applies), a value (zero included) is carried as given."""

from __future__ import annotations

import tomllib

import pytest

from cli.spec import validate
from cli.spec_proto import service_spec


@pytest.mark.parametrize(
    ("line", "present", "seconds"),
    [
        ("", False, 0.0),
        ('min_healthy_time = "10s"', True, 10.0),
        ('min_healthy_time = "0s"', True, 0.0),
        ("min_healthy_time = 1.5", True, 1.5),
        ('min_healthy_time = "500ms"', True, 0.5),
    ],
)
def test_the_key_reaches_the_service_spec(line: str, present: bool, seconds: float) -> None:
    raw = tomllib.loads(f'project = "d"\napp = "a"\n[env.p]\n{line}\n')
    spec = validate(raw)
    service = service_spec(spec, spec.env["p"])
    assert service.HasField("min_healthy_time") is present
    assert service.min_healthy_time.ToNanoseconds() == round(seconds * 1e9)
