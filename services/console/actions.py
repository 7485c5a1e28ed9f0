"""What a console admin can do: each action is the same fenced write the CLI makes (shared/), decided on the
console's state view and committed by its unfenced writer; a concurrent write refuses it and it is decided
again. Every refusal is an :class:`ActionRefused` whose message names the bad field."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from google.protobuf.message import Message
from zattera.v1 import types_pb2 as pb

from shared import keys as K
from shared.appconfig import ConfigError, check_name, check_secret_value
from shared.deploy import Deployer, DeployError
from shared.events import EventPublisher, event_for_env, node_change_event
from shared.natsio import Connection
from shared.scaling import ScaleRequest, scaled
from shared.secret_edits import set_secret_edit
from shared.txn import Conflict, Writer
from shared.view import StateView

ATTEMPTS = 10
NODE_CHANGES = ("cordon", "uncordon", "drain")


class ActionRefused(Exception):
    pass


class Actions:
    def __init__(self, conn: Connection, view: StateView, writer: Writer) -> None:
        self._conn = conn
        self._view = view
        self._writer = writer
        self._events = EventPublisher(conn)

    def _deployer(self, user: str) -> Deployer:
        return Deployer(self._writer, created_by=f"console:{user}")

    async def _commit_edit(self, what: str, edit: Callable[[], Message | None]) -> Message | None:
        for _ in range(ATTEMPTS):
            edited = edit()
            if edited is None:
                return None
            try:
                await self._writer.commit(self._writer.txn().put(edited))
                return edited
            except Conflict:
                await asyncio.sleep(0.05)
        raise ActionRefused(f"{what} kept changing; try again")

    async def rollback(self, user: str, env_id: str, to_release_id: str) -> pb.Deployment:
        try:
            return await self._deployer(user).rollback(env_id, to_release_id=to_release_id)
        except DeployError as exc:
            raise ActionRefused(str(exc)) from None

    async def scale(self, user: str, env_id: str, request: ScaleRequest) -> pb.Environment:
        problem = request.problem()
        if problem:
            raise ActionRefused(problem)

        def edit() -> pb.Environment:
            env = self._view.env(env_id)
            if env is None:
                raise ActionRefused(f"env {env_id!r} not found")
            try:
                new = scaled(env, request)
            except ValueError as exc:
                raise ActionRefused(str(exc)) from None
            new.meta.updated_at.FromNanoseconds(time.time_ns())
            return new

        new = await self._commit_edit(f"env {env_id}", edit)
        assert isinstance(new, pb.Environment)
        bounds = new.service.replicas
        message = f"scaled to {new.effective_replicas} replica(s) (min {bounds.min}, max {bounds.max})"
        await self._events.publish(event_for_env(new, "env.scaled", message, fields={"actor": f"console:{user}"}))
        return new

    async def change_node(self, user: str, node_id: str, change: str) -> pb.Node | None:
        """Cordon, uncordon or drain a node, as ``zattera nodes cordon|uncordon|drain``."""
        if change not in NODE_CHANGES:
            raise ActionRefused(f"change {change!r}: must be one of {', '.join(NODE_CHANGES)}")
        decided_on: list[tuple[pb.Node, int]] = []

        def edit() -> pb.Node | None:
            node = self._view.node(node_id)
            if node is None:
                raise ActionRefused(f"node {node_id!r} not found")
            decided_on[:] = [(node, self._view.rev(K.node(node_id)))]
            edited = pb.Node()
            edited.CopyFrom(node)
            if change == "cordon":
                if node.status in (pb.NODE_STATUS_DRAINING, pb.NODE_STATUS_DRAINED):
                    return None
                edited.schedulable = False
            elif change == "uncordon":
                if node.status == pb.NODE_STATUS_DOWN:
                    raise ActionRefused(f"node {node_id} is down: it cannot be uncordoned until it heartbeats again")
                edited.status = pb.NODE_STATUS_ALIVE
                edited.schedulable = True
            else:
                edited.status = pb.NODE_STATUS_DRAINING
                edited.schedulable = False
            return edited

        edited = await self._commit_edit(f"node {node_id}", edit)
        if isinstance(edited, pb.Node):
            before, revision = decided_on[0]
            event = node_change_event(before, edited, time.time(), actor=f"console:{user}", revision=revision)
            if event is not None:
                await self._events.publish(event)
            return edited
        return None

    async def set_secret(self, user: str, env_id: str, name: str, value: str) -> str:
        """Seal ``value`` to the cluster key and roll it out; returns the deployment id ("" = staged). The
        value is never logged, returned or put in an error."""
        try:
            check_name(f"secrets.{name}", name)
            checked = check_secret_value(name, value.encode())
            done = await self._deployer(user).reconfigure(env_id, set_secret_edit(self._view, name, checked))
        except (ConfigError, DeployError) as exc:
            raise ActionRefused(str(exc)) from None
        return done.deployment.meta.id if done.deployment is not None else ""
