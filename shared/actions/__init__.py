"""Operator actions: every change an operator makes, as ONE function per action, shared by every writer.

An action is ``async def verb(ctx: ActionContext, request) -> result``: it reads through the context's view,
decides purely, commits with the one retry helper (:func:`shared.actions.context.commit`), emits its event
with the context's actor, and returns a typed result or raises one
:class:`~shared.actions.refusals.ActionRefused`. Requests and results are plain frozen dataclasses
(:mod:`shared.actions.wire` carries them as JSON). The CLI commands and the web console only parse, call
and render. One module per area: ``envs`` (scale), ``deletion``, ``nodes``, ``config``, ``secrets``,
``deploys``, ``jobs``, ``volumes``, ``domains``, ``builds``; ``names`` resolves what an operator names;
``fields`` types the fields many requests and results declare alike (``EnvRef``, ``EnvPath``, …).
"""
