"""The skip policy of tests/conftest.py: outside CI a missing component skips with its reason (listed in the
summary); with ``CI=true`` the same test fails, naming the component, so a broken daemon never reads as green."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
NEEDS = """
import pytest

def test_needs_a_daemon():
    pytest.skip("docker runtime tests need a Docker daemon: dockerd did not answer within 30s")

@pytest.mark.skipif(True, reason="haproxy is not installed (make system-packages)")
def test_needs_haproxy():
    pass
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_component_skips_outside_ci_and_fails_in_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_needs=NEEDS)
    monkeypatch.setenv("CI", ci)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    if ci:
        result.assert_outcomes(failed=1, errors=1)
        for component in ("dockerd did not answer within 30s", "haproxy is not installed"):
            result.stdout.fnmatch_lines([f"*CI=true: a component this test needs is unavailable*{component}*"])
    else:
        result.assert_outcomes(skipped=2)
        result.stdout.fnmatch_lines(["SKIPPED*dockerd did not answer within 30s*", "SKIPPED*haproxy is not installed*"])
