"""What the operator-action tests share: a context acting as ``tester`` on real NATS, and a named env."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared.actions.context import ActionContext
from shared.connection import Connection
from shared.txn import Writer
from tests import factories

ACTOR = "tester"
ENV_ID = "01ENV"
PATH = "shop/web/production"


def named(*, active_release_id: str = "", min_replicas: int = 2, max_replicas: int = 4) -> list[Message]:
    """Project ``shop``, app ``web`` and its env ``production`` (``ENV_ID``)."""
    project = pb.Project(name="shop")
    project.meta.id = "01PROJ"
    app = pb.App(project_id="01PROJ", name="web")
    app.meta.id = "01APP"
    env = factories.env(
        ENV_ID, project_id="01PROJ", app_id="01APP", min_replicas=min_replicas, active_release_id=active_release_id
    )
    env.name = "production"
    env.service.replicas.max = max_replicas
    env.effective_replicas = min_replicas
    return [project, app, env]


@pytest.fixture
def ctx(conn: Connection, writer: Writer) -> ActionContext:
    return ActionContext(conn, writer, ACTOR)
