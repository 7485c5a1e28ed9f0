"""``zattera run`` and ``zattera jobs list/show/cancel``: one-off commands and cron runs (docs/jobs.md).

``zattera run --env E -- CMD…`` is the operator action :func:`shared.actions.jobs.run_job` (a PENDING
``job.<id>`` the jobs loop places on the env's active release, the agent runs it once). Without
``--detach`` the command's output is printed live from the env's log stream (instance = the attempt's
assignment), Ctrl-C asks the job to stop (a second one leaves at once), and ``zattera run`` exits with the
command's exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
from collections.abc import AsyncIterator

import typer
from zattera.v1 import types_pb2 as pb

from cli import render
from cli.client import FIELD_LABELS, Control, ExitCode, control, err, fail, run, say
from cli.options import JSON, set_output
from shared import jobs as J
from shared import keys as K
from shared.actions.jobs import CancelJob, RunJob, find_job, request_cancel, run_job
from shared.actions.jobs import cancel_job as cancel_job_action
from shared.actions.names import env_label, release_label, target_env
from shared.actions.refusals import ActionRefused
from shared.applogs import STDERR, AppLogLine, UnknownLogStream, read_app_logs

jobs_app = typer.Typer(
    help="Job runs: cron entries' slots and `zattera run` commands (docs/jobs.md).", no_args_is_help=True
)
JOB_ID = typer.Argument(..., help="the job id (`zattera jobs list`)")

LOG_STREAM_WAIT = 0.5
"""How often a following ``zattera run`` looks again for a log stream that does not exist yet."""
_EXIT_CANCELED = ExitCode.INTERRUPTED


# ---------------------------------------------------------------------------- zattera run


def run_command(
    command: list[str] = typer.Argument(..., help="the command and its arguments, after --"),
    env: str = typer.Option(..., "--env", help="the environment: project/app/env or its id"),
    detach: bool = typer.Option(False, "--detach", "-d", help="print the job id and return at once"),
    json_output: bool = typer.Option(False, "--json", help="with --detach: the job as JSON"),
) -> None:
    """Run a command once with the env's release, config and secrets; print its output; exit with its code."""
    set_output(json_output)
    text = shlex.join(command) if len(command) > 1 else command[0]
    try:
        J.check_command(text)
    except J.CommandError as exc:
        raise fail(exc.said_as(FIELD_LABELS)) from None

    async def go() -> int:
        async with control(follow=not detach) as c:  # following the run needs a view kept up to date
            started = await run_job(c.actions, RunJob(env, text))
            if detach:
                if json_output:
                    job = c.view.get(K.JOB, started.job_id)
                    assert job is not None  # read-your-writes: the commit is in the view
                    render.emit_json(render.as_dict(job))
                else:
                    render.out.print(started.job_id, highlight=False)
                return 0
            err.print(f"job {started.job_id} started ({started.env}); Ctrl-C cancels it", highlight=False)
            return await _follow(c, started.job_id, started.env_id)

    code = run(go)
    if code:
        raise typer.Exit(code)


async def _follow(c: Control, job_id: str, env_id: str) -> int:
    """Print the job's output until it ended; its exit code (130 when canceled)."""
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    feed = c.view.subscribe({K.JOB})
    printer: _Printer | None = None
    following = said = ""
    try:
        while True:
            job = c.view.get(K.JOB, job_id)
            if not isinstance(job, pb.Job):
                raise fail(f"job {job_id} vanished")
            if job.assignment_id and job.assignment_id != following:
                if printer is not None:
                    await printer.finish()
                following = job.assignment_id
                printer = _Printer(c, env_id, following)
            if not J.is_active(job):
                break
            if job.status == J.PENDING and job.message and job.message != said:
                said = job.message  # e.g. waiting for a node, or retrying after a failed attempt
                say(f"job {job_id}: {said}")
            if interrupted.is_set():
                interrupted.clear()
                err.print(f"canceling job {job_id} (Ctrl-C again leaves without waiting)", highlight=False)
                loop.add_signal_handler(signal.SIGINT, _leave)
                await _request_cancel(c, job_id)
                continue
            waiter = asyncio.ensure_future(feed.wait())
            stop = asyncio.ensure_future(interrupted.wait())
            try:
                await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                stop.cancel()
        if printer is not None:
            await printer.finish()
    finally:
        feed.close()
        loop.remove_signal_handler(signal.SIGINT)
        if printer is not None:
            printer.task.cancel()
    return _outcome(job)


def _leave() -> None:
    raise SystemExit(_EXIT_CANCELED)


def _outcome(job: pb.Job) -> int:
    if job.status == J.SUCCEEDED:
        return 0
    if job.status == J.CANCELED:
        err.print(f"job {job.meta.id} canceled", highlight=False)
        return _EXIT_CANCELED
    say(f"job {job.meta.id} {J.status_name(job.status)}: {job.message}")
    if job.status == J.FAILED and job.exit_code_known and job.exit_code:
        return job.exit_code
    return ExitCode.FAILED


class _Printer:
    """Prints one attempt's lines (its instance's subject of the env's log stream) as they are stored."""

    def __init__(self, c: Control, env_id: str, instance: str) -> None:
        self.c, self.env_id, self.instance = c, env_id, instance
        self.printed = 0
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                async for line in self._read(follow=True):
                    self._print(line)
                return
            except UnknownLogStream:
                await asyncio.sleep(LOG_STREAM_WAIT)

    def _read(self, *, follow: bool) -> AsyncIterator[AppLogLine]:
        return read_app_logs(self.c.conn, self.env_id, instance=self.instance, last=1_000_000, follow=follow)

    def _print(self, line: AppLogLine) -> None:
        self.printed += 1
        _emit(line)

    async def finish(self) -> None:
        """The attempt ended: the agent stored its last lines before it reported the end, so whatever the
        follower has not printed yet is read back once, in order, after it."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        seen = 0
        with contextlib.suppress(UnknownLogStream):
            async for line in self._read(follow=False):
                seen += 1
                if seen > self.printed:
                    self._print(line)


def _emit(line: AppLogLine) -> None:
    target = sys.stderr if line.stream == STDERR else sys.stdout
    target.write(line.line + "\n")
    target.flush()


async def _request_cancel(c: Control, job_id: str) -> None:
    try:
        await request_cancel(c.actions, job_id)
    except ActionRefused:
        raise fail(
            f"job {job_id}: the cancel kept crossing the job's updates; run `zattera jobs cancel {job_id}` again"
        ) from None


# ---------------------------------------------------------------------------- zattera jobs


@jobs_app.command("list")
def list_jobs(
    env: str = typer.Option("", "--env", help="only this environment (project/app/env or id)"),
    cron: str = typer.Option("", "--cron", help="only this cron entry's runs (its history)"),
    json_output: bool = JSON,
) -> None:
    """Job runs, newest first: cron slots (entry, slot) and one-off commands, with status and exit code."""
    set_output(json_output)

    async def go() -> None:
        async with control() as c:
            env_id = target_env(c.view, env).meta.id if env else None
            found = J.newest_first([j for j in c.view.jobs(env_id) if not cron or j.cron_name == cron])
            render.listing(
                "jobs",
                ["ID", "ENV", "CRON", "SLOT", "STATUS", "ATTEMPT", "EXIT", "DURATION", render.Col("NODE", wide=True)],
                found,
                lambda j: (
                    j.meta.id,
                    env_label(c.view, j.environment_id),
                    j.cron_name or ("(release)" if j.deployment_id else "(run)"),
                    render.ts(j.slot_at),
                    J.status_name(j.status),
                    j.attempt,
                    J.exit_text(j),
                    J.duration(j),
                    j.node_id or "-",
                ),
            )

    run(go)


@jobs_app.command("show")
def show_job(
    job_id: str = JOB_ID,
    json_output: bool = JSON,
) -> None:
    """One run: status, attempt, node, times, exit code, message and its last output lines."""
    set_output(json_output)

    async def go() -> None:
        async with control() as c:
            job = find_job(c.view, job_id)
            if json_output:
                render.emit_json(render.as_dict(job))
                return
            rows = [
                ("env", env_label(c.view, job.environment_id)),
                ("cron", job.cron_name or "(zattera run)"),
                ("slot", render.ts(job.slot_at)),
                ("command", job.command),
                ("status", J.status_name(job.status) + (" (cancel requested)" if job.cancel_requested else "")),
                ("attempt", f"{job.attempt} of {1 + job.max_retries}"),
                ("node", job.node_id or "-"),
                ("release", release_label(c.view, job.release_id)),
                ("started", render.ts(job.started_at)),
                ("finished", render.ts(job.finished_at)),
                ("duration", J.duration(job)),
                ("exit code", J.exit_text(job)),
                ("message", job.message or "-"),
            ]
            render.table(f"job {job.meta.id}", ["FIELD", render.Col("VALUE", wrap=True)], rows)
            if job.output_tail:
                render.out.print("last output lines:", highlight=False)
                for line in job.output_tail:
                    render.out.print(f"  {line}", markup=False, highlight=False)

    run(go)


@jobs_app.command("cancel")
def cancel_job(job_id: str = JOB_ID) -> None:
    """Stop a pending or running job (its process gets SIGTERM, then SIGKILL after the stop grace)."""

    async def go() -> None:
        async with control() as c:
            await cancel_job_action(c.actions, CancelJob(job_id))
        render.out.print(f"job {job_id}: cancel requested", highlight=False)

    run(go)
