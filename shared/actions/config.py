"""An environment's plain variables (``zattera config set|unset``), and the one way every configuration
change is committed (variables, secrets, registry credentials).

A change is ONE fenced write of the environment; when the env runs a release, the same write makes a new
release (same image, new configuration) and its deployment, which rolls out red/green like any deploy
(``deploy=False`` stages it for the next deploy instead). Variables are not secret: secrets are
:mod:`shared.actions.secrets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.actions.fields import EnvPath, EnvRef, Rollout
from shared.actions.names import env_path, target_env
from shared.appconfig import ConfigError, check_env_size, check_name, check_var, secret_sizes, with_vars
from shared.deploy import ConfigEdit
from shared.state.reader import StateReader
from shared.txn import Txn


@dataclass(frozen=True, slots=True)
class ChangeVars:
    env: EnvRef
    values: dict[str, str | None]
    """Name → the value to set, or None to remove it."""
    deploy: Rollout = True


@dataclass(frozen=True, slots=True)
class ConfigChanged:
    env_id: str
    env: EnvPath
    config_version: int
    deployment_id: str = ""
    """The rollout's deployment; "" when the change is staged."""
    release_version: int = 0
    deployed: bool = False
    """The env runs a release: a staged change waits for its next deploy (else the first deploy uses it)."""


def vars_edit(view: StateReader, change: Mapping[str, str | None]) -> ConfigEdit:
    """Set (value) or remove (None) variables; refuses a name that is also a secret, and an env over 1 MiB."""

    def edit(env: pb.Environment, _txn: Txn) -> None:
        merged = dict(env.service.vars)
        for name, value in change.items():
            if value is None:
                if merged.pop(name, None) is None:
                    raise ConfigError(f"vars.{name}", "not set on this environment")
            elif name in env.service.secrets:
                raise ConfigError(f"vars.{name}", "is a secret of this environment; `zattera secrets unset` it first")
            else:
                merged[name] = value
        check_env_size(merged, secret_sizes(env.service, view.secrets(env.meta.id)), field="vars")
        with_vars(env.service, merged)

    return edit


async def reconfigure(ctx: ActionContext, env_ref: EnvRef, edit: ConfigEdit, *, deploy: Rollout) -> ConfigChanged:
    """Commit ``edit`` to the environment ``env_ref`` names, and its rollout when ``deploy``."""
    env = target_env(ctx.view, env_ref)
    done = await ctx.deployer().reconfigure(env.meta.id, edit, deploy=deploy)
    changed = done.environment
    return ConfigChanged(
        changed.meta.id,
        env_path(ctx.view, changed),
        changed.service.config_version,
        deployment_id=done.deployment.meta.id if done.deployment is not None else "",
        release_version=done.release.version if done.release is not None else 0,
        deployed=bool(changed.active_release_id),
    )


async def change_vars(ctx: ActionContext, request: ChangeVars) -> ConfigChanged:
    for name, value in request.values.items():
        if value is None:
            check_name(f"vars.{name}", name)
        else:
            check_var(name, value)
    return await reconfigure(ctx, request.env, vars_edit(ctx.view, request.values), deploy=request.deploy)
