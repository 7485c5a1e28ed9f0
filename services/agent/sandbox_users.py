"""The environments' users on a node: the uid each environment (and each app's builds) runs as in the
process runtime's sandbox (:mod:`services.agent.sandbox`), kept across agent restarts, and handing a tree of
files to such a user."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
from collections.abc import Iterable
from pathlib import Path

import psutil

from shared.errors import ZatteraError
from shared.files import write_private_json

UID_FILE = "uids.json"


class UidsExhausted(ZatteraError):
    """Every uid of the node's range is taken."""


class UidTable:
    """The uid of each environment (and each app's builds) on this node, kept in ``<dir>/uids.json``.

    A key's uid is derived from it (``base + sha256(key) mod count``), the next free one on a collision: a
    uid another key of this table holds, that the system's user or group database names, or that a running
    process uses. Kept while the key has anything on the node (:meth:`retain`), so a restarted agent gives an
    environment the same uid (its volumes stay its own).
    """

    def __init__(self, directory: Path, *, base: int, count: int) -> None:
        self.path = directory / UID_FILE
        self.base = base
        self.count = count
        self._uids: dict[str, int] = {}
        try:
            doc = json.loads(self.path.read_text())
            self._uids = {str(k): int(v) for k, v in doc.items() if base <= int(v) < base + count}
        except (OSError, ValueError, AttributeError, TypeError):
            self._uids = {}

    def __contains__(self, key: str) -> bool:
        return key in self._uids

    def keys(self) -> set[str]:
        return set(self._uids)

    def uid(self, key: str) -> int:
        """``key``'s uid, allocated (and saved) on first use."""
        uid = self._uids.get(key)
        if uid is not None:
            return uid
        held = set(self._uids.values())
        running = _running_uids()
        start = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % self.count
        for step in range(self.count):
            candidate = self.base + (start + step) % self.count
            if candidate not in held and candidate not in running and not _named(candidate):
                self._uids[key] = candidate
                self._save()
                return candidate
        raise UidsExhausted(f"no free uid left in {self.base}..{self.base + self.count - 1}")

    def retain(self, keys: Iterable[str], *, prefix: str) -> None:
        """Forget the keys starting with ``prefix`` that are not in ``keys``."""
        keep = set(keys)
        gone = [k for k in self._uids if k.startswith(prefix) and k not in keep]
        for key in gone:
            del self._uids[key]
        if gone:
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private_json(self.path, self._uids)


def _named(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _running_uids() -> set[int]:
    found: set[int] = set()
    for proc in psutil.process_iter(["uids"]):
        with contextlib.suppress(psutil.Error, TypeError):
            found.add(int(proc.info["uids"].real))
    return found


def give(path: Path, uid: int, *, whole: bool = False) -> None:
    """Make the tree at ``path`` belong to ``uid`` (group too), unless its top already does (``whole``: look at
    every entry). Links are never followed; the top is changed last, so an interrupted walk is redone."""
    try:
        if not whole and path.lstat().st_uid == uid:
            return
    except FileNotFoundError:
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in (*files, *dirs):
            entry = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(entry).st_uid != uid:
                    os.chown(entry, uid, uid, follow_symlinks=False)
    os.chown(path, uid, uid, follow_symlinks=False)
