"""The sealed bundle a server machine receives: the trust root and, from the control directory, the cluster
secrets key and the local CA, so every machine's secrets and certificates services hold them; nothing else,
and nothing written outside the control directory."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from shared.security.machines import (
    CONTROL_BUNDLE_FILES,
    SERVER_BUNDLE_FILES,
    MachineTokenError,
    open_bundle,
    seal_bundle,
)


def _control(root: Path) -> Path:
    security = root / "control" / "security"
    for name in (*SERVER_BUNDLE_FILES, "creds/operator.creds"):
        (security / name).parent.mkdir(parents=True, exist_ok=True)
        if name == "keys":
            (security / "keys").mkdir()
            (security / "keys" / "operator.nk").write_text("seed")
        else:
            (security / name).write_text(f"content of {name}")
    for name in (*CONTROL_BUNDLE_FILES, "console/users.json"):
        (root / "control" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "control" / name).write_text(f"content of {name}")
    return security


def test_a_server_machine_gets_the_trust_root_the_secrets_key_and_the_local_ca(tmp_path: Path) -> None:
    sealed = seal_bundle("s" * 52, _control(tmp_path / "first"))
    joined = tmp_path / "joined" / "control" / "security"
    open_bundle("s" * 52, sealed, joined)
    for name in CONTROL_BUNDLE_FILES:
        assert (joined.parent / name).read_text() == f"content of {name}"
        assert (joined.parent / name).stat().st_mode & 0o077 == 0
    assert (joined / "tls/ca-key.pem").read_text() == "content of tls/ca-key.pem"
    assert not (joined / "creds").exists(), "the first machine's credentials are not handed over"
    assert not (joined.parent / "console").exists()
    with pytest.raises(MachineTokenError):
        open_bundle("t" * 52, sealed, tmp_path / "other")


def test_a_bundle_naming_other_control_files_writes_nothing_there(tmp_path: Path) -> None:
    """Only the listed control files are taken from ``control/``; any other name stays inside security/."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from shared.security.machines import BUNDLE_INFO, _b64, _key

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        data = b"evil"
        info = tarfile.TarInfo("control/console/users.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    nonce = b"\0" * 12
    sealed = _b64(nonce + AESGCM(_key("s" * 52)).encrypt(nonce, buffer.getvalue(), BUNDLE_INFO))
    security = tmp_path / "control" / "security"
    open_bundle("s" * 52, sealed, security)
    assert not (tmp_path / "control" / "console").exists()
    assert (security / "control" / "console" / "users.json").read_bytes() == b"evil"
