"""Sessions and the login limiter: pure state on a fake clock."""

from __future__ import annotations

import pytest

from services.console.auth import LoginLimiter, Sessions, tokens_equal
from shared.clock import FakeClock


async def test_a_session_lasts_its_ttl_and_ends_at_logout() -> None:
    clock = FakeClock(1000.0)
    sessions = Sessions(clock, ttl=60.0)
    token, opened = sessions.open("ada", "admin")
    assert sessions.get(token) == opened and len(opened.csrf) >= 40 and opened.csrf != token
    await clock.advance(59)
    assert sessions.get(token) == opened
    await clock.advance(1)
    assert sessions.get(token) is None
    again, _ = sessions.open("ada", "admin")
    assert again != token
    sessions.close(again)
    assert sessions.get(again) is None and sessions.get("") is None and sessions.get("forged") is None


def test_a_role_change_keeps_the_session_and_its_csrf_token() -> None:
    sessions = Sessions(FakeClock(0.0), ttl=60.0)
    token, opened = sessions.open("ada", "admin")
    demoted = sessions.set_role(token, "viewer")
    assert (demoted.role, demoted.csrf) == ("viewer", opened.csrf) and sessions.get(token) == demoted


@pytest.mark.parametrize(
    ("failures", "address", "user", "waits"),
    [
        ([("1.1.1.1", "ada")] * 2, "1.1.1.1", "ada", False),  # under the limit
        ([("1.1.1.1", "ada")] * 3, "1.1.1.1", "ada", True),  # the limit: this address and this name wait
        ([("1.1.1.1", "ada")] * 3, "2.2.2.2", "ada", True),  # the name waits from any address
        ([("1.1.1.1", "ada")] * 3, "1.1.1.1", "bob", True),  # the address waits for any name
        ([("1.1.1.1", "ada")] * 3, "2.2.2.2", "bob", False),  # others do not
        ([("1.1.1.1", "a"), ("1.1.1.1", "b"), ("1.1.1.1", "c")], "1.1.1.1", "d", True),  # spraying names
        ([("1.1.1.1", "ada"), ("2.2.2.2", "ada"), ("3.3.3.3", "ada")], "4.4.4.4", "ada", True),  # spraying addresses
    ],
)
def test_login_limits_per_address_and_per_name(
    failures: list[tuple[str, str]], address: str, user: str, waits: bool
) -> None:
    limiter = LoginLimiter(FakeClock(0.0), failures=3, window=300.0)
    for failed_address, failed_user in failures:
        limiter.failed(failed_address, failed_user)
    assert (limiter.retry_after(address, user) > 0) == waits


async def test_the_wait_ends_when_the_oldest_failure_leaves_the_window_and_success_clears_the_name() -> None:
    clock = FakeClock(0.0)
    limiter = LoginLimiter(clock, failures=2, window=300.0)
    limiter.failed("1.1.1.1", "ada")
    await clock.advance(100)
    limiter.failed("1.1.1.1", "ada")
    assert limiter.retry_after("9.9.9.9", "ada") == 200.0
    await clock.advance(200)
    assert limiter.retry_after("9.9.9.9", "ada") == 0.0
    limiter.failed("2.2.2.2", "bob")
    limiter.failed("3.3.3.3", "bob")
    limiter.succeeded("bob")
    assert limiter.retry_after("4.4.4.4", "bob") == 0.0


@pytest.mark.parametrize(("a", "b", "equal"), [("x", "x", True), ("x", "y", False), ("", "", False), ("x", "", False)])
def test_tokens_compare_in_constant_time_and_empty_never_matches(a: str, b: str, equal: bool) -> None:
    assert tokens_equal(a, b) == equal
