"""Setting a sealed secret (docs/secrets.md): the one edit ``zattera secrets set`` and the web console share.

The value is sealed to the cluster key's public half (``secretskey.cluster``) and only the ciphertext is
written, as a new version, in the same fenced write as the environment; that write also expects the key
record's revision, so a value sealed to a key a rotation has just replaced is refused and sealed again.
"""

from __future__ import annotations

import time

from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.appconfig import ConfigError, check_env_size, secret_sizes, unreferenced_secrets
from shared.deploy import ConfigEdit
from shared.ids import new_id
from shared.secrets import CLUSTER_KEY, seal
from shared.state.reader import StateReader
from shared.txn import Txn

NO_CLUSTER_KEY = (
    "no cluster secrets key is configured: run the secrets service (`zattera up` does) with its key file"
    " or ZATTERA_SECRETS_KEY (docs/secrets.md)"
)


def prune_secrets(view: StateReader, env: pb.Environment, txn: Txn) -> None:
    """Versions no release and not the staged spec use any more go in the same write."""
    for secret_id in unreferenced_secrets(view.secrets(env.meta.id), env, view.releases(env.meta.id)):
        txn.delete(K.secret(secret_id))


def set_secret_edit(view: StateReader, name: str, value: str) -> ConfigEdit:
    def edit(env: pb.Environment, txn: Txn) -> None:
        key = view.get(K.SECRETS_KEY, CLUSTER_KEY)
        if not isinstance(key, pb.SecretsKey) or not key.public_key:
            raise ConfigError(f"secrets.{name}", NO_CLUSTER_KEY)
        if name in env.service.vars:
            raise ConfigError(
                f"secrets.{name}", "is a plain variable of this environment; `zattera config unset` it first"
            )
        existing = view.secrets(env.meta.id)
        sizes = secret_sizes(env.service, existing)
        sizes[name] = len(value.encode())
        check_env_size(env.service.vars, sizes, field=f"secrets.{name}")
        now = time.time_ns()
        record = pb.SealedSecret(
            environment_id=env.meta.id,
            project_id=env.project_id,
            name=name,
            version=1 + max((s.version for s in existing if s.name == name), default=0),
            ciphertext=seal(key.public_key, value.encode()),
            key_id=key.key_id,
        )
        record.meta.id = new_id()
        record.meta.created_at.FromNanoseconds(now)
        record.meta.updated_at.FromNanoseconds(now)
        ref = env.service.secrets[name]
        ref.secret_id, ref.version = record.meta.id, record.version
        ref.updated_at.FromNanoseconds(now)
        env.service.config_version += 1
        txn.create(record)
        txn.put(key)  # unchanged: fences the write on the key it was sealed to (a rotation refuses it)
        prune_secrets(view, env, txn)

    return edit
