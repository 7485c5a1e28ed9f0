"""Webhook deliveries as each provider documents them (the fields Zattera reads, and enough of the rest to
look like the real thing): GitHub (docs.github.com "Webhook events and payloads": push, pull_request),
GitLab ("Webhook events": Push Hook, Merge Request Hook), Gitea (push, pull_request), with their headers."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from shared import githooks as G

OWNER_REPO = "octo/app"
GITLAB_PROJECT = 15


@dataclass(frozen=True)
class Delivery:
    headers: dict[str, str]
    body: bytes


def _repo(clone_url: str) -> dict[str, object]:
    return {"id": 1296269, "name": "app", "full_name": OWNER_REPO, "clone_url": clone_url, "default_branch": "main"}


def push(
    provider: str, clone_url: str, sha: str, *, branch: str = "main", message: str = "Add a page"
) -> tuple[str, dict[str, object]]:
    author = {"name": "Ada Lovelace", "email": "ada@example.com", "username": "ada"}
    commit = {"id": sha, "message": message + "\n\nlonger text", "timestamp": "2026-12-02T10:00:00Z", "author": author}
    if provider == "gitlab":
        return "Push Hook", {
            "object_kind": "push",
            "event_name": "push",
            "before": "0" * 40,
            "after": sha,
            "ref": f"refs/heads/{branch}",
            "checkout_sha": sha,
            "user_name": "Ada Lovelace",
            "user_username": "ada",
            "project_id": GITLAB_PROJECT,
            "project": {
                "id": GITLAB_PROJECT,
                "name": "app",
                "path_with_namespace": OWNER_REPO,
                "git_http_url": clone_url,
            },
            "commits": [{**commit, "title": message}],
            "total_commits_count": 1,
        }
    return "push", {
        "ref": f"refs/heads/{branch}",
        "before": "0" * 40,
        "after": sha,
        "created": False,
        "deleted": False,
        "forced": False,
        "commits": [commit],
        "head_commit": commit,
        "repository": _repo(clone_url),
        "pusher": {"name": "ada", "email": "ada@example.com"},
        "sender": {"login": "ada"},
    }


def pull_request(
    provider: str,
    clone_url: str,
    sha: str,
    number: int,
    action: str,
    *,
    labels: tuple[str, ...] = (),
    base: str = "main",
    head: str = "feature",
) -> tuple[str, dict[str, object]]:
    """``action`` as GitHub spells it (opened, synchronize, labeled, closed, reopened), translated."""
    if provider == "gitlab":
        gl_action = {
            "opened": "open",
            "synchronize": "update",
            "labeled": "update",
            "closed": "close",
            "reopened": "reopen",
        }[action]
        attributes: dict[str, object] = {
            "iid": number,
            "title": "A feature",
            "state": "closed" if action == "closed" else "opened",
            "action": gl_action,
            "source_branch": head,
            "target_branch": base,
            "last_commit": {"id": sha, "message": "feature work", "author": {"name": "Ada Lovelace"}},
        }
        if action == "synchronize":
            attributes["oldrev"] = "1" * 40
        return "Merge Request Hook", {
            "object_kind": "merge_request",
            "event_type": "merge_request",
            "user": {"username": "ada"},
            "project": {"id": GITLAB_PROJECT, "path_with_namespace": OWNER_REPO, "git_http_url": clone_url},
            "object_attributes": attributes,
            "labels": [{"id": 206, "title": name} for name in labels],
        }
    gitea = provider == "gitea"
    event = "pull_request"
    if gitea:
        action = {"synchronize": "synchronized", "labeled": "label_updated"}.get(action, action)
        event = {"synchronized": "pull_request_sync", "label_updated": "pull_request_label"}.get(action, event)
    return event, {
        "action": action,
        "number": number,
        "pull_request": {
            "number": number,
            "state": "closed" if action == "closed" else "open",
            "title": "A feature",
            "user": {"login": "ada"},
            "labels": [{"name": name} for name in labels],
            "head": {"ref": head, "sha": sha},
            "base": {"ref": base, "sha": "2" * 40},
            "merged": False,
        },
        "repository": _repo(clone_url),
        "sender": {"login": "ada"},
    }


def signed(provider: str, secret: str, event: str, payload: dict[str, object], *, delivery: str = "") -> Delivery:
    body = json.dumps(payload).encode()
    names = G.HEADERS[provider]
    name, value = G.signature_header(provider, secret, body)
    headers = {
        "Content-Type": "application/json",
        names.event: event,
        names.delivery: delivery or str(uuid.uuid4()),
        name: value,
    }
    return Delivery(headers, body)
