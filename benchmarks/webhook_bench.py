"""Webhook benchmark: a git host's push delivery received → the build of that commit started.

``python -m benchmarks.webhook_bench [--full]``. Against a real nats-server, on loopback: the console's
``POST /hooks/github/<id>`` (a signed GitHub push payload), the secrets service's gate (signature, JetStream
dedupe), the ``githooks`` loop consuming the delivery, fetching the commit from a repository served by
``git http-backend`` (token required) and recording the source deploy: the figure ends when the state view
shows the QUEUED build of that commit (what a builder starts on). Each push is a new commit; the previous
deployment is ended first (as the orchestrator would) so none is superseded. 20 pushes quick, 100 full.

* answer: the 202 to the git host (target < 1 s: GitHub gives up after 10 s);
* received → build started p50 / p99 (target p99 ≤ 1 s).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from benchmarks.common import Row, bench_main, embedded_server, percentile, row
from shared.actions.githooks import AddHook, add_hook
from shared.connection import connect
from shared.provisioning import provision
from shared.state.feed import StateView
from tests.githooks import payloads as P
from tests.githooks.rig import ENV_ID, TOKEN, rig_for
from tests.waiting import eventually


async def _bench(url: str, tmp: Path, pushes: int) -> list[Row]:
    conn = await connect(url, name="bench")
    await provision(conn.js, tombstone_ttl=900)
    view = StateView(conn, name="bench")
    await view.start()
    answers: list[float] = []
    started_after: list[float] = []
    try:
        async with rig_for("github", conn, view, tmp) as rig:
            added = await add_hook(
                rig.ctx, AddHook(env=ENV_ID, provider="github", repo_url=rig.clone_url, branch="main", token=TOKEN)
            )
            for i in range(pushes + 1):  # the first warms the caches (git, the object store, the consumer)
                await rig.end_deployments(ENV_ID)
                sha = rig.repo.commit({"app.py": f"print({i})\n"}, f"push {i}")
                event, payload = P.push("github", rig.clone_url, sha)
                delivery = P.signed("github", added.secret, event, payload)
                received = time.perf_counter()
                status, answered = await rig.post("github", added.hook.id, delivery)
                assert status == 202, status

                def built(sha: str = sha) -> bool:
                    return any(b.git_sha == sha for b in view.builds(ENV_ID))

                await eventually(built, 30, f"the build of push {i}")
                if i:
                    answers.append(answered * 1000)
                    started_after.append((time.perf_counter() - received) * 1000)
    finally:
        await view.stop()
        await conn.close()
    return [
        row("webhook: 202 answer to the git host (p99)", percentile(answers, 99), "ms", "< 1,000 ms", ""),
        row("webhook: received → build started (p50)", percentile(started_after, 50), "ms", "", f"{pushes} pushes"),
        row(
            "webhook: received → build started (p99)",
            percentile(started_after, 99),
            "ms",
            "≤ 1,000 ms",
            "git fetch of the commit included",
        ),
    ]


def run(quick: bool = True) -> list[Row]:
    pushes = 20 if quick else 100
    with embedded_server("zattera-webhook-bench-") as server, tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_bench(server.url, Path(tmp), pushes))


if __name__ == "__main__":
    bench_main("Webhooks", run, __doc__, "100 pushes")
