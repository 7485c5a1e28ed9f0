"""Secrets benchmark: what sealed secrets add to an instance start, and how fast a key rotation re-seals.

``python -m benchmarks.secrets_bench [--full]``. Against a real nats-server with the secrets service
in-process (its own connection and view, as in production):

* open round trip: an agent's ``fetch_secrets`` for an assignment whose release uses 10 secrets — request,
  authorization on the view, 10 SealedBox opens, one seal to the node key, reply, open on the agent
  (200 requests quick, 2,000 full; target p99 ≤ 50 ms, against a process start of ~100 ms);
* rotation: ``zattera.secrets.rotate`` with 500 sealed secret versions (5,000 full) re-sealed under a new
  key in fenced writes (target ≥ 500 versions/s).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from nacl.public import PrivateKey
from zattera.cluster.v1 import cluster_pb2 as cpb
from zattera.v1 import types_pb2 as pb

from benchmarks.common import Row, bench_main, embedded_server, percentile, row
from services.secrets.service import SecretsService
from shared import keys as K
from shared.connection import connect
from shared.ids import new_id
from shared.provisioning import provision
from shared.secrets import CLUSTER_KEY, ROTATE_SUBJECT, fetch_secrets, public_bytes, seal
from shared.state.feed import StateView
from shared.txn import Writer
from tests.waiting import eventually

SECRETS_PER_RELEASE = 10
VALUE = b"x" * 64


async def _bench(url: str, key_file: Path, requests: int, versions: int) -> list[Row]:
    conn = await connect(url, name="bench")
    await provision(conn.js)
    svc_conn = await connect(url, name="bench-secrets")
    svc_view = StateView(svc_conn, name="secrets")
    await svc_view.start()
    service = SecretsService(svc_conn, svc_view, Writer(svc_conn, svc_view), keyring_path=key_file)
    task = asyncio.create_task(service.run())
    view = StateView(conn, name="bench")
    await view.start()
    writer = Writer(conn, view)
    try:
        await service.serving.wait()
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the cluster key published")
        published = view.get(K.SECRETS_KEY, CLUSTER_KEY)
        assert isinstance(published, pb.SecretsKey)
        node_key = PrivateKey.generate()
        node = pb.Node(status=pb.NODE_STATUS_ALIVE, secrets_public_key=public_bytes(node_key))
        node.meta.id = "n1"
        release = pb.Release(environment_id="E1", version=1, image_ref="img")
        release.meta.id = "R1"
        txns = [writer.txn().create(node)]
        for i in range(versions):
            sealed = pb.SealedSecret(
                environment_id="E1",
                name=f"S{i}",
                version=1,
                ciphertext=seal(published.public_key, VALUE),
                key_id=published.key_id,
            )
            sealed.meta.id = new_id()
            if i < SECRETS_PER_RELEASE:
                release.service.secrets[sealed.name].secret_id = sealed.meta.id
            txns.append(writer.txn().create(sealed))
        assignment = pb.Assignment(
            node_id="n1", environment_id="E1", release_id="R1", desired=pb.ASSIGNMENT_DESIRED_RUN
        )
        assignment.meta.id = "A1"
        txns.append(writer.txn().create(release).create(assignment))
        assert all(r is None for r in await writer.commit_many(txns))
        await eventually(
            lambda: svc_view.assignment("A1") is not None and svc_view.count(K.SECRET) == versions, 30, "loaded"
        )

        latencies = []
        for _ in range(requests):
            started = time.perf_counter()
            values = await fetch_secrets(conn, "n1", node_key, "A1")
            latencies.append((time.perf_counter() - started) * 1000)
            assert len(values) == SECRETS_PER_RELEASE

        started = time.perf_counter()
        reply = await conn.nc.request(ROTATE_SUBJECT, cpb.RotateSecretsKeyRequest().SerializeToString(), timeout=600)
        rotation = time.perf_counter() - started
        answer = cpb.RotateSecretsKeyResponse.FromString(reply.data)
        assert not answer.error and answer.resealed == versions, answer
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await view.stop()
        await svc_view.stop()
        await svc_conn.close()
        await conn.close()
    return [
        row(
            f"secrets: open round trip, {SECRETS_PER_RELEASE} secrets (p50)",
            percentile(latencies, 50),
            "ms",
            "",
            f"{requests} requests",
        ),
        row(
            f"secrets: open round trip, {SECRETS_PER_RELEASE} secrets (p99)",
            percentile(latencies, 99),
            "ms",
            "≤ 50 ms",
            "an app process start is ~100 ms",
        ),
        row(f"secrets: key rotation, {versions:,} versions re-sealed", rotation, "s", "", ""),
        row("secrets: key rotation rate", versions / rotation, "versions/s", "≥ 500/s", ""),
    ]


def run(quick: bool = True) -> list[Row]:
    requests, versions = (200, 500) if quick else (2_000, 5_000)
    with embedded_server("zattera-secrets-bench-") as server, tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_bench(server.url, Path(tmp) / "cluster.key", requests, versions))


if __name__ == "__main__":
    bench_main("Secrets", run, __doc__, "2,000 requests, 5,000 versions")
