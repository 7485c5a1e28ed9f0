"""The CLI's connection to the control plane: NATS, a state view and an unfenced writer.

The CLI writes through the same fenced-write layer as the services (every write expects the revision
it was decided on); it never holds a lease, and it never creates or changes a stream (``zattera cluster
init`` does, once). The connection comes from ``--nats``/``ZATTERA_NATS_URL``, else the saved context
(``zattera context use``). Its JetStream requests are retried across servers for a bounded wait; what
still fails is one line on stderr with a documented exit code (``ExitCode``), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import nats.errors
from nats.js.errors import APIError, NotFoundError
from rich.console import Console

from cli import contexts
from shared.actions.refusals import ActionRefused, Refusal
from shared.connection import ClusterUnavailable, Connection, NotAuthorized, PermissionDenied, connect
from shared.directget import TooManySubjects
from shared.errors import ZatteraError
from shared.natssettings import nats_settings
from shared.state.feed import StateView
from shared.subjects import STATE_STREAM

if TYPE_CHECKING:  # the writer, the actions and typer load when a command writes or exits with an error
    import typer
    from nats.aio.msg import Msg

    from cli.writer import CheckedWriter
    from shared.actions.context import ActionContext
    from shared.watches import Watch

R = TypeVar("R")
T = TypeVar("T")

err = Console(stderr=True, soft_wrap=True)  # messages are never cut at 80 columns in a pipe


def say(message: str, style: str | None = None) -> None:
    """A message to the operator on stderr, printed as it is (never read as rich markup, nor highlighted)."""
    err.print(message, style=style, markup=False, highlight=False)


OPERATOR = "operator"
REQUEST_DEADLINE = 15.0
"""How long a CLI request waits for JetStream across a server loss and a leader election."""


class ExitCode(IntEnum):
    """Exit codes of every ``zattera`` command (docs/commands.md, docs/cluster.md)."""

    OK = 0
    FAILED = 1  # refused, invalid input, not found
    USAGE = 2  # a bad option or argument (typer)
    UNAVAILABLE = 3  # no NATS server reachable, or no answer within the bounded wait
    NOT_INITIALISED = 4  # the cluster has no streams yet: `zattera cluster init`
    INTERRUPTED = 130


class ClusterNotInitialised(ZatteraError):
    pass


FIELD_LABELS = {
    "env": "--env",
    "job_id": "JOB_ID",
    "hostname": "hostname",
    "command": "command",
    "schedule": "--schedule",
    "keep_last": "--keep-last",
}
"""How the commands spell a refused request field (:meth:`ActionRefused.said_as`)."""
REFUSAL_EXIT = dict.fromkeys(Refusal, ExitCode.FAILED)
"""Every refusal exits 1: the message says which kind it is."""


class Control:
    """What a command runs with: the connection, the state view, and (made at first use, so that a read
    loads none of the write path) the writer and the operator actions' context."""

    def __init__(self, conn: Connection, view: StateView, *, polled: bool = False) -> None:
        self.conn = conn
        self.view = view
        self.polled = polled
        """A team member's following view: its changes pushed by the authorising path (docs/teams.md)."""

    @cached_property
    def writer(self) -> CheckedWriter:
        from cli.writer import CheckedWriter
        from shared.audit import Auditor, local_user

        # Audited (docs/audit.md): the OS user and the command as claims; a secured cluster's relay records
        # the credential's identity instead of the claimed user.
        who = local_user()
        auditor = Auditor(source="cli", user=who, verified=False, action=command_name(), action_claimed=True)
        auditor = dataclasses.replace(auditor, claimed_user=who)
        return CheckedWriter(self.conn, self.view, auditor, secured=bool(target().creds))

    @property
    def actions(self) -> ActionContext:
        """The context the operator actions (``shared/actions``) run in, acting as :func:`actor`."""
        from shared.actions.context import ActionContext

        return ActionContext(self.conn, self.writer, actor())


def command_name() -> str:
    """The command being run, as the audit log names it (``env set``): click's command path without the
    program's name; "" outside a command. Typer runs commands on its own copy of click (``typer._click``)."""
    try:
        from typer._click.globals import get_current_context
    except ImportError:  # a typer that uses click itself
        from click import get_current_context  # type: ignore[no-redef]

    ctx = get_current_context(silent=True)
    if ctx is None:
        return ""
    return ctx.command_path.partition(" ")[2] or ctx.command_path


@dataclass
class Options:
    nats_url: str = ""
    json: bool = False
    wide: bool = False


OPTIONS = Options()


@dataclass(frozen=True)
class Target:
    """Where the CLI connects: URLs, credentials file, TLS CA."""

    urls: str
    creds: str = ""
    tls_ca: str = ""


def target() -> Target:
    """``--nats``/``ZATTERA_NATS_URL`` when given, else the context in use, else the local default;
    ``ZATTERA_NATS_CREDS``/``ZATTERA_NATS_TLS_CA`` override the context's files; ``ZATTERA_TOKEN`` (an API
    token, docs/teams.md) overrides the credential."""
    cfg = nats_settings()
    saved = None if OPTIONS.nats_url else contexts.current()
    token = token_creds()
    if saved is None:
        return Target(OPTIONS.nats_url or cfg.nats_url, token or cfg.nats_creds, cfg.nats_tls_ca)
    return Target(saved.nats, token or cfg.nats_creds or saved.creds, cfg.nats_tls_ca or saved.tls_ca)


TOKEN_ENV = "ZATTERA_TOKEN"
_TOKEN_FILES: dict[str, str] = {}


def token_creds() -> str:
    """The credential an API token in ``ZATTERA_TOKEN`` wraps, as a private file removed at exit ("" when
    no token is set)."""
    import os

    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        return ""
    if token not in _TOKEN_FILES:
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        from shared.security.creds import write_private
        from shared.teams import decode_token

        directory = tempfile.mkdtemp(prefix="zattera-token-")
        atexit.register(shutil.rmtree, directory, True)
        _TOKEN_FILES[token] = str(write_private(Path(directory) / "token.creds", decode_token(token)))
    return _TOKEN_FILES[token]


def nats_url() -> str:
    return target().urls


CONNECT_TIMEOUT = 2.0
"""Seconds one server may take to accept the CLI's connection (a wrong address fails once every server
was tried: refused at once, unanswered after this)."""
OPERATOR_CREDENTIAL_HINT = (
    "the CLI needs the operator credential of a secured cluster: ZATTERA_NATS_CREDS=<data dir>/control/security/"
    "creds/operator.creds (printed by `zattera up --secure`), or a context saved with "
    "`zattera context add NAME --nats URL --creds FILE`"
)


def actor() -> str:
    """Who the CLI acts as, in events and records: ``operator``, or ``operator:<name>`` with a credential
    whose user JWT names its holder."""
    creds = target().creds
    if not creds:
        return OPERATOR
    from shared.security.creds import read_user_jwt
    from shared.security.nkeyjwt import decode_claims

    try:
        name = decode_claims(read_user_jwt(creds)).get("name", "")
    except (OSError, ValueError):
        return OPERATOR
    return f"{OPERATOR}:{name}" if name else OPERATOR


async def connect_cli(name: str = "zattera-cli") -> Connection:
    where = target()
    try:
        return await connect(
            where.urls,
            name=name,
            connect_timeout=CONNECT_TIMEOUT,
            creds=where.creds or None,
            tls_ca=where.tls_ca or None,
            request_deadline=REQUEST_DEADLINE,
            fail_fast=True,
        )
    except NotAuthorized as exc:
        raise NotAuthorized(f"{exc}; {OPERATOR_CREDENTIAL_HINT}") from None
    except (ConnectionError, OSError, nats.errors.Error) as exc:
        reason = str(exc).removeprefix(f"no NATS server reachable at {where.urls} ").strip("()") or type(exc).__name__
        raise ClusterUnavailable(
            f"cannot reach NATS at {where.urls} ({reason}). Is the cluster up (`make up`)?"
        ) from None


@asynccontextmanager
async def control(*, view: bool = True, follow: bool = False) -> AsyncIterator[Control]:
    """The connection, a state view and a writer. ``view``: loaded at once from a snapshot read that any
    replica answers (no consumer, no stream leader needed: a NATS server loss costs it ~1.5 s, not an
    election); ``follow``: kept up to date by a consumer instead (a command that watches changes)."""
    conn = await connect_cli()
    opened: list[str] = []

    async def open_state_watch() -> str:
        from shared.watches import STATE_WATCH, open_watch

        return opened.pop() if opened else await open_watch(conn, STATE_WATCH)

    # Followed through a watch control opens (the operator credential creates no consumer: SECURITY.md).
    state = StateView(conn, name="cli", open_consumer=open_state_watch)
    pushed: Watch | None = None
    try:
        polled = False
        if view and follow:
            from shared.watches import BadWatch

            try:
                opened.append(await open_state_watch())
            except BadWatch as exc:
                if "not authorised" not in str(exc):
                    raise
                # A team member may not follow the whole state: its view is loaded from an (authorised) snapshot,
                # then kept up to date by the changes the authorising path pushes to it (docs/teams.md).
                polled, follow = True, False
        await _load(conn, state, view=view, follow=follow)
        if polled:
            pushed = await _member_feed(conn, state)
        yield Control(conn, state, polled=polled)
    finally:
        if pushed is not None:
            await pushed.unsubscribe()
        await state.stop()
        await conn.close()


async def _member_feed(conn: Connection, state: StateView) -> Watch:
    """The state changes after the member's snapshot, pushed by control and applied to its view."""
    from shared.jetstream import is_delete_marker
    from shared.subjects import STATE_PREFIX
    from shared.watches import WatchSpec, follow

    async def apply(msg: Msg) -> None:
        data = None if is_delete_marker(msg.headers) else msg.data
        traceparent = (msg.headers or {}).get("traceparent", "")
        state.apply_raw(msg.subject[len(STATE_PREFIX) :], msg.metadata.sequence.stream, data, traceparent)

    spec = WatchSpec(STATE_STREAM, (f"{STATE_PREFIX}>",), "by_start_sequence", start_seq=state.last_revision + 1)
    return await follow(conn, spec, apply)


async def _load(conn: Connection, state: StateView, *, view: bool, follow: bool) -> None:
    """Check that the cluster is initialised while the view loads: the snapshot usually answers first (it
    needs no leader), and an uninitialised cluster is told by the stream's absence (the meta leader)."""
    exists = asyncio.ensure_future(conn.js.stream_info(STATE_STREAM))
    snapshot = asyncio.ensure_future(state.load_snapshot(REQUEST_DEADLINE)) if view and not follow else None
    try:
        if snapshot is not None:
            await asyncio.wait({exists, snapshot}, return_when=asyncio.FIRST_COMPLETED)
            if snapshot.done() and snapshot.exception() is None:
                return
        try:
            await exists
        except NotFoundError:
            raise ClusterNotInitialised(
                f"the cluster at {nats_url()} is not initialised: run `zattera cluster init`"
            ) from None
        if snapshot is not None:
            try:
                await snapshot
                return
            except TooManySubjects:
                follow = True
        if view and follow:
            await state.start(timeout=REQUEST_DEADLINE)
    except TimeoutError:
        raise ClusterUnavailable(
            f"the state view did not load within {REQUEST_DEADLINE:.0f}s; servers: {nats_url()}"
        ) from None
    finally:
        for task in (exists, snapshot):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


def on_cluster(
    action: Callable[[ActionContext, R], Awaitable[T]],
    request: R,
    *,
    view: bool = True,
    follow: bool = False,
    labels: Mapping[str, str] = FIELD_LABELS,
    what: str = "",
) -> T:
    """Run one operator action on the cluster and return its result (``view``: it reads the state;
    ``follow``: it reads what it wrote, the view kept current; see :func:`control`). A refusal is one line:
    ``what: `` and the refusal when ``what`` is given, else the refusal naming the request's field as
    ``labels`` spells it (the command's own options beside the common ones)."""

    async def go() -> T:
        async with control(view=view or follow, follow=follow) as c:
            try:
                return await action(c.actions, request)
            except ActionRefused as exc:
                said = f"{what}: {exc}" if what else exc.said_as(labels)
                raise fail(said, REFUSAL_EXIT[exc.kind]) from None

    return run(go)


def read_on_cluster(read: Callable[[ActionContext], T]) -> T:
    """What ``read`` finds in the cluster's state (an operator listing: drains, hooks…)."""

    async def go() -> T:
        async with control() as c:
            return read(c.actions)

    return run(go)


def fail(message: str, code: int = ExitCode.FAILED) -> typer.Exit:
    import typer

    err.print("[red]error:[/] ", end="")
    say(message)
    return typer.Exit(code)


def run(fn: Callable[[], Awaitable[T]]) -> T:
    """Run one command's coroutine; a cluster fault becomes one line and its exit code."""
    try:
        return asyncio.run(fn())  # type: ignore[arg-type]
    except KeyboardInterrupt:
        import typer

        raise typer.Exit(ExitCode.INTERRUPTED) from None
    except Exception as exc:
        reported = _reported(exc)
        if reported is None:
            raise
        raise reported from None


def _reported(exc: Exception) -> typer.Exit | None:
    """The one line and exit code a cluster fault is reported with (None: no such fault, a bug keeps its
    traceback)."""
    from shared.txn import CommitUnknown

    if isinstance(exc, ClusterNotInitialised):
        return fail(str(exc), ExitCode.NOT_INITIALISED)
    if isinstance(exc, ClusterUnavailable):
        return fail(str(exc), ExitCode.UNAVAILABLE)
    if isinstance(exc, PermissionDenied):
        return fail(f"{exc}; {OPERATOR_CREDENTIAL_HINT}")
    if isinstance(exc, CommitUnknown):
        return fail(
            f"{exc}: the write may or may not have been applied (NATS did not confirm it); "
            f"check before retrying. Servers: {nats_url()}",
            ExitCode.UNAVAILABLE,
        )
    if isinstance(exc, ActionRefused):
        return fail(exc.said_as(FIELD_LABELS), REFUSAL_EXIT[exc.kind])
    if isinstance(exc, APIError):
        return fail(f"NATS refused the request: {exc.description} (code {exc.err_code})")
    if isinstance(exc, nats.errors.Error | TimeoutError | ConnectionError):
        return fail(f"NATS did not answer ({exc or type(exc).__name__}); servers: {nats_url()}", ExitCode.UNAVAILABLE)
    if isinstance(exc, ZatteraError):  # an expected failure (a bad context, a refused request…): one line
        return fail(str(exc))
    return None
