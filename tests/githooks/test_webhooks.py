"""Webhooks from GitHub, GitLab and Gitea end to end on real components: a real nats-server, the console's
HTTP endpoint, the secrets service's gate (verification, JetStream dedupe) and ``githooks`` loop, a
repository served on loopback by ``git http-backend`` that requires the hook's token, and a loopback stand-in
of the provider's commit-status API. Each provider's documented payloads are replayed with a correct
signature (→ that commit is fetched and deployed), forged, unsigned and replayed (→ refused, nothing
deployed); pull requests make, refresh and delete preview envs, a TTL sweep (fake clock) deletes them too;
no token or secret appears in records, events or logs."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import pytest
from zattera.v1 import types_pb2 as pb

from services.secrets.githook_git import commit_state
from shared import githooks as G
from shared import keys as K
from shared.actions.githooks import AddHook, RemoveHook, add_hook, list_hooks, remove_hook
from shared.actions.refusals import Invalid
from shared.clock import from_timestamp
from shared.connection import Connection
from shared.state.feed import StateView
from shared.subjects import SOURCES_STORE
from tests.githooks import payloads as P
from tests.githooks.rig import API_KEY, DB_URL, DOMAIN, ENV_ID, TOKEN, Rig, rig_for, seed
from tests.waiting import eventually

CONSOLE_URL = "https://console.test"
PROVIDERS = list(G.PROVIDERS)


async def _source_file(conn: Connection, digest: str, name: str) -> str:
    store = await conn.js.object_store(SOURCES_STORE)
    data = (await store.get(digest)).data or b""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = tar.extractfile(name)
        assert member is not None
        return member.read().decode()


def _no_leak(rig: Rig, caplog: pytest.LogCaptureFixture, *secrets: str) -> None:
    for kind in K.ALL_KINDS:
        for record in rig.view.all(kind):
            raw = K.encode(record)
            for value in secrets:
                assert value.encode() not in raw, f"{kind} {record.meta.id} holds a secret in the clear"
    text = caplog.text + "".join(str(e) for e in rig.events)
    for value in secrets:
        assert value not in text, "a secret in the logs or events"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_signed_push_deploys_that_commit_and_forged_unsigned_or_replayed_deliveries_deploy_nothing(
    provider: str, conn: Connection, view: StateView, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    async with rig_for(provider, conn, view, tmp_path) as rig:
        added = await add_hook(
            rig.ctx,
            AddHook(
                env="shop/web/production",
                provider=provider,
                repo_url=rig.clone_url,
                branch="main",
                token=TOKEN,
                api_url=rig.status.url,
                console_url=CONSOLE_URL,
            ),
        )
        hook_id, secret = added.hook.id, added.secret
        assert added.url == f"{CONSOLE_URL}/hooks/{provider}/{hook_id}"
        assert [h.id for h in list_hooks(rig.ctx)] == [hook_id]
        sha = rig.repo.commit({"app.py": "print('v2')\n"}, "Add a page")
        event, payload = P.push(provider, rig.clone_url, sha)
        delivery = P.signed(provider, secret, event, payload)

        status, elapsed = await rig.post(provider, hook_id, delivery)
        assert status == 202 and elapsed < 1.0, (status, elapsed)
        await eventually(lambda: any(b.git_sha == sha for b in rig.builds(ENV_ID)), 15, "a build of the commit")
        (build,) = rig.builds(ENV_ID)
        assert build.git_branch == "main" and build.status == pb.BUILD_STATUS_QUEUED
        assert await _source_file(conn, build.tarball_digest, "app.py") == "print('v2')\n", "that commit's tree"
        assert G.fetch_auth_header(provider, TOKEN) in rig.server.auth_seen, "fetched with the sealed token"
        (deployment,) = view.deployments(ENV_ID)
        assert deployment.build_id == build.meta.id and deployment.created_by_user_id == f"githook:{hook_id}"
        handled = rig.loop.handled

        # Replayed, forged, unsigned, for another hook: refused; nothing else deployed.
        assert (await rig.post(provider, hook_id, delivery))[0] == 409
        other_sha = rig.repo.commit({"app.py": "print('evil')\n"}, "Evil")
        event, payload = P.push(provider, rig.clone_url, other_sha)
        forged = P.signed(provider, "not-the-secret", event, payload)
        assert (await rig.post(provider, hook_id, forged))[0] == 401
        signature = G.HEADERS[provider].signature
        unsigned = P.Delivery({k: v for k, v in forged.headers.items() if k != signature}, forged.body)
        assert (await rig.post(provider, hook_id, unsigned))[0] == 401
        if provider != "gitlab":  # GitLab's token covers no body (docs/git.md: serve the console over HTTPS)
            tampered = P.Delivery(delivery.headers | {G.HEADERS[provider].delivery: "fresh-id-1"}, forged.body)
            assert (await rig.post(provider, hook_id, tampered))[0] == 401, "a genuine signature over another body"
        assert (await rig.post(provider, "01NOSUCHHOOK", delivery))[0] == 404
        await asyncio.sleep(0)  # let anything wrongly queued be seen by the consumer below
        await rig.loop.pass_once()
        assert rig.loop.handled == handled and len(rig.builds(ENV_ID)) == 1, "nothing else was deployed"

        # Commit statuses: pending while the deploy runs, success once it is live; then the record goes.
        await eventually(lambda: view.get(K.GIT_DEPLOY, deployment.meta.id) is not None, 5)
        await rig.loop.run_pass()
        await rig.end_deployments(ENV_ID)
        await rig.loop.run_pass()
        states = [c.body.get("state") for c in rig.status.calls]
        assert states == ["pending", "success"], rig.status.calls
        call = rig.status.calls[-1]
        where = f"/projects/{P.GITLAB_PROJECT}" if provider == "gitlab" else f"/repos/{P.OWNER_REPO}"
        assert call.path == f"{where}/statuses/{sha}"
        assert call.body["target_url"] == f"{CONSOLE_URL}/env/{ENV_ID}"
        auth = {"github": ("Authorization", f"Bearer {TOKEN}"), "gitea": ("Authorization", f"token {TOKEN}")}
        name, value = auth.get(provider, ("PRIVATE-TOKEN", TOKEN))
        assert call.headers[name] == value
        assert view.get(K.GIT_DEPLOY, deployment.meta.id) is None
        assert any(e.kind == "git.deploy" and e.fields["sha"] == sha for e in rig.events)

        # A push to another branch deploys nothing; a removed hook answers 404.
        feature = rig.repo.commit({"app.py": "print('f')\n"}, "Feature", branch="feature")
        event, payload = P.push(provider, rig.clone_url, feature, branch="feature")
        assert (await rig.post(provider, hook_id, P.signed(provider, secret, event, payload)))[0] == 202
        await eventually(lambda: rig.loop.handled == handled + 1, 10)
        assert len(rig.builds(ENV_ID)) == 1
        await remove_hook(rig.ctx, RemoveHook(hook_id))
        event, payload = P.push(provider, rig.clone_url, sha)
        assert (await rig.post(provider, hook_id, P.signed(provider, secret, event, payload)))[0] == 404
        _no_leak(rig, caplog, TOKEN, secret, DB_URL, API_KEY)


async def test_a_second_push_supersedes_the_deploy_under_way(conn: Connection, view: StateView, tmp_path: Path) -> None:
    async with rig_for("github", conn, view, tmp_path) as rig:
        added = await add_hook(
            rig.ctx, AddHook(env=ENV_ID, provider="github", repo_url=rig.clone_url, token=TOKEN, api_url=rig.status.url)
        )
        first = rig.repo.commit({"app.py": "1"}, "one")
        event, payload = P.push("github", rig.clone_url, first)
        assert (await rig.post("github", added.hook.id, P.signed("github", added.secret, event, payload)))[0] == 202
        await eventually(lambda: len(rig.builds(ENV_ID)) == 1, 15)
        second = rig.repo.commit({"app.py": "2"}, "two")
        event, payload = P.push("github", rig.clone_url, second)
        assert (await rig.post("github", added.hook.id, P.signed("github", added.secret, event, payload)))[0] == 202

        # The orchestrator ends the canceled deployment (none runs here: the test does what it would).
        def canceled() -> bool:
            return any(d.error and d.phase != pb.DEPLOYMENT_PHASE_FAILED for d in view.deployments(ENV_ID))

        await eventually(canceled, 10, "the first deployment asked to cancel")
        await rig.end_deployments(ENV_ID, pb.DEPLOYMENT_PHASE_FAILED)
        await eventually(lambda: any(b.git_sha == second for b in rig.builds(ENV_ID)), 15, "the second deployed")
        await eventually(lambda: len(list(view.all(K.GIT_DEPLOY))) == 2, 5)
        await rig.loop.run_pass()
        posted = {(c.path.rsplit("/", 1)[1], c.body["state"]) for c in rig.status.calls}
        assert posted == {(first, "failure"), (second, "pending")}, rig.status.calls
        failed = next(c for c in rig.status.calls if c.body["state"] == "failure")
        assert failed.body["description"], "the deployment's error says why"
        assert len(list(view.all(K.GIT_DEPLOY))) == 1, "the first one's final state is posted: its record goes"


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_pull_requests_get_label_gated_scale_to_zero_previews_that_follow_pushes_and_go_when_closed_or_expired(
    provider: str, conn: Connection, view: StateView, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    async with rig_for(provider, conn, view, tmp_path) as rig:
        added = await add_hook(
            rig.ctx,
            AddHook(
                env="shop/web/production",
                provider=provider,
                repo_url=rig.clone_url,
                token=TOKEN,
                previews=True,
                preview_label="preview",
                preview_ttl=3600,
                shared_secrets=["DB_URL"],
                api_url=rig.status.url,
            ),
        )
        hook_id, secret = added.hook.id, added.secret

        async def send(sha: str, number: int, action: str, labels: tuple[str, ...] = ("preview",)) -> None:
            before = rig.loop.handled
            event, payload = P.pull_request(provider, rig.clone_url, sha, number, action, labels=labels)
            status, elapsed = await rig.post(provider, hook_id, P.signed(provider, secret, event, payload))
            assert status == 202 and elapsed < 1.0
            await eventually(lambda: rig.loop.handled > before, 15, f"{action} handled")

        def preview(name: str) -> pb.Environment | None:
            return next((e for e in view.envs() if e.name == name), None)

        sha1 = rig.repo.commit({"app.py": "print('pr')\n"}, "PR work", branch="feature")
        await send(sha1, 7, "opened", labels=())
        assert preview("pr-7") is None, "no preview without the label"
        await send(sha1, 7, "labeled")
        env = preview("pr-7")
        assert env is not None and env.type == pb.ENVIRONMENT_TYPE_PREVIEW and env.preview_pr_number == 7
        assert env.service.scale_to_zero and env.service.replicas.min == 0 and env.service.replicas.max == 4
        assert dict(env.service.vars) == {"GREETING": "hello"}, "its own copy of the config"
        assert list(env.service.secrets) == ["DB_URL"], "only the shared secret"
        (copied,) = view.secrets(env.meta.id)
        assert copied.name == "DB_URL" and copied.meta.id == env.service.secrets["DB_URL"].secret_id
        assert [d.hostname for d in view.domains(env.meta.id)] == [f"pr-7.web.{DOMAIN}"]
        assert from_timestamp(env.preview_expires_at) == rig.clock.now() + 3600
        (build,) = rig.builds(env.meta.id)
        assert build.git_sha == sha1
        assert await _source_file(conn, build.tarball_digest, "app.py") == "print('pr')\n"
        assert any(e.kind == "preview.created" and e.fields["hostname"] == f"pr-7.web.{DOMAIN}" for e in rig.events)
        base = view.env(ENV_ID)
        assert base is not None and sorted(base.service.secrets) == ["API_KEY", "DB_URL"], "the base is untouched"

        # A push to the PR deploys its new head there, and pushes the expiry back.
        await rig.end_deployments(env.meta.id)
        await rig.clock.advance(600)
        sha2 = rig.repo.commit({"app.py": "print('pr2')\n"}, "More PR work", branch="feature")
        await send(sha2, 7, "synchronize")
        assert [b.git_sha for b in sorted(rig.builds(env.meta.id), key=lambda b: b.meta.id)] == [sha1, sha2]
        refreshed = preview("pr-7")
        assert refreshed is not None and from_timestamp(refreshed.preview_expires_at) == rig.clock.now() + 3600

        # Closed: the env, its domain (its certificate follows) and its secret copy go.
        await send(sha2, 7, "closed")
        assert preview("pr-7") is None
        assert not [d for d in view.domains() if d.hostname.startswith("pr-7.")]
        assert view.get(K.SECRET, copied.meta.id) is None
        assert view.get(K.SECRET, "01SECDBURL") is not None, "the base's secret stays"

        # Another PR, never closed: the TTL sweep deletes it once its last push is an hour old.
        await send(sha2, 8, "opened")
        assert preview("pr-8") is not None
        await rig.clock.advance(3599)
        await rig.loop.run_pass()
        assert preview("pr-8") is not None
        await rig.clock.advance(2)
        await rig.loop.run_pass()
        assert preview("pr-8") is None
        assert any(e.kind == "preview.deleted" and e.fields["reason"] == "expired" for e in rig.events)
        _no_leak(rig, caplog, TOKEN, secret, DB_URL, API_KEY)


async def test_hook_add_refuses_bad_input_naming_the_option(conn: Connection, view: StateView) -> None:
    ctx, _ = await seed(conn, view)
    cases = [
        (AddHook(env=ENV_ID, provider="bitbucket", repo_url="https://x/y.git"), "--provider"),
        (AddHook(env=ENV_ID, provider="github", repo_url="https://u:p@x/y.git"), "--repo"),
        (AddHook(env=ENV_ID, provider="github", repo_url="ftp://x/y.git"), "--repo"),
        (AddHook(env=ENV_ID, provider="github", repo_url="https://x/y.git", branch="a..b"), "--branch"),
        (AddHook(env=ENV_ID, provider="github", repo_url="https://x/y.git", preview_label="p"), "--previews"),
        (AddHook(env=ENV_ID, provider="github", repo_url="https://x/y.git", api_url="nope"), "--api-url"),
        (
            AddHook(env=ENV_ID, provider="github", repo_url="https://x/y.git", previews=True, shared_secrets=["NOPE"]),
            "--share-secret",
        ),
    ]
    for request, option in cases:
        with pytest.raises(Invalid) as refused:
            await add_hook(ctx, request)
        assert option in str(refused.value), (option, str(refused.value))
    assert view.all(K.GIT_HOOK) == [] or not list(view.all(K.GIT_HOOK))


def test_commit_states_follow_the_deployment() -> None:
    assert commit_state(None) == "failure"
    assert commit_state(pb.Deployment(phase=pb.DEPLOYMENT_PHASE_BUILDING)) == "pending"
    assert commit_state(pb.Deployment(phase=pb.DEPLOYMENT_PHASE_SUCCEEDED)) == "success"
    assert commit_state(pb.Deployment(phase=pb.DEPLOYMENT_PHASE_FAILED)) == "failure"
