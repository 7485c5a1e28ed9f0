"""Stack detection: one table row per stack, with the plan lines pinned (what the build log and `build plan` print)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app as cli_app
from shared.buildplan import PlanError, detect, poetry_requirements, read_source, requirement_names, starts_python

FLASK_APP = "from flask import Flask\n\napp = Flask(__name__)\n"
FASTAPI_APP = "from fastapi import FastAPI\napi: FastAPI = FastAPI()\n"
PACKAGE = json.dumps({"name": "x", "scripts": {"start": "node server.js", "build": "tsc"}})
POETRY_LOCK = """
[[package]]
name = "flask"
version = "3.1.0"
groups = ["main"]

[[package]]
name = "pytest"
version = "8.0.0"
groups = ["dev"]

[[package]]
name = "click"
version = "8.1.7"
category = "main"
"""

CASES: list[tuple[str, dict[str, str], list[str]]] = [
    (
        "flask requirements + gunicorn",
        {"app.py": FLASK_APP, "requirements.txt": "Flask>=3\ngunicorn==23.0.0  # server\n"},
        [
            "plan: provider python (requirements.txt)",
            "plan: install  uv pip install --target .zattera/python -r requirements.txt",
            "plan: build    (none)",
            "plan: start    gunicorn app:app --bind 0.0.0.0:$PORT  (inferred (Flask))",
        ],
    ),
    (
        "flask without gunicorn, python pinned",
        {"main.py": FLASK_APP, "requirements.txt": "flask\n", ".python-version": "3.12.4\n"},
        [
            "plan: provider python (requirements.txt)",
            "plan: install  uv pip install --target .zattera/python -r requirements.txt",
            "plan: build    (none)",
            "plan: start    flask --app main:app run --host 0.0.0.0 --port $PORT  (inferred (Flask))",
            "plan: python   3.12",
        ],
    ),
    (
        "fastapi pyproject",
        {
            "pyproject.toml": '[project]\nname="a"\nversion="1"\nrequires-python=">=3.10"\n'
            'dependencies=["fastapi", "uvicorn[standard]>=0.30"]\n',
            "app/main.py": FASTAPI_APP,
        },
        [
            "plan: provider python (pyproject.toml)",
            "plan: install  uv pip install --target .zattera/python -r pyproject.toml",
            "plan: build    (none)",
            "plan: start    uvicorn app.main:api --host 0.0.0.0 --port $PORT  (inferred (FastAPI))",
            "plan: python   >=3.10",
        ],
    ),
    (
        "uv.lock",
        {
            "pyproject.toml": '[project]\nname="a"\nversion="1"\ndependencies=["fastapi"]\n',
            "uv.lock": "",
            "main.py": FASTAPI_APP,
        },
        [
            "plan: provider python (pyproject.toml + uv.lock)",
            "plan: install  uv export --frozen --no-dev --no-emit-project --no-hashes -o .zattera/requirements.txt"
            " && uv pip install --target .zattera/python -r .zattera/requirements.txt",
            "plan: build    (none)",
            "plan: start    uvicorn main:api --host 0.0.0.0 --port $PORT  (inferred (FastAPI))",
        ],
    ),
    (
        "poetry.lock",
        {
            "pyproject.toml": '[tool.poetry.dependencies]\npython="^3.11"\nflask="^3"\n',
            "poetry.lock": POETRY_LOCK,
            "app.py": FLASK_APP,
        },
        [
            "plan: provider python (pyproject.toml + poetry.lock)",
            "plan: install  uv pip install --target .zattera/python --no-deps -r .zattera/requirements.txt",
            "plan: build    (none)",
            "plan: start    flask --app app:app run --host 0.0.0.0 --port $PORT  (inferred (Flask))",
        ],
    ),
    (
        "django",
        {"manage.py": "", "site/wsgi.py": "", "requirements.txt": "django\ngunicorn\n"},
        [
            "plan: provider python (requirements.txt)",
            "plan: install  uv pip install --target .zattera/python -r requirements.txt",
            "plan: build    (none)",
            "plan: start    gunicorn site.wsgi --bind 0.0.0.0:$PORT  (inferred (Django))",
        ],
    ),
    (
        "procfile overrides inference",
        {
            "app.py": FLASK_APP,
            "requirements.txt": "flask\ngunicorn\n",
            "Procfile": "worker: x\nweb: gunicorn -w 2 app:app\n",
        },
        [
            "plan: provider python (requirements.txt)",
            "plan: install  uv pip install --target .zattera/python -r requirements.txt",
            "plan: build    (none)",
            "plan: start    gunicorn -w 2 app:app  (Procfile web:)",
        ],
    ),
    (
        "zattera.toml overrides every step",
        {
            "requirements.txt": "flask\n",
            "Procfile": "web: python app.py\n",
            "zattera.toml": '[build]\ninstall = ""\ncommand = "make assets"\n[run]\ncommand = "python serve.py"\n',
        },
        [
            "plan: provider python (requirements.txt)",
            "plan: install  (none)",
            "plan: build    make assets",
            "plan: start    python serve.py  (zattera.toml [run] command)",
        ],
    ),
    (
        "python with nothing to start",
        {"requirements.txt": "requests\n"},
        [
            "plan: provider python (requirements.txt)",
            "plan: install  uv pip install --target .zattera/python -r requirements.txt",
            "plan: build    (none)",
            "plan: start    (none)",
            "plan: error    no start command for this python app: add a Procfile line `web: <command>` or "
            '`[run] command = "..."` to zattera.toml',
        ],
    ),
    (
        "express with package-lock",
        {"package.json": PACKAGE, "package-lock.json": "{}", "server.js": ""},
        [
            "plan: provider node (package.json + package-lock.json)",
            "plan: install  npm ci",
            "plan: build    npm run build",
            "plan: start    node server.js  (inferred (package.json scripts.start))",
        ],
    ),
    (
        "a prestart script runs first (as npm start would run it)",
        {"package.json": json.dumps({"scripts": {"prestart": "node migrate.js", "start": "node server.js"}})},
        [
            "plan: provider node (package.json)",
            "plan: install  npm install",
            "plan: build    (none)",
            "plan: start    node migrate.js && node server.js  (inferred (package.json scripts.start))",
        ],
    ),
    (
        "yarn, entry file",
        {"package.json": '{"name": "x"}', "yarn.lock": "", "index.js": ""},
        [
            "plan: provider node (package.json + yarn.lock)",
            "plan: install  npx --yes yarn@1 install --frozen-lockfile",
            "plan: build    (none)",
            "plan: start    node index.js  (inferred (Node entry file))",
        ],
    ),
    (
        "pnpm, main field",
        {"package.json": '{"main": "dist/app.js"}', "pnpm-lock.yaml": ""},
        [
            "plan: provider node (package.json + pnpm-lock.yaml)",
            "plan: install  npx --yes pnpm@9 install --frozen-lockfile",
            "plan: build    (none)",
            "plan: start    node dist/app.js  (inferred (Node entry file))",
        ],
    ),
    (
        "static site",
        {"index.html": "<h1>hi</h1>"},
        [
            "plan: provider static (index.html)",
            "plan: install  (none)",
            "plan: build    (none)",
            'plan: start    python3 -m http.server "$PORT" --bind 0.0.0.0  (inferred (static site))',
        ],
    ),
    (
        "procfile only",
        {"Procfile": "web: ./serve\n", "serve": ""},
        [
            "plan: provider procfile (Procfile)",
            "plan: install  (none)",
            "plan: build    (none)",
            "plan: start    ./serve  (Procfile web:)",
        ],
    ),
    (
        "nothing detected: packed as is (the service's command starts it)",
        {"app.py": "print(1)\n"},
        ["plan: provider none", "plan: install  (none)", "plan: build    (none)", "plan: start    (none)"],
    ),
    (
        "a Dockerfile beside a zattera.toml that gives a command is not the recipe",
        {"Dockerfile": "FROM scratch\n", "index.html": "", "zattera.toml": '[run]\ncommand = "./serve"\n'},
        [
            "plan: provider static (index.html)",
            "plan: install  (none)",
            "plan: build    (none)",
            "plan: start    ./serve  (zattera.toml [run] command)",
        ],
    ),
    (
        "dockerfile",
        {"Dockerfile": "FROM scratch\n", "requirements.txt": "flask\n"},
        [
            "plan: provider dockerfile (Dockerfile)",
            "plan: install  (none)",
            "plan: build    (none)",
            "plan: start    (none)",
            "plan: error    a Dockerfile build needs a builder with a Docker daemon (the docker runtime, "
            "docs/containers.md), which this builder does not have: deploy a built image with --image, or remove "
            "the Dockerfile to use stack detection",
        ],
    ),
]


@pytest.mark.parametrize(("files", "expected"), [(f, e) for _, f, e in CASES], ids=[c[0] for c in CASES])
def test_plan_per_stack(files: dict[str, str], expected: list[str]) -> None:
    assert detect(files).lines() == expected


def test_dependency_files_and_layer_dirs() -> None:
    python = detect({"pyproject.toml": "[project]\n", "poetry.lock": POETRY_LOCK})
    assert python.dependency_files == ("pyproject.toml", "poetry.lock")
    assert python.dependency_dir == ".zattera"
    assert python.generated == {".zattera/requirements.txt": "click==8.1.7\nflask==3.1.0\n"}
    node = detect({"package.json": "{}", "package-lock.json": "{}"})
    assert (node.dependency_files, node.dependency_dir) == (("package.json", "package-lock.json"), "node_modules")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"package.json": "{"}, "package.json: "),
        ({"package.json": "[]"}, "package.json: not a JSON object"),
        ({"pyproject.toml": "[project"}, "pyproject.toml: "),
        ({"zattera.toml": "= 1"}, "zattera.toml: "),
        ({"pyproject.toml": "", "poetry.lock": "[[package"}, "poetry.lock: "),
    ],
)
def test_malformed_files_are_named(files: dict[str, str], message: str) -> None:
    with pytest.raises(PlanError, match=f"^{message}"):
        detect(files)


def test_requirement_names_skip_options_and_comments() -> None:
    lines = [
        "-r base.txt",
        "--index-url x",
        "# c",
        "Django_Rest.Framework>=3 ; python_version>'3'",
        "uvicorn[standard]",
    ]
    assert requirement_names(lines) == {"django-rest-framework", "uvicorn"}
    assert poetry_requirements("") == ""


def test_read_source_collects_the_files_detect_reads(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "wsgi.py").write_text("")
    (tmp_path / "manage.py").write_text("")
    (tmp_path / "other.py").write_text("")
    (tmp_path / "requirements.txt").write_text("django\n")
    assert sorted(read_source(tmp_path)) == ["manage.py", "proj/wsgi.py", "requirements.txt"]


def test_build_plan_command(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(FLASK_APP)
    (tmp_path / "requirements.txt").write_text("flask\ngunicorn\n")
    (tmp_path / "Procfile").write_text("web: gunicorn app:app --bind 0.0.0.0:$PORT --workers 2\n")
    runner = CliRunner()
    result = runner.invoke(cli_app, ["build", "plan", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (
        result.output.splitlines()[3]
        == "plan: start    gunicorn app:app --bind 0.0.0.0:$PORT --workers 2  (Procfile web:)"
    )
    as_json = json.loads(runner.invoke(cli_app, ["build", "plan", str(tmp_path), "--json"]).output)
    assert as_json["provider"] == "python" and as_json["dependency_files"] == ["requirements.txt"]
    (tmp_path / "Procfile").unlink()
    (tmp_path / "app.py").unlink()
    failed = runner.invoke(cli_app, ["build", "plan", str(tmp_path)])
    assert failed.exit_code == 1 and "plan: error    no start command" in failed.output
    (tmp_path / "package.json").write_text("{")
    (tmp_path / "requirements.txt").unlink()
    broken = runner.invoke(cli_app, ["build", "plan", str(tmp_path)])
    assert broken.exit_code == 1 and "package.json: " in broken.output and "Traceback" not in broken.output


@pytest.mark.parametrize(
    ("files", "docker", "refused"),
    [
        ({"Dockerfile": "FROM x"}, None, ""),  # `zattera deploy`: the builder may have a Docker daemon
        ({"Dockerfile": "FROM x"}, True, ""),
        ({"Dockerfile": "FROM x"}, False, "a Dockerfile build needs a builder with a Docker daemon"),
        ({"requirements.txt": "flask\n"}, None, "no start command for this python app"),
        ({"requirements.txt": "flask\n", "Procfile": "web: python app.py\n"}, None, ""),
        ({"zattera.toml": "[run]\ncommand = 3\n"}, None, "zattera.toml: [run] command must be a string"),
        ({"zattera.toml": '[build]\ncommand = ["make"]\n'}, None, "zattera.toml: [build] command must be a string"),
        ({"zattera.toml": "[run\n"}, None, "zattera.toml: "),
    ],
)
def test_check_source_refuses_what_a_build_would_fail_with(
    files: dict[str, str], docker: bool | None, refused: str
) -> None:
    from shared.buildplan import check_source

    if not refused:
        assert check_source(files, docker=docker)
        return
    with pytest.raises(PlanError, match=re.escape(refused)):
        check_source(files, docker=docker)


@pytest.mark.parametrize(
    ("command", "python"),
    [
        ("python3 app.py", True),
        ("python app.py", True),
        ("exec python3.11 -m app", True),
        ("PORT=8000 DEBUG=1 python3 server.py", True),
        ("gunicorn app:app", False),
        ("/usr/bin/python3 app.py", False),  # a path of the builder's machine: not the interpreter on PATH
        ("pythonista run", False),
        ("node server.js", False),
        ("", False),
        ("python3 'unterminated", False),
    ],
)
def test_a_start_command_that_runs_python_is_recognised(command: str, python: bool) -> None:
    assert starts_python(command) is python
