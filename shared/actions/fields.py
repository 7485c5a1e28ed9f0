"""The types of fields that many operator-action requests and results declare alike, each documented once
here rather than at every field.

They are plain aliases: a field declared with one is its underlying type to the wire
(:mod:`shared.actions.wire`), to the CLI and to the console.
"""

from __future__ import annotations

from typing import TypeAlias

EnvRef: TypeAlias = str
"""An environment as an operator names it in a request: its id or ``project/app/env``
(:func:`shared.actions.names.target_env` finds it)."""

EnvPath: TypeAlias = str
"""An environment as a result shows it: ``project/app/env`` (:func:`shared.actions.names.env_path`)."""

Rollout: TypeAlias = bool
"""Of a configuration change (variables, secrets, registry credentials, an attached database): when the env
runs a release, roll the change out at once as a new release and its deployment; False stages it for the
next deploy (:func:`shared.actions.config.reconfigure`)."""

SealedSettings: TypeAlias = dict[str, str]
"""An off-site target's settings (``AWS_ACCESS_KEY_ID``…) given with a request that stores them: stored
sealed to the cluster secrets key (:mod:`shared.backup.sealed`). Declared ``field(default_factory=dict,
repr=False)``: never in a repr."""

OneOffSettings: TypeAlias = dict[str, str]
"""An off-site target's settings (``AWS_*``) given with a request that only uses them: used by the action,
never stored. Declared ``field(default_factory=dict, repr=False)``: never in a repr."""
