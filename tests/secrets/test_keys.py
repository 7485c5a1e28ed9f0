"""Key material: the keyring file (0600, atomic, first creation wins), hex seeds, sealing."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey

from shared.secrets import (
    KeyMaterialError,
    Keyring,
    create_keyring,
    key_id,
    load_keyring,
    private_key_from_hex,
    public_bytes,
    save_keyring,
    seal,
    unseal,
)


def test_the_first_keyring_created_wins_and_later_saves_replace_it(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "cluster.key"
    first, second = Keyring([PrivateKey.generate()]), Keyring([PrivateKey.generate()])
    assert create_keyring(path, first) is first
    on_disk = create_keyring(path, second)  # a replica starting at the same time gets the first one's key
    assert bytes(on_disk.current) == bytes(first.current)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["cluster.key"]  # no temporary file left
    save_keyring(path, Keyring([*second.keys, *first.keys]))
    loaded = load_keyring(path)
    assert loaded is not None and [bytes(k) for k in loaded.keys] == [bytes(second.current), bytes(first.current)]
    assert loaded.by_id(key_id(public_bytes(first.current))) is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(("text", "problem"), [("zz", "not hex"), ("00" * 31, "31 bytes"), ("", "0 bytes")])
def test_a_bad_seed_key_is_refused_naming_the_variable(text: str, problem: str) -> None:
    with pytest.raises(KeyMaterialError, match=f"ZATTERA_SECRETS_KEY: {problem}"):
        private_key_from_hex(text)


def test_a_bad_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    assert load_keyring(path) is None
    path.write_text("{not json")
    with pytest.raises(KeyMaterialError, match="not a secrets key file"):
        load_keyring(path)


def test_a_sealed_value_opens_only_with_its_key() -> None:
    key, other = PrivateKey.generate(), PrivateKey.generate()
    sealed = seal(public_bytes(key), b"value")
    assert b"value" not in sealed and unseal(key, sealed) == b"value"
    assert seal(public_bytes(key), b"value") != sealed  # a fresh ephemeral key every time
    with pytest.raises(CryptoError):
        unseal(other, sealed)
