"""The orchestrator running under its lease with the agent simulator (shared with tests/orchestrator)."""

from tests.orchestrator.test_loop import running  # noqa: F401  (the fixture)
