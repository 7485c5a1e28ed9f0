"""``strategy = "canary"`` in zattera.toml (issue 41): the defaults it gets, what reaches the release's
ServiceSpec, and one line naming the field for each bad value."""

from __future__ import annotations

import pytest

from cli.spec import SpecError, validate
from cli.spec_proto import service_spec


def spec(**env: object) -> dict[str, object]:
    return {"project": "demo", "app": "hello", "env": {"production": env}}


def test_red_green_stays_the_default_and_canary_gets_the_defaults() -> None:
    plain = validate(spec())
    assert not service_spec(plain, plain.env["production"]).HasField("canary")
    canary = validate(spec(strategy="canary"))
    s = service_spec(canary, canary.env["production"]).canary
    assert (list(s.steps), s.pause.seconds, s.max_error_ratio, s.max_latency_ratio, s.min_requests) == (
        [5, 25, 50, 100],
        60,
        0.01,
        1.5,
        100,
    )


def test_settings_reach_the_service_spec() -> None:
    app = validate(
        spec(strategy="canary", canary={"steps": [10, 100], "pause": "2s", "max_error_ratio": 0.05, "min_requests": 5})
    )
    s = service_spec(app, app.env["production"]).canary
    assert (list(s.steps), s.pause.seconds, s.max_error_ratio, s.min_requests) == ([10, 100], 2, 0.05, 5)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"strategy": "blue"}, "env.production.strategy: Input should be 'red-green' or 'canary'"),
        ({"strategy": "canary", "canary": {"steps": [50, 25, 100]}}, "env.production.canary.steps: steps must rise"),
        (
            {"strategy": "canary", "canary": {"steps": [5, 50]}},
            "env.production.canary.steps: the last step must be 100",
        ),
        (
            {"strategy": "canary", "canary": {"steps": [0, 100]}},
            "env.production.canary.steps: each step is a percentage",
        ),
        ({"strategy": "canary", "canary": {"pause": "soon"}}, "env.production.canary.pause: 'soon' is not a duration"),
        ({"strategy": "canary", "canary": {"max_error_ratio": 2}}, "env.production.canary.max_error_ratio: "),
        ({"strategy": "canary", "canary": {"max_latency_ratio": 0.5}}, "env.production.canary.max_latency_ratio: "),
        ({"strategy": "canary", "canary": {"min_requests": 0}}, "env.production.canary.min_requests: "),
        ({"strategy": "canary", "canary": {"step": [5]}}, "env.production.canary.step: unknown key"),
        ({"canary": {"steps": [5, 100]}}, 'env.production: canary: needs strategy = "canary"'),
    ],
)
def test_a_bad_value_is_one_line_naming_its_field(env: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError) as refused:
        validate(spec(**env))
    text = str(refused.value)
    assert len(text.splitlines()) == 1 and message in text, text
