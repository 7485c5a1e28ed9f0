"""Read → decide → fenced commit, retried on a conflict with one policy (Nomad's ``retryMax`` shape).

Every caller that writes on behalf of a request (deploy API, CLI edits, cancels, the activator, node
registration, snapshot bookkeeping) goes through :func:`commit_with_retry`: ``decide`` reads the state and
returns an :class:`Attempt` (the transaction, expectations captured as it was built, and the result to hand
back); the helper commits it. A :class:`~shared.txn.Conflict` means nothing was written and someone else
won: the helper waits until the view has seen that write, then decides again — at once the first time, then
after a jittered, growing pause on the injected clock (several writers contending back off apart). A
:class:`~shared.txn.CommitUnknown` has already caught the view up: a caller that passes ``landed`` has it
recognise a write that did land, and otherwise decides again on what is there (:func:`decide_again` when the
re-read alone tells); without ``landed`` it propagates, to be reported (the CLI's "may or may not have been
applied"). :class:`~shared.txn.Deposed` and any other refusal propagate. When the attempts run out,
:class:`RetriesExhausted` says what kept changing.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.backoff import exponential
from shared.clock import Clock
from shared.state.feed import StateView
from shared.txn import CommitUnknown, Conflict, Deposed, Txn, TxnError, Writer

T = TypeVar("T")

WINNER_WAIT = 2.0
"""How long to wait for the view to show the write that refused ours (it is normally there in ms)."""

_jitter = random.Random()


class RetriesExhausted(TxnError):
    """Every attempt was refused because the state kept changing; nothing of the last one was written."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``attempts`` decisions in all; after the first conflict the retry is immediate (the view has the
    winner), later ones wait a full-jitter pause: uniform in [0, min(cap, base · 2^(retry-2))]."""

    attempts: int = 10
    base_delay: float = 0.05
    max_delay: float = 1.0

    def backoff(self, retry: int, rng: random.Random) -> float:
        """The pause before decision number ``retry + 1`` (``retry`` counts from 1)."""
        if retry <= 1:
            return 0.0
        return rng.uniform(0.0, exponential(self.base_delay, retry - 1, self.max_delay))


RETRY = RetryPolicy()
"""The one policy every read-decide-commit caller uses."""


@dataclass(frozen=True, slots=True)
class Attempt(Generic[T]):
    """One decision: ``txn`` to commit (None or empty: nothing to write) and the ``result`` returned once it
    landed. Build the transaction right after reading (no await in between): its expectations are the
    revisions the decision read."""

    txn: Txn | None
    result: T


Decide = Callable[[], "Attempt[T] | Awaitable[Attempt[T]]"]


async def commit_with_retry(
    writer: Writer,
    decide: Decide[T],
    *,
    clock: Clock,
    contended: str,
    landed: Callable[[T], bool] | None = None,
    policy: RetryPolicy = RETRY,
) -> T:
    """Decide and commit until a decision lands; ``decide`` refuses by raising. ``contended`` names what
    kept changing (the :class:`RetriesExhausted` message); ``landed`` tells, after an unknown outcome, from
    the caught-up view whether the write is there (False: decide again; None: the outcome propagates)."""
    for attempt in range(1, policy.attempts + 1):
        decided = decide()
        chosen = await decided if inspect.isawaitable(decided) else decided
        if not chosen.txn:
            return chosen.result
        try:
            await writer.commit(chosen.txn)
        except Deposed:
            raise
        except Conflict:
            await _await_winner(writer.view, chosen.txn)
            await clock.sleep(policy.backoff(attempt, _jitter))
            continue
        except CommitUnknown:
            if landed is None:
                raise
            if landed(chosen.result):
                return chosen.result
            continue
        return chosen.result
    raise RetriesExhausted(f"{contended} kept changing; try again")


def decide_again(_: object) -> bool:
    """``landed`` for a decision that can simply be taken again after an unknown outcome: the caught-up
    re-read shows whatever landed, and deciding on it does not repeat the write (a cancel already recorded,
    a status already set)."""
    return False


async def _await_winner(view: StateView, txn: Txn) -> None:
    """Wait until the view shows a revision the refused transaction did not expect (the write that won)."""

    def unchanged() -> bool:
        return all(view.rev(op.key) == op.expect for op in txn.ops)

    if not unchanged():
        return
    feed = view.subscribe()
    try:
        async with asyncio.timeout(WINNER_WAIT):
            while unchanged():
                await feed.wait()
    except TimeoutError:
        return
    finally:
        feed.close()
