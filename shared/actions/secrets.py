"""Sealed secrets of an environment (docs/secrets.md): set, unset (``zattera secrets``, the console's secret
form), registry credentials (``zattera registry login|logout``) and the cluster key's rotation.

The value is sealed to the cluster key's public half (``secretskey.cluster``) and only the ciphertext is
written, as a new version, in the same fenced write as the environment (and its rollout:
:func:`shared.actions.config.reconfigure`); that write also expects the key record's revision, so a value
sealed to a key a rotation has just replaced is refused and sealed again. The value is never logged,
returned, traced or put in an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.actions.config import ConfigChanged, reconfigure
from shared.actions.context import ActionContext
from shared.actions.fields import EnvRef, Rollout
from shared.actions.refusals import Conflicting, ask_service
from shared.appconfig import (
    ConfigError,
    check_env_size,
    check_name,
    check_secret_value,
    secret_sizes,
    unreferenced_secrets,
)
from shared.clock import stamp
from shared.deploy import ConfigEdit
from shared.records import new_meta
from shared.registryauth import REGISTRY_AUTH_SECRET, registry_auth_value
from shared.secrets import CLUSTER_KEY, ROTATE_SUBJECT, seal
from shared.state.reader import StateReader
from shared.txn import Txn

ROTATE_TIMEOUT = 120.0
"""How long a key rotation (every secret re-sealed) is waited for."""


@dataclass(frozen=True, slots=True)
class SetSecret:
    env: EnvRef
    name: str
    value: str = field(repr=False)
    """The plaintext: sealed before anything is written; never logged or shown."""
    deploy: Rollout = True


@dataclass(frozen=True, slots=True)
class UnsetSecrets:
    env: EnvRef
    names: list[str]
    deploy: Rollout = True


@dataclass(frozen=True, slots=True)
class RegistryLogin:
    """The credentials the docker runtime pulls the env's ``docker://`` images with (its sealed secret
    ``ZATTERA_REGISTRY_AUTH``, docs/containers.md)."""

    env: EnvRef
    server: str
    username: str
    password: str = field(repr=False)
    deploy: Rollout = True


@dataclass(frozen=True, slots=True)
class RegistryLogout:
    env: EnvRef
    deploy: Rollout = True


@dataclass(frozen=True, slots=True)
class RotateSecretsKey:
    timeout: float = ROTATE_TIMEOUT


@dataclass(frozen=True, slots=True)
class KeyRotated:
    previous_key_id: str
    key_id: str
    resealed: int
    """Secret versions re-sealed under the new key."""


NO_CLUSTER_KEY = (
    "no cluster secrets key is configured: run the secrets service (`zattera up` does) with its key file"
    " or ZATTERA_SECRETS_KEY (docs/secrets.md)"
)


def prune_secrets(view: StateReader, env: pb.Environment, txn: Txn) -> None:
    """Versions no release and not the staged spec use any more go in the same write."""
    for secret_id in unreferenced_secrets(view.secrets(env.meta.id), env, view.releases(env.meta.id)):
        txn.delete(K.secret(secret_id))


def secret_version(
    env: pb.Environment, key: pb.SecretsKey, name: str, version: int, *, value: str = "", ciphertext: bytes = b""
) -> pb.SealedSecret:
    """Version ``version`` of ``env``'s secret ``name``: ``value`` sealed to ``key`` (or its ``ciphertext``,
    already sealed to it), which ``env``'s spec now references."""
    now = time.time()
    record = pb.SealedSecret(
        environment_id=env.meta.id,
        project_id=env.project_id,
        name=name,
        version=version,
        ciphertext=ciphertext or seal(key.public_key, value.encode()),
        key_id=key.key_id,
    )
    new_meta(record.meta, now)
    ref = env.service.secrets[name]
    ref.secret_id, ref.version = record.meta.id, record.version
    stamp(ref.updated_at, now)
    return record


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
        version = 1 + max((s.version for s in existing if s.name == name), default=0)
        env.service.config_version += 1
        txn.create(secret_version(env, key, name, version, value=value))
        txn.put(key)  # unchanged: fences the write on the key it was sealed to (a rotation refuses it)
        prune_secrets(view, env, txn)

    return edit


def unset_secrets_edit(view: StateReader, names: list[str]) -> ConfigEdit:
    def edit(env: pb.Environment, txn: Txn) -> None:
        for name in names:
            if name not in env.service.secrets:
                raise ConfigError(f"secrets.{name}", "not set on this environment")
            del env.service.secrets[name]
        env.service.config_version += 1
        prune_secrets(view, env, txn)

    return edit


async def set_secret(ctx: ActionContext, request: SetSecret) -> ConfigChanged:
    check_name(f"secrets.{request.name}", request.name)
    return await _set(ctx, request.env, request.name, request.value, deploy=request.deploy)


async def unset_secrets(ctx: ActionContext, request: UnsetSecrets) -> ConfigChanged:
    for name in request.names:
        check_name(f"secrets.{name}", name)
    edit = unset_secrets_edit(ctx.view, request.names)
    return await reconfigure(ctx, request.env, edit, deploy=request.deploy)


async def registry_login(ctx: ActionContext, request: RegistryLogin) -> ConfigChanged:
    value = registry_auth_value(request.server, request.username, request.password)
    return await _set(ctx, request.env, REGISTRY_AUTH_SECRET, value, deploy=request.deploy)


async def registry_logout(ctx: ActionContext, request: RegistryLogout) -> ConfigChanged:
    edit = unset_secrets_edit(ctx.view, [REGISTRY_AUTH_SECRET])
    return await reconfigure(ctx, request.env, edit, deploy=request.deploy)


async def _set(ctx: ActionContext, env: str, name: str, value: str, *, deploy: bool) -> ConfigChanged:
    """Seal and write ``name`` (an operator's name, checked, or the platform's own)."""
    checked = check_secret_value(name, value.encode())
    return await reconfigure(ctx, env, set_secret_edit(ctx.view, name, checked), deploy=deploy)


async def rotate_secrets_key(ctx: ActionContext, request: RotateSecretsKey) -> KeyRotated:
    """Ask the secrets service for a new cluster key; it re-seals every secret under it (apps keep running)."""
    data = await ask_service(
        ctx.conn.nc,
        ROTATE_SUBJECT,
        cpb.RotateSecretsKeyRequest().SerializeToString(),
        request.timeout,
        unavailable="the secrets service did not answer ({error}): is it running?",
    )
    response = cpb.RotateSecretsKeyResponse.FromString(data)
    if response.error:
        raise Conflicting(response.error)
    return KeyRotated(response.previous_key_id, response.key_id, response.resealed)
