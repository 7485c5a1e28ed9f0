"""A crash from a missing module names it (the deployment error and `zattera ps` show describe_exit)."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from shared.applogs import describe_exit, missing_module


@pytest.mark.parametrize(
    ("tail", "module"),
    [
        (
            [
                "Traceback (most recent call last):",
                '  File "app.py", line 1',
                "ModuleNotFoundError: No module named 'flask'",
            ],
            "flask",
        ),
        (["ImportError: No module named 'yaml.cyaml'"], "yaml.cyaml"),
        (
            ["Error: Cannot find module 'express'", "Require stack:", "- /app/server.js", "  code: 'MODULE_NOT_FOUND'"],
            "express",
        ),
        (["fatal: DATABASE_URL not set"], ""),
        ([], ""),
    ],
)
def test_missing_module(tail: list[str], module: str) -> None:
    assert missing_module(tail) == module


def test_describe_exit_names_the_missing_module() -> None:
    crashed = pb.InstanceExit(code=1, code_known=True, stderr_tail=["ModuleNotFoundError: No module named 'flask'"])
    assert describe_exit(crashed) == (
        "exit code 1, missing module 'flask' (is it in the app's requirements or package.json?)"
    )
    assert describe_exit(pb.InstanceExit(code=3, code_known=True, stderr_tail=["boom"])) == "exit code 3"
