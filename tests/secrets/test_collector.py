"""The collector of unused secret versions: a pure decision, and one pass on real NATS with a fake clock."""

from __future__ import annotations

from zattera.v1 import types_pb2 as pb

from services.secrets.collector import SecretsCollector, collectable
from shared import keys as K
from shared.clock import FakeClock
from shared.connection import Connection
from shared.loop import LoopDeps
from shared.state.feed import StateView
from shared.txn import Writer
from tests import factories

NOW = 1_700_000_000.0
GRACE = 600.0


def sealed(secret_id: str, env_id: str = "E1", *, age: float = GRACE + 1) -> pb.SealedSecret:
    s = pb.SealedSecret(environment_id=env_id, name="API_TOKEN", ciphertext=b"\x00" * 60, key_id="k")
    s.meta.id = secret_id
    s.meta.created_at.FromNanoseconds(int((NOW - age) * 1e9))
    return s


def uses(spec: pb.ServiceSpec, secret_id: str) -> None:
    spec.secrets[f"S_{secret_id}"].secret_id = secret_id


def world() -> tuple[list[pb.SealedSecret], dict[str, pb.Environment], dict[str, list[pb.Release]]]:
    env = factories.env("E1")
    uses(env.service, "STAGED")
    release = factories.release("R1", "E1")
    uses(release.service, "RELEASED")
    secrets = [
        sealed("STAGED"),
        sealed("RELEASED"),
        sealed("ORPHAN"),
        sealed("YOUNG", age=GRACE - 1),
        sealed("ENV_GONE", "E2"),
    ]
    return secrets, {"E1": env}, {"E1": [release], "E2": []}


def test_only_old_versions_nothing_references_are_collected() -> None:
    secrets, envs, releases = world()
    assert collectable(secrets, envs, releases, NOW, GRACE) == ["ORPHAN", "ENV_GONE"]
    assert collectable(secrets, envs, releases, NOW + GRACE, GRACE) == ["ORPHAN", "YOUNG", "ENV_GONE"]


async def test_a_pass_deletes_the_unused_versions(conn: Connection, view: StateView, writer: Writer) -> None:
    secrets, envs, releases = world()
    txn = writer.txn()
    for msg in [*secrets, *envs.values(), *releases["E1"]]:
        txn.create(msg)
    await writer.commit(txn)
    clock = FakeClock(NOW)
    loop = SecretsCollector(LoopDeps(conn, view, clock), grace=GRACE)
    loop.writer = writer
    await loop.pass_once()
    assert sorted(s.meta.id for s in view.all(K.SECRET)) == ["RELEASED", "STAGED", "YOUNG"]
    clock.set(NOW + GRACE)
    await loop.pass_once()
    assert sorted(s.meta.id for s in view.all(K.SECRET)) == ["RELEASED", "STAGED"]
