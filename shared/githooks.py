"""Webhooks from git hosts (docs/git.md, "Webhooks and previews"): pure rules, no I/O.

* **Verification** (:func:`verify`): GitHub signs the body with HMAC-SHA256 (``X-Hub-Signature-256:
  sha256=<hex>``), Gitea likewise (``X-Gitea-Signature: <hex>``), GitLab sends the secret itself
  (``X-Gitlab-Token``). Compared in constant time. Each delivery carries an id (``X-GitHub-Delivery``,
  ``X-Gitea-Delivery``, ``X-Gitlab-Event-UUID``): a delivery seen before is a replay.
* **Payloads** (:func:`parse`): a push or a pull (merge) request event as one :class:`Event`.
* **Commit statuses** (:func:`status_request`): the provider's API call reporting a deploy's state.
* **Previews**: env name ``pr-<n>``, hostname ``pr-<n>.<app>.<domain>``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from shared.errors import ZatteraError

PROVIDERS = ("github", "gitlab", "gitea")

MAX_BODY = 900 * 1024
"""A delivery larger than this is refused (413): it must fit in one NATS message (1 MiB by default) with its
headers; what Zattera reads of a push or pull request payload is near its start."""

PREVIEW_PREFIX = "pr-"

STATES = ("pending", "success", "failure")


class DeliveryRefused(ZatteraError, ValueError):
    """A delivery that is not verified, not understood or not for this hook; ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HeaderNames:
    event: str
    delivery: str
    signature: str


HEADERS = {
    "github": HeaderNames("X-GitHub-Event", "X-GitHub-Delivery", "X-Hub-Signature-256"),
    "gitea": HeaderNames("X-Gitea-Event", "X-Gitea-Delivery", "X-Gitea-Signature"),
    "gitlab": HeaderNames("X-Gitlab-Event", "X-Gitlab-Event-UUID", "X-Gitlab-Token"),
}
"""Per provider: which header names the event, the delivery id and carries the signature (or token)."""


def provider_problem(provider: str) -> str:
    return "" if provider in PROVIDERS else f"{provider!r} is not one of {', '.join(PROVIDERS)}"


def repo_url_problem(url: str) -> str:
    """Why ``url`` cannot be a repository's clone URL ("" when it can). Credentials go in --token-file."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "git", "ssh", "file"):
        return f"{url!r} is not an http(s), git, ssh or file URL"
    if parts.username or parts.password:
        return "holds credentials: give the URL without them and the token with --token-file"
    if parts.scheme != "file" and not parts.hostname:
        return f"{url!r} names no host"
    return ""


def sign(secret: str, body: bytes) -> str:
    """HMAC-SHA256 of ``body`` under ``secret``, hex (what GitHub and Gitea send, GitHub with ``sha256=``)."""
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_header(provider: str, secret: str, body: bytes) -> tuple[str, str]:
    """The header a genuine delivery of ``body`` carries (for tests, benchmarks and documentation)."""
    name = HEADERS[provider].signature
    if provider == "github":
        return name, "sha256=" + sign(secret, body)
    if provider == "gitea":
        return name, sign(secret, body)
    return name, secret


def delivery_id(provider: str, headers: dict[str, str]) -> str:
    """The delivery's id; :class:`DeliveryRefused` (400) when it carries none (it could not be de-duplicated)."""
    names = HEADERS[provider]
    found = headers.get(names.delivery, "")
    if provider == "gitlab" and not found:
        found = headers.get("X-Gitlab-Webhook-UUID", "")
    if not found or len(found) > 128 or not re.fullmatch(r"[A-Za-z0-9._:-]+", found):
        raise DeliveryRefused(400, f"refused: no usable {names.delivery} header (each delivery needs its id)")
    return found


def verify(provider: str, secret: str, headers: dict[str, str], body: bytes) -> None:
    """:class:`DeliveryRefused` (401) unless the delivery is signed (GitHub, Gitea) or carries the token
    (GitLab) of ``secret``."""
    name = HEADERS[provider].signature
    given = headers.get(name, "")
    if not given:
        raise DeliveryRefused(401, f"refused: unsigned delivery (no {name} header)")
    if provider == "gitlab":
        ok = hmac.compare_digest(given.encode(), secret.encode())
    else:
        expected = sign(secret, body)
        if provider == "github":
            if not given.startswith("sha256="):
                raise DeliveryRefused(401, f"refused: {name} is not sha256=<hex>")
            given = given.removeprefix("sha256=")
        ok = hmac.compare_digest(given.lower().encode(), expected.encode())
    if not ok:
        raise DeliveryRefused(401, f"refused: {name} does not match the hook's secret")


@dataclass(frozen=True)
class Event:
    """A push or a pull request event, as the webhook loop acts on it."""

    kind: str
    """``push``, ``pull_request`` or ``ping`` (nothing to do)."""
    action: str = ""
    """For pull requests: ``opened``, ``synchronize``, ``closed``, ``reopened``, ``labeled`` (normalised)."""
    branch: str = ""
    """A push's branch; a pull request's base branch."""
    sha: str = ""
    """The commit to deploy (a push's new head; a pull request's head)."""
    head_ref: str = ""
    """Where the commit can be fetched from: ``refs/heads/<b>``, ``refs/pull/<n>/head``, …"""
    number: int = 0
    labels: tuple[str, ...] = ()
    repo: str = ""
    """``owner/name`` (GitHub, Gitea) or the GitLab project id: where commit statuses go."""
    author: str = ""
    message: str = ""
    deleted: bool = False
    """A push deleting the branch (nothing to deploy)."""
    extra: dict[str, str] = field(default_factory=dict)


_PR_ACTIONS = {
    # GitHub and Gitea
    "opened": "opened",
    "reopened": "reopened",
    "synchronize": "synchronize",
    "synchronized": "synchronize",
    "closed": "closed",
    "labeled": "labeled",
    "label_updated": "labeled",
    "edited": "edited",
    # GitLab
    "open": "opened",
    "reopen": "reopened",
    "update": "synchronize",
    "close": "closed",
    "merge": "closed",
}


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DeliveryRefused(400, f"refused: the payload's {what} is not an object")
    return value


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""


@dataclass(frozen=True)
class _PullRequestTerms:
    """How a provider's pull request payload names what the event needs."""

    head_ref: str
    """The ref its head is fetched from, ``{}`` standing for its number."""
    label: str
    """The key of a label's name."""
    login: str
    """The key of the author's name in its user object."""


_GITHUB_PR = _PullRequestTerms("refs/pull/{}/head", label="name", login="login")
"""GitHub's and Gitea's."""
_GITLAB_MR = _PullRequestTerms("refs/merge-requests/{}/head", label="title", login="username")


def _pull_request(
    terms: _PullRequestTerms,
    repo: str,
    number: int,
    action: str,
    branch: Any,
    sha: Any,
    title: Any,
    holder: dict[str, Any],
) -> Event:
    """A pull request's event (a GitLab merge request's) from the provider's fields (``action`` normalised);
    ``holder`` is the object with its ``labels`` and ``user`` (GitHub's pull request, GitLab's payload)."""
    user = holder.get("user") or {}
    return Event(
        "pull_request",
        action=action,
        branch=_str(branch),
        sha=_str(sha),
        head_ref=terms.head_ref.format(number),
        number=number,
        labels=tuple(_str(x.get(terms.label)) for x in holder.get("labels") or [] if isinstance(x, dict)),
        repo=repo,
        author=_str(user.get(terms.login)) if isinstance(user, dict) else "",
        message=_first_line(_str(title)),
    )


def parse(provider: str, event_name: str, body: bytes) -> Event:
    """The event a verified delivery carries; :class:`DeliveryRefused` (400) for a payload that is not JSON or
    lacks what its event needs. Events other than push and pull request parse as ``ping`` (acknowledged)."""
    try:
        payload = _obj(json.loads(body), "body")
    except ValueError:
        raise DeliveryRefused(400, "refused: the payload is not JSON") from None
    if provider == "gitlab":
        return _parse_gitlab(event_name, payload)
    return _parse_github_like(provider, event_name, payload)


def _parse_github_like(provider: str, event_name: str, payload: dict[str, Any]) -> Event:
    repo = _str(_obj(payload.get("repository", {}), "repository").get("full_name"))
    if event_name == "push":
        ref = _str(payload.get("ref"))
        if not ref.startswith("refs/heads/"):
            return Event("ping", repo=repo)  # a tag push: nothing mapped
        head = payload.get("head_commit") or {}
        head = head if isinstance(head, dict) else {}
        author = head.get("author") or {}
        return Event(
            "push",
            branch=ref.removeprefix("refs/heads/"),
            sha=_str(payload.get("after")),
            head_ref=ref,
            repo=repo,
            author=_str(author.get("name")) if isinstance(author, dict) else "",
            message=_first_line(_str(head.get("message"))),
            deleted=bool(payload.get("deleted")) or set(_str(payload.get("after"))) == {"0"},
        )
    if event_name.startswith("pull_request"):  # Gitea: pull_request_sync, pull_request_label too
        pr = _obj(payload.get("pull_request"), "pull_request")
        number = payload.get("number") or pr.get("number")
        if not isinstance(number, int) or number <= 0:
            raise DeliveryRefused(400, "refused: the pull request has no number")
        head = _obj(pr.get("head", {}), "pull_request.head")
        base = _obj(pr.get("base", {}), "pull_request.base")
        action = _PR_ACTIONS.get(_str(payload.get("action")), _str(payload.get("action")))
        return _pull_request(_GITHUB_PR, repo, number, action, base.get("ref"), head.get("sha"), pr.get("title"), pr)
    return Event("ping", repo=repo)


def _parse_gitlab(event_name: str, payload: dict[str, Any]) -> Event:
    kind = _str(payload.get("object_kind"))
    project = _obj(payload.get("project", {}), "project")
    repo = str(payload.get("project_id") or project.get("id") or "")
    if kind == "push" or event_name == "Push Hook":
        ref = _str(payload.get("ref"))
        if not ref.startswith("refs/heads/"):
            return Event("ping", repo=repo)
        sha = _str(payload.get("checkout_sha")) or _str(payload.get("after"))
        commits = [c for c in payload.get("commits") or [] if isinstance(c, dict)]
        head = next((c for c in commits if c.get("id") == sha), commits[-1] if commits else {})
        author = head.get("author") or {}
        return Event(
            "push",
            branch=ref.removeprefix("refs/heads/"),
            sha=sha,
            head_ref=ref,
            repo=repo,
            author=_str(author.get("name")) if isinstance(author, dict) else _str(payload.get("user_name")),
            message=_first_line(_str(head.get("message"))),
            deleted=not sha or set(sha) == {"0"},
        )
    if kind == "merge_request" or event_name == "Merge Request Hook":
        attrs = _obj(payload.get("object_attributes"), "object_attributes")
        number = attrs.get("iid")
        if not isinstance(number, int) or number <= 0:
            raise DeliveryRefused(400, "refused: the merge request has no iid")
        last = attrs.get("last_commit") or {}
        last = last if isinstance(last, dict) else {}
        action = _PR_ACTIONS.get(_str(attrs.get("action")), _str(attrs.get("action")))
        if action == "synchronize" and not attrs.get("oldrev"):
            action = "labeled"  # an update that pushed nothing (a label, the title): re-check the gate only
        return _pull_request(
            _GITLAB_MR, repo, number, action, attrs.get("target_branch"), last.get("id"), attrs.get("title"), payload
        )
    return Event("ping", repo=repo)


def preview_env_name(number: int) -> str:
    return f"{PREVIEW_PREFIX}{number}"


def preview_hostname(number: int, app_name: str, domain: str) -> str:
    """``pr-<n>.<app>.<domain>`` (docs/git.md)."""
    return f"{preview_env_name(number)}.{app_name}.{domain}"


def wants_preview(previews: bool, label: str, event: Event) -> bool:
    """Whether a pull request event should have a preview (previews on, the label gate passed)."""
    return previews and (not label or label in event.labels)


def default_api_url(provider: str, repo_url: str) -> str:
    """The provider's API base derived from the clone URL: api.github.com for github.com, else
    ``<scheme>://<host>/api/v3`` (GitHub Enterprise), ``/api/v4`` (GitLab), ``/api/v1`` (Gitea)."""
    parts = urlsplit(repo_url)
    scheme = parts.scheme if parts.scheme in ("http", "https") else "https"
    host = parts.netloc
    if provider == "github":
        if host in ("github.com", "www.github.com"):
            return "https://api.github.com"
        return urlunsplit((scheme, host, "/api/v3", "", ""))
    if provider == "gitlab":
        return urlunsplit((scheme, host, "/api/v4", "", ""))
    return urlunsplit((scheme, host, "/api/v1", "", ""))


@dataclass(frozen=True)
class StatusRequest:
    url: str
    headers: dict[str, str] = field(repr=False)
    body: dict[str, str]


CONTEXT = "zattera"


def status_request(
    provider: str, api_url: str, repo: str, sha: str, state: str, token: str, target_url: str, description: str
) -> StatusRequest:
    """The commit-status call: GitHub ``POST /repos/{o}/{r}/statuses/{sha}``, GitLab ``POST
    /projects/{id}/statuses/{sha}``, Gitea ``POST /repos/{o}/{r}/statuses/{sha}``. ``state`` is one of
    :data:`STATES` (GitLab says ``failed``)."""
    base = api_url.rstrip("/")
    body = {"state": state, "description": description[:140], "context": CONTEXT}
    if target_url:
        body["target_url"] = target_url
    if provider == "gitlab":
        body["state"] = {"failure": "failed"}.get(state, state)
        body["name"] = body.pop("context")
        return StatusRequest(f"{base}/projects/{quote(repo, safe='')}/statuses/{sha}", {"PRIVATE-TOKEN": token}, body)
    auth = f"Bearer {token}" if provider == "github" else f"token {token}"
    headers = {"Authorization": auth, "Accept": "application/json"}
    return StatusRequest(f"{base}/repos/{repo}/statuses/{sha}", headers, body)


def fetch_auth_header(provider: str, token: str) -> str:
    """The ``Authorization`` header git sends when fetching with ``token`` (HTTP basic, the user each host
    expects with a token)."""
    import base64

    user = {"github": "x-access-token", "gitlab": "oauth2", "gitea": "git"}[provider]
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()
