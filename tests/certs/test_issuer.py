"""How the CA's answers become the loop's inputs: its problem text and its Retry-After (seconds or a date)."""

from __future__ import annotations

import datetime
from email.utils import format_datetime

import pytest
import requests
from acme import messages

from services.certs.issuer import problem_text, retry_after

IN_ONE_HOUR = "<an HTTP date one hour from now>"


class Recorded:
    """The one attribute :func:`retry_after` reads of the issuer's network object."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.last_response = requests.Response()
        self.last_response.headers.update(headers)


@pytest.mark.parametrize(
    ("headers", "low", "high"),
    [
        ({}, None, None),
        ({"Retry-After": "120"}, 110.0, 120.0),
        ({"Retry-After": IN_ONE_HOUR}, 3500.0, 3600.0),
    ],
)
def test_retry_after_is_read_in_seconds_or_as_a_date(
    headers: dict[str, str], low: float | None, high: float | None
) -> None:
    if headers.get("Retry-After") == IN_ONE_HOUR:  # the date is made now, not when the module was collected
        in_one_hour = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        headers = {"Retry-After": format_datetime(in_one_hour, True)}
    found = retry_after(Recorded(headers))  # type: ignore[arg-type]
    if low is None:
        assert found is None
    else:
        assert found is not None and low <= found <= high


def test_the_cas_problem_is_kept_in_its_own_words() -> None:
    problem = messages.Error.with_code("rateLimited", detail="too many certificates already issued")
    assert problem_text(problem) == "rateLimited: too many certificates already issued"
