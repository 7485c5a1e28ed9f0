"""The certificate loop's pure decisions, with fixed instants (no clock, no network)."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared import certs as C
from shared.clock import from_timestamp, to_timestamp

NOW = 1_700_000_000.0
DAY = 86_400.0


def stored(host: str, *, renew_at: float, retry_at: float | None = None, chain: str = "CHAIN") -> pb.Certificate:
    cert = C.pending_record(host, "https://ca.example/dir")
    cert.state = C.VALID if chain else C.FAILED
    cert.chain_pem = chain
    cert.renew_at.CopyFrom(to_timestamp(renew_at))
    if retry_at is not None:
        cert.retry_at.CopyFrom(to_timestamp(retry_at))
    return cert


def test_new_hosts_are_created_and_ordered_stale_ones_forgotten() -> None:
    certs = {"old.example.com": stored("old.example.com", renew_at=NOW + DAY)}
    plan = C.plan({"a.example.com", "b.example.com"}, certs, NOW)
    assert plan.create == ("a.example.com", "b.example.com")
    assert plan.orders == (C.Order("a.example.com", False), C.Order("b.example.com", False))
    assert plan.forget == ("old.example.com",)


def test_a_valid_certificate_is_forgotten_only_once_its_name_has_been_unwanted_for_a_while() -> None:
    """A restore writes certificates before the environments whose routes want them: kept meanwhile."""
    certs = {"kept.example.com": stored("kept.example.com", renew_at=NOW + DAY)}
    certs["failed.example.com"] = stored("failed.example.com", renew_at=0.0, chain="")
    since = dict.fromkeys(certs, NOW - 60)
    plan = C.plan(set(), certs, NOW, since)
    assert plan.forget == ("failed.example.com",)  # nothing in it to keep
    assert plan.next_due == NOW - 60 + C.FORGET_AFTER
    assert C.plan(set(), certs, NOW + C.FORGET_AFTER, since).forget == ("failed.example.com", "kept.example.com")
    assert C.plan({"kept.example.com"}, certs, NOW + C.FORGET_AFTER, since).forget == ("failed.example.com",)


@pytest.mark.parametrize(
    ("renew_at", "retry_at", "chain", "ordered", "next_due"),
    [
        (NOW + DAY, None, "CHAIN", False, NOW + DAY),  # not due: wake at the renewal instant
        (NOW, None, "CHAIN", True, None),  # due: a renewal (the stored one stays served)
        (NOW - 1, NOW + 60, "CHAIN", False, NOW + 60),  # due, but backing off
        (0.0, NOW + 60, "", False, NOW + 60),  # failed first order, backing off
        (0.0, NOW - 1, "", True, None),  # failed first order, backoff over: ordered again
    ],
)
def test_renewal_and_backoff(
    renew_at: float, retry_at: float | None, chain: str, ordered: bool, next_due: float | None
) -> None:
    host = "a.example.com"
    plan = C.plan({host}, {host: stored(host, renew_at=renew_at, retry_at=retry_at, chain=chain)}, NOW)
    assert plan.orders == ((C.Order(host, bool(chain)),) if ordered else ())
    assert plan.next_due == next_due


def test_renewal_is_two_thirds_into_the_lifetime_less_a_small_jitter_fixed_per_host() -> None:
    lifetime = 90 * DAY
    at = C.renew_at("a.example.com", NOW, NOW + lifetime)
    assert NOW + lifetime * (2 / 3 - C.JITTER_FRACTION) <= at <= NOW + lifetime * 2 / 3
    assert at == C.renew_at("a.example.com", NOW, NOW + lifetime)
    assert at != C.renew_at("b.example.com", NOW, NOW + lifetime)


@pytest.mark.parametrize(
    ("failures", "retry_after", "wait"),
    [
        (1, None, 60.0),
        (2, None, 120.0),
        (5, None, 960.0),
        (40, None, C.BACKOFF_MAX),
        (1, 3600.0, 3600.0),
        (3, 5.0, 240.0),
    ],
)
def test_backoff_doubles_to_a_day_and_honours_retry_after(
    failures: int, retry_after: float | None, wait: float
) -> None:
    assert C.backoff(failures, retry_after) == wait


def test_a_failed_renewal_keeps_the_certificate_and_a_failed_first_order_fails() -> None:
    renewing = C.after_failure(stored("a.example.com", renew_at=NOW), "rateLimited: too many", 7200.0, NOW)
    assert (renewing.state, renewing.chain_pem, renewing.failures) == (C.RENEWING, "CHAIN", 1)
    assert from_timestamp(renewing.retry_at) == NOW + 7200.0 and renewing.last_error == "rateLimited: too many"
    failed = C.after_failure(C.pending_record("b.example.com", ""), "unauthorized: 404", None, NOW)
    assert (failed.state, failed.failures, from_timestamp(failed.retry_at)) == (C.FAILED, 1, NOW + 60.0)
    assert C.state_name(failed, NOW) == "failed"


@pytest.mark.parametrize(
    ("hostname", "problem"),
    [
        ("www.example.com", None),
        ("app-prod.localhost", None),
        ("localhost", None),
        ("", "is empty"),
        ("WWW.example.com", "not lower case"),
        ("*.example.com", "wildcard"),
        ("example", "not a fully qualified name"),
        ("-a.example.com", "label '-a'"),
        ("a..example.com", "label ''"),
        ("a_b.example.com", "label 'a_b'"),
        ("a" * 64 + ".example.com", "label"),
        (("a" * 60 + ".") * 5 + "com", "at most 253"),
    ],
)
def test_hostnames_are_checked_naming_the_problem(hostname: str, problem: str | None) -> None:
    found = C.hostname_problem(hostname)
    assert found is None if problem is None else (found is not None and problem in found)
