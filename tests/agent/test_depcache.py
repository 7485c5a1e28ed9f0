"""The dependency layer's cache key: what decides the installed tree changes it, nothing else does."""

from __future__ import annotations

from pathlib import Path

from services.agent.depcache import LayerCache, cache_tag, dependency_key
from shared.buildplan import detect, read_source


def key_of(src: Path, platform: str = "linux/amd64 /usr/bin/python3.11") -> str:
    return dependency_key(detect(read_source(src)), src, platform)


def test_the_key_follows_the_dependency_files_and_the_platform_only(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("flask\n")
    (tmp_path / "app.py").write_text("from flask import Flask\napp = Flask(__name__)\n")
    first = key_of(tmp_path)
    assert len(first) == 32 and cache_tag(first) == f"deps-{first}"

    (tmp_path / "app.py").write_text("from flask import Flask\napp = Flask('changed')\n")
    assert key_of(tmp_path) == first  # a code change keeps the layer
    assert key_of(tmp_path, "linux/arm64 /usr/bin/python3.11") != first
    assert key_of(tmp_path, "linux/amd64 /usr/bin/python3.12") != first
    (tmp_path / "requirements.txt").write_text("flask\ngunicorn\n")
    more = key_of(tmp_path)
    assert more != first
    (tmp_path / "zattera.toml").write_text('[build]\ninstall = "uv pip install --target .zattera/python flask"\n')
    assert key_of(tmp_path) not in (first, more)  # another install command


def test_layer_cache_round_trip(tmp_path: Path) -> None:
    cache = LayerCache(tmp_path / "layers")
    assert cache.get("k") is None
    cache.put("k", b"layer", "sha256:abc")
    assert cache.get("k") == (b"layer", "sha256:abc")
    assert sorted(p.name for p in (tmp_path / "layers").iterdir()) == ["k.json", "k.tar.gz"]  # no partial left
