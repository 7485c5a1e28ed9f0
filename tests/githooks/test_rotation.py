"""A key rotation re-seals a git hook's secret and token: the hook still verifies deliveries afterwards."""

from __future__ import annotations

from pathlib import Path

from zattera.v1 import types_pb2 as pb

from services.secrets.githook_gate import open_hook
from shared import keys as K
from shared.backup.sealed import seal_settings
from shared.secrets import CLUSTER_KEY, load_keyring
from shared.state.feed import StateView
from shared.txn import Writer
from tests.secrets.test_service import secrets_service
from tests.waiting import eventually


async def test_rotation_reseals_a_hooks_secret_and_token(
    nats_url: str, view: StateView, writer: Writer, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.key"
    opened = {"secret": "hook-secret-1", "token": "tok-2"}
    async with secrets_service(nats_url, path) as running:
        await eventually(lambda: view.get(K.SECRETS_KEY, CLUSTER_KEY) is not None, 10, "the key is published")
        sealed = seal_settings(view, opened)
        hook = pb.GitHook(environment_id="E", provider="github", sealed=sealed.sealed, key_id=sealed.key_id)
        hook.meta.id = "h1"
        await writer.commit(writer.txn().create(hook))
        rotated = await running.service.rotate()
        assert not rotated.error and rotated.resealed == 1 and rotated.previous_key_id == sealed.key_id

        def current() -> pb.GitHook:
            found = view.get(K.GIT_HOOK, "h1")
            assert isinstance(found, pb.GitHook)
            return found

        await eventually(lambda: current().key_id == rotated.key_id, 10, "re-sealed")
        assert open_hook(load_keyring(path), current()) == opened
