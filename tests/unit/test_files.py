"""Writing a file whole (shared/files.py): the content, the mode from creation, no temporary left behind,
and an interrupted write leaves the old file as it was."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shared import files
from shared.files import PRIVATE, PUBLIC, prepared_file, write_atomic


@pytest.mark.parametrize("mode", [PRIVATE, PUBLIC])
@pytest.mark.parametrize("durable", [True, False])
def test_the_file_is_replaced_whole_with_its_mode(tmp_path: Path, mode: int, durable: bool) -> None:
    target = tmp_path / "new" / "file.json"
    write_atomic(target, "old", mode=mode, durable=durable)
    write_atomic(target, b"new", mode=mode, durable=durable)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert stat.S_IMODE(target.parent.stat().st_mode) == (0o700 if mode == PRIVATE else 0o755)
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.json"]


def test_a_private_file_is_never_readable_by_others_even_with_an_open_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        tmp = prepared_file(tmp_path / "key", b"secret", mode=PRIVATE)
        assert stat.S_IMODE(tmp.stat().st_mode) == PRIVATE
    finally:
        os.umask(previous)


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "routes.pb"
    write_atomic(target, b"v1")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, b"v2")
    assert target.read_bytes() == b"v1"
    assert [p.name for p in tmp_path.iterdir()] == ["routes.pb"]
