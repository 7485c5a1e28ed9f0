"""``zattera builds list|logs|cancel``: builds and their logs; a cancel is the operator action
:func:`shared.actions.builds.cancel_build`."""

from __future__ import annotations

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import Control, control, err, fail, run
from cli.options import JSON, WIDE, set_output
from cli.render import Col
from shared import keys as K
from shared.actions.names import env_label

builds_app = typer.Typer(no_args_is_help=True, help="Builds and their logs.")


@builds_app.command("list")
def builds_list(json: bool = JSON, wide: bool = WIDE) -> None:
    """Builds, newest first."""
    set_output(json, wide)

    async def go() -> None:
        async with control() as c:
            render.listing(
                "builds",
                ["id", "env", "status", "node", "image", Col("error", wrap=True)],
                list(reversed(c.view.builds())),
                lambda b: [
                    b.meta.id,
                    env_label(c.view, b.environment_id),
                    render.enum_name(pb.BuildStatus, b.status, "BUILD_STATUS_"),
                    b.node_id,
                    b.image_ref,
                    b.error,
                ],
            )

    run(go)


@builds_app.command("logs")
def builds_logs(build_id: str, follow: bool = typer.Option(False, "--follow", "-f"), json: bool = JSON) -> None:
    """A build's log; --follow streams it until the build ends; --json prints one object per line."""
    from shared.buildlogs import follow_build_log, read_build_log
    from shared.ids import is_safe_id, unsafe_id
    from shared.jetstream import read_state_key

    if not is_safe_id(build_id):
        raise fail(f"{unsafe_id('build id', build_id)} (see `zattera builds list`)")

    async def recorded(c: Control) -> bool:
        return (await read_state_key(c.conn.js, K.build(build_id))).data is not None

    async def go() -> None:
        async with control(view=False) as c:
            # No record and no stored line: an unknown id (a follow would wait for it forever).
            if not await recorded(c) and (follow or not await read_build_log(c.conn, build_id)):
                raise fail(f"build {build_id!r} not found (see `zattera builds list`)")
            if follow:
                async for line in follow_build_log(c.conn, build_id):
                    print(build_log_line(build_id, line, json), flush=True)
            else:
                for line in await read_build_log(c.conn, build_id):
                    print(build_log_line(build_id, line, json))

    run(go)


def build_log_line(build_id: str, line: str, as_json: bool) -> str:
    import json as json_lib

    return json_lib.dumps({"build_id": build_id, "line": line}) if as_json else line


@builds_app.command("cancel")
def builds_cancel(build_id: str) -> None:
    """Cancel a QUEUED or RUNNING build (its builder is told to stop)."""
    from shared.actions.builds import CancelBuild, cancel_build

    async def go() -> None:
        async with control() as c:
            await cancel_build(c.actions, CancelBuild(build_id))
        err.print(f"build {build_id}: canceled")

    run(go)
