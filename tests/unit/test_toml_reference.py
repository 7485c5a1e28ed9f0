"""Every key ``zattera.toml`` accepts (``cli/spec.py`` and its tables, ``cli/spec_tables.py``) is documented:
in docs/zattera-toml.md, or in the feature page under docs/ that added it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from cli.spec import AppSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(f"{prefix}{name}")
        for inner in getattr(info.annotation, "__args__", ()) or (info.annotation,):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                keys |= _keys(inner, f"{prefix}{name}.")
    return keys


def test_every_key_is_documented() -> None:
    text = "\n".join(page.read_text(encoding="utf-8") for page in sorted(DOCS.glob("*.md")))
    missing = sorted(key for key in _keys(AppSpec) if f"`{key.rsplit('.', 1)[-1]}`" not in text)
    assert not missing, f"zattera.toml keys documented nowhere under docs/: {missing}"
