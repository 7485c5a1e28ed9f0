"""The examples' zattera.toml files say how to use them in the order that works: apply, then deploy."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.spec import load

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*/zattera.toml"))


@pytest.mark.parametrize("toml", EXAMPLES, ids=[path.parent.name for path in EXAMPLES])
def test_an_example_says_to_apply_it_before_deploying_it_and_is_valid(toml: Path) -> None:
    header = "".join(line for line in toml.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "zattera apps apply" in header and "zattera deploy" in header
    assert header.index("zattera apps apply") < header.index("zattera deploy"), header
    assert load(toml).app == toml.parent.name
