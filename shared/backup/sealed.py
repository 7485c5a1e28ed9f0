"""A target's settings (the ``AWS_*`` names of :data:`shared.backup.targets.CREDENTIAL_SETTINGS`) sealed to
the cluster secrets key, as the backup schedule and a volume's off-site snapshot policy store them.

Whoever sets them (the CLI, the console) seals them with the published public half of the key; only the
secrets service, which holds the private half, opens them, and re-seals them when the key rotates. Nothing
here logs or names a value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nacl.exceptions import CryptoError
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.refusals import Unavailable
from shared.backup.manifest import BackupError
from shared.secrets import CLUSTER_KEY, Keyring, seal, unseal
from shared.state.reader import StateReader


@dataclass(frozen=True)
class SealedSettings:
    sealed: bytes
    """JSON of the settings, SealedBox to the cluster key; empty when there are none."""
    key_id: str
    """The cluster key they are sealed to ("" when there are none)."""


def seal_settings(view: StateReader, settings: dict[str, str], what: str = "the target's settings") -> SealedSettings:
    """``settings`` sealed to the cluster's published secrets key; :class:`Unavailable` (naming ``what``)
    while the cluster has none (its secrets service has not started), since nothing could open them later."""
    key = view.get(K.SECRETS_KEY, CLUSTER_KEY)
    if not isinstance(key, pb.SecretsKey) or not key.public_key:
        raise Unavailable(
            f"the cluster has no secrets key yet (its secrets service has not started): {what} "
            "cannot be sealed; try again once `zattera status` shows the control plane up"
        )
    if not settings:
        return SealedSettings(b"", "")
    return SealedSettings(seal(key.public_key, json.dumps(settings).encode()), key.key_id)


def open_settings(keyring: Keyring | None, sealed: bytes, key_id: str) -> dict[str, str]:
    """The settings ``sealed`` holds ({} when empty); :class:`BackupError` when the key is not held or does
    not open them (the message names the key, never a value)."""
    if not sealed:
        return {}
    key = keyring.by_id(key_id) if keyring is not None else None
    if key is None:
        raise BackupError(f"the target's settings are sealed to key {key_id}, which is not held")
    try:
        opened = json.loads(unseal(key, sealed))
    except (CryptoError, ValueError):
        raise BackupError(f"the target's settings do not open with key {key_id}") from None
    if not isinstance(opened, dict):
        raise BackupError(f"the target's settings sealed to key {key_id} are not a JSON object")
    return {str(name): str(value) for name, value in opened.items()}
