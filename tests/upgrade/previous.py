"""The previous release, runnable from a test: its tree taken from git (``git archive`` of its tag, or of
its commit when the tag was not fetched) into a temporary directory, run by this environment's interpreter
with that tree first on the path and the release's own version in the package metadata.

Its "own venv" is this one, overlaid: no download, so the test runs offline in seconds. That holds while
the previous release's dependencies are a subset of this one's (pyproject.toml), as for 0.1.0 → 0.2.0;
a release that drops or majorly upgrades a dependency the previous one imports makes :func:`extract` build
a real venv instead (docs/upgrades.md, "Releasing").
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.compat.releases import PREVIOUS
from tests.e2e.cluster import ROOT
from tests.e2e.upcmd import Release

PREVIOUS_COMMIT = "a1c29d01d09020117dcac56c0b295c76f3344865"
"""What ``v0.1.0`` tags, for a clone that did not fetch the tag."""


def _archive() -> bytes:
    for ref in (PREVIOUS, PREVIOUS_COMMIT):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=False
        )
        if done.returncode == 0:
            return done.stdout
    message = (
        f"the previous release ({PREVIOUS}, {PREVIOUS_COMMIT[:7]}) is not in this clone: "
        "`git fetch --tags` (a shallow clone has no history)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def extract(dest: Path) -> Release:
    """The previous release's tree under ``dest`` and how to run it."""
    tree, meta = dest / "tree", dest / "meta"
    tree.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(_archive())) as archive:
        archive.extractall(tree, filter="data")
    version = PREVIOUS.removeprefix("v")
    info = meta / f"zattera-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: zattera\nVersion: {version}\n")
    return Release(
        argv=(sys.executable, "-c", "from cli.main import main; main()"),
        cwd=tree,
        env={"PYTHONPATH": os.pathsep.join(str(p) for p in (tree, tree / "proto", meta))},
    )
