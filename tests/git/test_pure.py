"""Pure pieces of the git deploys, as tables: which env a push deploys (or why it is refused), the branch
map's edit, the zattera.toml keys, the remote URL and the CGI head the console parses."""

from __future__ import annotations

import pytest
from zattera.v1 import types_pb2 as pb

from cli.git_cmds import remote_url
from cli.spec import SpecError, validate
from services.console.git import _parse_head
from shared.actions.gitmap import decide_updates, mapped, mapped_branches
from tests.memory_state import MemoryState

SHA = "a" * 40
ZERO = "0" * 40


def view(branches: dict[str, str]) -> MemoryState:
    project = pb.Project(name="demo")
    project.meta.id = "p1"
    app = pb.App(project_id="p1", name="hello")
    app.meta.id = "a1"
    state = MemoryState(project, app)
    for i, (name, branch) in enumerate(sorted(branches.items())):
        env = pb.Environment(project_id="p1", app_id="a1", name=name, git_branch=branch)
        env.meta.id = f"e{i}"
        state.put(env)
    return state


@pytest.mark.parametrize(
    ("branches", "updates", "deploys", "refusal"),
    [
        ({"production": "main"}, [(ZERO, SHA, "refs/heads/main")], [(SHA, "refs/heads/main", "production")], ""),
        (
            {"production": "main", "staging": "main"},
            [(ZERO, SHA, "refs/heads/main")],
            [(SHA, "refs/heads/main", "production"), (SHA, "refs/heads/main", "staging")],
            "",
        ),
        (
            {"production": "main", "staging": "dev"},
            [(ZERO, SHA, "refs/heads/feature")],
            [],
            "branch 'feature' deploys to no env of demo/hello; mapped branches: dev → staging, main → production",
        ),
        ({"production": ""}, [(ZERO, SHA, "refs/heads/main")], [], "mapped branches: none"),
        ({"production": "main"}, [(SHA, ZERO, "refs/heads/main")], [], "deleting refs/heads/main is not allowed"),
        ({"production": "main"}, [(ZERO, SHA, "refs/tags/v1")], [], "refs/tags/v1 is not a branch"),
    ],
)
def test_decide_updates(
    branches: dict[str, str], updates: list[tuple[str, ...]], deploys: list[tuple[str, str, str]], refusal: str
) -> None:
    decided = decide_updates(view(branches).store, "demo", "hello", updates)
    assert decided.deploys == deploys
    assert (refusal in decided.refusal) if refusal else decided.refusal == ""


def test_mapped_branches_of_an_unknown_app_is_empty() -> None:
    assert mapped_branches(view({"production": "main"}).store, "demo", "other") == {}


@pytest.mark.parametrize(
    ("before", "branch", "changed"), [("", "main", True), ("main", "main", False), ("main", "", True)]
)
def test_mapped(before: str, branch: str, changed: bool) -> None:
    env = pb.Environment(git_branch=before)
    updated = mapped(env, branch, 1_700_000_000.0)
    assert (updated is not None) is changed
    if updated is not None:
        assert updated.git_branch == branch and updated.meta.updated_at.seconds == 1_700_000_000


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("release_command", "python manage.py migrate", ""),
        ("release_command", "   ", "env.production.release_command: must not be empty"),
        ("release_command", "x" * 5000, "env.production.release_command: is 5000 bytes"),
        ("git_branch", "main", ""),
        ("git_branch", "feat/x", ""),
        ("git_branch", "a..b", "env.production.git_branch: 'a..b' is not a valid git branch name"),
        ("git_branch", "-x", "is not a valid git branch name"),
    ],
)
def test_toml_keys(key: str, value: str, error: str) -> None:
    raw: dict[str, object] = {"project": "demo", "app": "hello", "env": {"production": {key: value}}}
    if not error:
        spec = validate(raw)
        assert getattr(spec.env["production"], key) == value
        return
    with pytest.raises(SpecError, match=error.replace(".", r"\.").replace("(", r"\(")):
        validate(raw)


@pytest.mark.parametrize(
    ("console", "user", "expected"),
    [
        ("http://127.0.0.1:8090", "", "http://127.0.0.1:8090/git/demo/hello.git"),
        ("https://console.example.com/", "ci", "https://ci@console.example.com/git/demo/hello.git"),
        ("http://[::1]:8090", "a@b", "http://a%40b@[::1]:8090/git/demo/hello.git"),
    ],
)
def test_remote_url(console: str, user: str, expected: str) -> None:
    assert remote_url(console, "demo", "hello", user) == expected


@pytest.mark.parametrize(
    ("head", "status", "headers"),
    [
        (
            b"Content-Type: application/x-git-receive-pack-result",
            200,
            {"Content-Type": "application/x-git-receive-pack-result"},
        ),
        (b"Status: 404 Not Found\r\nExpires: Fri, 01 Jan 1980", 404, {"Expires": "Fri, 01 Jan 1980"}),
    ],
)
def test_cgi_head(head: bytes, status: int, headers: dict[str, str]) -> None:
    assert _parse_head(head) == (status, headers)
