"""The pure webhook rules (shared/githooks.py): each provider's verification, payloads as events, commit
status calls, preview names — tables, no I/O."""

from __future__ import annotations

import json

import pytest

from shared import githooks as G
from tests.githooks import payloads as P

SHA = "a" * 40
URL = "https://git.example.com/octo/app.git"


@pytest.mark.parametrize("provider", G.PROVIDERS)
def test_a_genuine_delivery_verifies_and_a_forged_or_unsigned_one_is_refused(provider: str) -> None:
    event, payload = P.push(provider, URL, SHA)
    d = P.signed(provider, "s3cret", event, payload)
    G.verify(provider, "s3cret", d.headers, d.body)
    assert G.delivery_id(provider, d.headers) == d.headers[G.HEADERS[provider].delivery]
    with pytest.raises(G.DeliveryRefused) as wrong:
        G.verify(provider, "other", d.headers, d.body)
    assert wrong.value.status == 401
    name = G.HEADERS[provider].signature
    with pytest.raises(G.DeliveryRefused) as unsigned:
        G.verify(provider, "s3cret", {k: v for k, v in d.headers.items() if k != name}, d.body)
    assert unsigned.value.status == 401 and "unsigned" in unsigned.value.message
    with pytest.raises(G.DeliveryRefused) as no_id:
        G.delivery_id(provider, {})
    assert no_id.value.status == 400


def test_github_wants_the_sha256_prefix() -> None:
    body = b"{}"
    with pytest.raises(G.DeliveryRefused):
        G.verify("github", "s", {"X-Hub-Signature-256": G.sign("s", body)}, body)


@pytest.mark.parametrize("provider", G.PROVIDERS)
def test_pushes_parse_to_branch_and_commit(provider: str) -> None:
    event, payload = P.push(provider, URL, SHA, branch="main", message="Add a page")
    e = G.parse(provider, event, json.dumps(payload).encode())
    assert (e.kind, e.branch, e.sha, e.head_ref, e.author, e.message) == (
        "push", "main", SHA, "refs/heads/main", "Ada Lovelace", "Add a page"
    )  # fmt: skip
    assert e.repo == (str(P.GITLAB_PROJECT) if provider == "gitlab" else P.OWNER_REPO) and not e.deleted
    tag = {**payload, "ref": "refs/tags/v1"}
    assert G.parse(provider, event, json.dumps(tag).encode()).kind == "ping"
    deleted = {**payload, "after": "0" * 40, "checkout_sha": None, "deleted": True}
    assert G.parse(provider, event, json.dumps(deleted).encode()).deleted


@pytest.mark.parametrize("provider", G.PROVIDERS)
@pytest.mark.parametrize("action", ["opened", "synchronize", "labeled", "closed", "reopened"])
def test_pull_requests_parse_to_a_normalised_action(provider: str, action: str) -> None:
    event, payload = P.pull_request(provider, URL, SHA, 7, action, labels=("preview",))
    e = G.parse(provider, event, json.dumps(payload).encode())
    assert (e.kind, e.action, e.number, e.branch, e.sha, e.labels) == (
        "pull_request",
        action,
        7,
        "main",
        SHA,
        ("preview",),
    )
    ref = "refs/merge-requests/7/head" if provider == "gitlab" else "refs/pull/7/head"
    assert e.head_ref == ref


@pytest.mark.parametrize(
    ("provider", "event", "body", "status"),
    [
        ("github", "push", b"not json", 400),
        ("github", "pull_request", b'{"action": "opened", "pull_request": {"head": {}}}', 400),
        ("gitlab", "Merge Request Hook", b'{"object_kind": "merge_request", "object_attributes": {}}', 400),
    ],
)
def test_malformed_payloads_are_refused(provider: str, event: str, body: bytes, status: int) -> None:
    with pytest.raises(G.DeliveryRefused) as refused:
        G.parse(provider, event, body)
    assert refused.value.status == status


def test_other_events_are_acknowledged_and_ignored() -> None:
    assert G.parse("github", "ping", b'{"zen": "Design for failure."}').kind == "ping"
    assert G.parse("gitlab", "Issue Hook", b'{"object_kind": "issue"}').kind == "ping"


@pytest.mark.parametrize(
    ("provider", "api", "repo", "path", "auth", "state"),
    [
        (
            "github",
            "https://api.github.com",
            "octo/app",
            "/repos/octo/app/statuses/",
            ("Authorization", "Bearer tok-9z"),
            "failure",
        ),
        (
            "gitea",
            "https://gitea.example/api/v1",
            "octo/app",
            "/repos/octo/app/statuses/",
            ("Authorization", "token tok-9z"),
            "failure",
        ),
        (
            "gitlab",
            "https://gitlab.example/api/v4",
            "15",
            "/projects/15/statuses/",
            ("PRIVATE-TOKEN", "tok-9z"),
            "failed",
        ),
    ],
)
def test_commit_status_calls_follow_each_providers_api(
    provider: str, api: str, repo: str, path: str, auth: tuple[str, str], state: str
) -> None:
    call = G.status_request(provider, api, repo, SHA, "failure", "tok-9z", "https://c/env/E", "boom")
    assert call.url == f"{api}{path}{SHA}"
    assert call.headers[auth[0]] == auth[1]
    assert call.body["state"] == state and call.body["target_url"] == "https://c/env/E"
    assert "tok-9z" not in repr(call), "the token is not in the call's repr (logs)"


def test_default_api_urls_and_preview_names() -> None:
    assert G.default_api_url("github", "https://github.com/o/r.git") == "https://api.github.com"
    assert G.default_api_url("github", "https://ghe.corp/o/r.git") == "https://ghe.corp/api/v3"
    assert G.default_api_url("gitlab", "https://gitlab.com/o/r.git") == "https://gitlab.com/api/v4"
    assert G.default_api_url("gitea", "http://gitea.local:3000/o/r.git") == "http://gitea.local:3000/api/v1"
    assert G.preview_hostname(7, "web", "apps.example.com") == "pr-7.web.apps.example.com"
    event = G.Event("pull_request", labels=("a",))
    assert G.wants_preview(True, "", event) and G.wants_preview(True, "a", event)
    assert not G.wants_preview(True, "b", event) and not G.wants_preview(False, "", event)
