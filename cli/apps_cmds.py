"""``zattera apps apply|list|delete``: apps and environments from zattera.toml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.apply import ApplyResult, add_addon_steps, declared_addons, plan
from cli.client import control, fail, run
from cli.env_cmds import apps_delete
from cli.events_cmds import announce_scale_changes, replica_counts
from cli.options import JSON, WIDE, set_output
from cli.plan_view import print_plan
from cli.render import Col
from cli.spec import SpecError, load
from shared.actions.addon_declare import apply_addons, plan_addons
from shared.actions.names import env_path
from shared.actions.refusals import ActionRefused
from shared.clock import RealClock
from shared.deployments import desired_replicas
from shared.retry import Attempt, RetriesExhausted, commit_with_retry

apps_app = typer.Typer(no_args_is_help=True, help="Apps and environments from zattera.toml.")


@apps_app.command("apply")
def apps_apply(
    path: Path = typer.Argument(Path("zattera.toml")),
    json: bool = JSON,
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would change, field by field; write nothing"),
) -> None:
    """Create or update the project, app and environments described by a zattera.toml (docs/zattera-toml.md)."""
    set_output(json)
    try:
        spec = load(path)
    except SpecError as exc:
        raise fail(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, an unreadable file, not UTF-8
        raise fail(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None

    async def go() -> None:
        async with control() as c:

            def attempt() -> Attempt[tuple[ApplyResult, dict[str, tuple[int, int]]]]:
                counts = replica_counts(c.view)  # read with the decision: the scale events compare against it
                try:
                    txn, result = plan(c.view, c.writer, spec)
                except ValueError as exc:
                    raise fail(str(exc)) from None
                return Attempt(None if dry_run else txn, (result, counts))

            try:
                result, counts = await commit_with_retry(
                    c.writer, attempt, clock=RealClock(), contended=f"app {spec.app}"
                )
            except RetriesExhausted:
                raise fail("the app kept changing while applying; try again") from None
            if not dry_run:
                await announce_scale_changes(c.conn, counts, c.view)
            declared = declared_addons(spec)
            if declared:
                try:
                    steps = (
                        plan_addons(c.view, spec.project, spec.app, declared)
                        if dry_run
                        else (await apply_addons(c.actions, spec.project, spec.app, declared)).steps
                    )
                except ActionRefused as exc:
                    raise fail(f"{path}: {exc}") from None
                add_addon_steps(result, steps)
            if render.json_mode():
                render.emit_json(result.as_json() | {"dry_run": dry_run})
                return
            print_plan(result, dry_run=dry_run)
            if dry_run:
                return
            if result.pending:
                render.out.print("(or set a pending volume's policy now with `zattera volumes policy`)")
            for name, env_id in result.env_ids.items():
                render.out.print(f"env {spec.project}/{spec.app}/{name} = {env_id}")

    run(go)


@apps_app.command("list")
def apps_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Every environment with its active release and replica counts."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:

            def row(e: pb.Environment) -> list[Any]:
                release = c.view.release(e.active_release_id)
                return [
                    env_path(c.view, e),
                    e.meta.id,
                    f"v{release.version}" if release else "-",
                    c.view.env_run_count(e.meta.id),
                    desired_replicas(e),  # what the scheduler converges to: 0 for a cooled env
                ]

            render.listing(
                "environments", ["env", Col("id", wide=True), "active", "running", "desired"], c.view.envs(), row
            )

    run(go)


apps_app.command("delete")(apps_delete)
