"""Source upload for ``zattera deploy DIR``: see :mod:`shared.sourcepack` (shared with git deploys)."""

from __future__ import annotations

from shared.sourcepack import EXCLUDED_DIRS, MAX_SOURCE_BYTES, digest, pack, upload

__all__ = ["EXCLUDED_DIRS", "MAX_SOURCE_BYTES", "digest", "pack", "upload"]
