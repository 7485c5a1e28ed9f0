"""``zattera events [--follow] [--kind K] [--env E] [--last N] [--json]``: the platform's event log, and the
scale events ``zattera apps apply`` announces.

Events live in the ``ZATTERA_EVENTS`` stream on ``zattera.events.<kind>``; ``--kind`` narrows the subject
(``deploy`` = every ``deploy.*`` kind, ``deploy.failed`` exactly, NATS wildcards pass through). The env
is not in the subject, so ``--env`` filters on the client among the newest :data:`SCAN_WINDOW` events.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import typer
from rich.markup import escape
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import actor, control, err, fail, run
from cli.options import set_output
from shared import keys as K
from shared.actions.names import env_path, resolve_env
from shared.connection import Connection
from shared.deployments import desired_replicas
from shared.events import EVENT_SCALED, EventPublisher, deleted_env_paths, kind_problem, kind_subject, scale_event
from shared.state.feed import StateView
from shared.state.reader import StateReader
from shared.subjects import EVENTS_STREAM, EVENTS_SUBJECT_PREFIX
from shared.watches import WatchSpec
from shared.watches import follow as follow_watch

SCAN_WINDOW = 20_000
"""How many of the newest events a filtered listing looks through for its ``--last`` matches."""

_COLORS = {"warning": "yellow", "error": "red"}
# Fields shown inline after the message, in this order (the rest only in --json).
_INLINE_FIELDS = ("actor", "reason", "deployment_id", "release_id")


def describe(event: pb.Event, view: StateReader | None, deleted: Mapping[str, str] | None = None) -> str:
    """One readable line: time, kind, scope (env path or node), message, from → to and who decided.
    ``deleted``: env id → path of deleted envs (:func:`shared.events.deleted_env_paths`)."""
    scope = ""
    if event.environment_id:
        env = view.env(event.environment_id) if view is not None else None
        scope = env_path(view, env) if view is not None and env is not None else event.environment_id
        if env is None and deleted and event.environment_id in deleted:
            scope = f"{deleted[event.environment_id]} (deleted)"
    elif event.node_id:
        scope = f"node {event.node_id}"
    fields = event.fields
    details = []
    if "from" in fields and "to" in fields:
        details.append(f"{fields['from']} → {fields['to']}")
    details.extend(f"{name}={fields[name]}" for name in _INLINE_FIELDS if fields.get(name))
    color = _COLORS.get(event.severity, "white")
    suffix = f" [dim]({', '.join(details)})[/]" if details else ""
    return (
        f"{render.ts(event.meta.created_at)} [{color}]{event.kind:<22}[/] {escape(scope):<24} "
        f"{escape(event.message)}{suffix}"
    )


def events(
    follow: bool = typer.Option(False, "--follow", "-f", help="keep streaming new events"),
    kind: str = typer.Option("", "--kind", help="deploy, deploy.failed, node, autoscale.scaled, scaletozero …"),
    env: str = typer.Option("", "--env", help="only this environment (id or project/app/env)"),
    last: int = typer.Option(50, "--last", "-n", help="how many past events to show"),
    json_out: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> None:
    """Platform events, newest last: deployments, rollbacks, scaling, wakes and cools, nodes."""
    set_output(json_out)
    if last < 0:
        err.print("[red]error:[/] --last must be 0 or more")
        raise typer.Exit(2)

    async def go() -> None:
        async with control(view=bool(env) or not json_out) as c:
            env_id = ""
            if env:
                found = resolve_env(c.view, env)
                if found is None:
                    err.print(f"[red]error:[/] --env: no environment {env!r} (use an id or project/app/env)")
                    raise typer.Exit(1)
                env_id = found.meta.id
            info = await c.conn.js.stream_info(EVENTS_STREAM)
            if kind_problem(kind) is not None:  # not a kind of the catalogue: maybe one the stream holds
                stored = await c.conn.js.stream_info(EVENTS_STREAM, subjects_filter=kind_subject(kind))
                seen = [s.removeprefix(EVENTS_SUBJECT_PREFIX) for s in (stored.state.subjects or {})]
                if (problem := kind_problem(kind, seen)) is not None:
                    raise fail(problem)
            end = info.state.last_seq
            window = last if not (env_id or kind) else max(last, SCAN_WINDOW)
            start = end + 1 if last == 0 else max(1, end - window + 1)
            spec = WatchSpec(EVENTS_STREAM, (kind_subject(kind),), "by_start_sequence", start_seq=start)
            # A team member's events are pushed by the authorising path, its projects' only (docs/teams.md).
            sub: Any = await follow_watch(c.conn, spec)
            view = None if json_out else c.view
            deleted: dict[str, str] | None = None

            async def show(event: pb.Event) -> None:
                nonlocal deleted
                if json_out:
                    print(json.dumps(render.as_dict(event), sort_keys=True), flush=True)
                    return
                gone = view is not None and event.environment_id and view.env(event.environment_id) is None
                if gone and (deleted is None or event.environment_id not in deleted):
                    deleted = await deleted_env_paths(c.conn)  # a deleted env: named by its env.deleted event
                render.out.print(describe(event, view, deleted), highlight=False, soft_wrap=True)

            # The newest ``last`` matches are shown once the stored ones have all been read, then the new ones.
            backlog: deque[pb.Event] = deque(maxlen=last)
            caught_up = start > end

            async def catch_up() -> bool:
                for event in backlog:
                    await show(event)
                backlog.clear()
                return True

            try:
                while not caught_up or follow:
                    try:
                        msg = await sub.next_msg(timeout=None if caught_up else 1.0)
                    except TimeoutError:
                        caught_up = await catch_up()  # no more stored events of the kind
                        continue
                    event = pb.Event.FromString(msg.data)
                    if env_id and event.environment_id != env_id:
                        pass
                    elif caught_up:
                        await show(event)
                    else:
                        backlog.append(event)
                    if not caught_up and (msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= end):
                        caught_up = await catch_up()
            finally:
                await sub.unsubscribe()

    run(go)


def replica_counts(view: StateReader) -> dict[str, tuple[int, int]]:
    """Each env's replica count and revision, read before an operator's edit."""
    return {env.meta.id: (desired_replicas(env), view.rev(K.env(env.meta.id))) for env in view.envs()}


async def announce_scale_changes(conn: Connection, before: dict[str, tuple[int, int]], view: StateView) -> None:
    """After an operator's committed edit (``zattera apps apply``): a scale event per env whose count moved."""
    changes = []
    for env_id, (count, revision) in before.items():
        env = view.env(env_id)
        if env is None or (target := desired_replicas(env)) == count:
            continue
        message = f"{env.name}: replicas set from {count} to {target} by the operator"
        changes.append(
            scale_event(
                env, revision, count, target, kind=EVENT_SCALED, actor=actor(), message=message, now=time.time()
            )
        )
    await EventPublisher(conn).publish(*changes)
