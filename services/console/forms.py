"""The console's forms: each operator action a POST asks for is called in ``shared/actions/`` as the session's
user, and its refusal mapped to an HTTP status (409; 403; 503 when a node or service did not answer)."""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from services.console.handling import client_address, console_of, is_api, redirect_to, refuse, session_of
from shared.actions.context import ActionContext
from shared.actions.deploys import CanaryDecision, Rollback, abort_canary, promote_canary, rollback
from shared.actions.envs import Scale, scale
from shared.actions.jobs import CancelJob, cancel_job
from shared.actions.nodes import EditNode, NodeChange, edit_node
from shared.actions.refusals import ActionRefused, Invalid, Refusal
from shared.actions.secrets import SetSecret, set_secret
from shared.actions.volumes import RestoreVolume, TakeSnapshot, restore_volume, take_snapshot
from shared.audit import AuditedWriter, Auditor

QUICK_ANSWER = 1.0
"""How long a restore is waited for before the answer is "started" (its refusals come sooner than this)."""


NODE_CHANGES = frozenset({NodeChange.CORDON, NodeChange.UNCORDON, NodeChange.DRAIN})


REFUSAL_STATUS = {
    Refusal.NOT_FOUND: 409,
    Refusal.INVALID: 409,
    Refusal.CONFLICT: 409,
    Refusal.FORBIDDEN: 403,
    Refusal.UNAVAILABLE: 503,
}
"""The console answers a refused action 409 with the message naming the bad field (docs/console.md); a
node or service that did not answer, 503."""


def _done(request: web.Request, where: str, notice: str, **payload: Any) -> web.StreamResponse:
    if is_api(request):
        return web.json_response({"ok": True, "message": notice, **payload})
    console_of(request).flash[session_of(request).csrf] = notice
    return redirect_to(where)


async def _form(request: web.Request) -> dict[str, str]:
    if request.content_type == "application/json":
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body: not valid JSON") from None
        return {str(k): str(v) for k, v in body.items()} if isinstance(body, dict) else {}
    return {k: str(v) for k, v in (await request.post()).items()}


def _acting(request: web.Request) -> ActionContext:
    """The operator actions' context, acting as the session's user; its writes are audited as that user's
    (docs/audit.md), with the action's name (the form's) and the browser's address."""
    console = console_of(request)
    user = session_of(request).user
    context = console.actions.acting_as(f"console:{user}")
    if console.audit is None:
        return context
    handler = getattr(request.match_info.route, "handler", None)
    auditor = Auditor(
        source="console",
        user=user,
        verified=True,
        verified_by="console-login",
        action=getattr(handler, "__name__", "").removesuffix("_action"),
        address=client_address(request),
    )
    return dataclasses.replace(context, writer=AuditedWriter(console.conn, console.view, auditor, console.audit))


def _refused(request: web.Request, exc: ActionRefused) -> web.Response:
    return refuse(request, REFUSAL_STATUS[exc.kind], str(exc))


async def rollback_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    try:
        done = await rollback(_acting(request), Rollback(env_id, form.get("release_id", "")))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = f"rolling back to v{done.release_version} (deployment {done.deployment_id})"
    return _done(request, f"/env/{env_id}", notice, deployment_id=done.deployment_id)


def _optional_int(form: dict[str, str], field: str) -> int | None:
    value = form.get(field, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise Invalid(field, "not a whole number", said=f"{field} {value!r}") from None


async def scale_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    try:
        replicas, minimum, maximum = (_optional_int(form, field) for field in ("replicas", "min", "max"))
        done = await scale(_acting(request), Scale(env_id, replicas, minimum, maximum))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, f"/env/{env_id}", f"scaled to {done.replicas} replica(s)")


async def secret_action(request: web.Request) -> web.StreamResponse:
    env_id = request.match_info["env_id"]
    form = await _form(request)
    name = form.get("name", "").strip()
    try:
        done = await set_secret(_acting(request), SetSecret(env_id, name, form.get("value", "")))
    except ActionRefused as exc:
        return _refused(request, exc)
    rollout = (
        f", rolling out (deployment {done.deployment_id})" if done.deployment_id else ", staged for the next deploy"
    )
    return _done(request, f"/env/{env_id}", f"secret {name} set{rollout}", deployment_id=done.deployment_id)


async def cancel_job_action(request: web.Request) -> web.StreamResponse:
    env_id, job_id = request.match_info["env_id"], request.match_info["job_id"]
    try:
        await cancel_job(_acting(request), CancelJob(job_id, env_id))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, f"/env/{env_id}", f"job {job_id}: cancel requested")


async def node_action(request: web.Request) -> web.StreamResponse:
    node_id, change = request.match_info["node_id"], request.match_info["change"]
    if change not in NODE_CHANGES:
        raise web.HTTPNotFound()
    try:
        done = await edit_node(_acting(request), EditNode(node_id, NodeChange(change)))
    except ActionRefused as exc:
        return _refused(request, exc)
    return _done(request, "/nodes", f"node {node_id}: {change} {'done' if done.written else 'had nothing to do'}")


async def snapshot_action(request: web.Request) -> web.StreamResponse:
    volume_id = request.match_info["volume_id"]
    try:
        done = await take_snapshot(_acting(request), TakeSnapshot(volume_id, wait=0))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = f"snapshot {done.snapshot_id} of volume {volume_id} started"
    return _done(request, "/volumes", notice, snapshot_id=done.snapshot_id)


async def restore_action(request: web.Request) -> web.StreamResponse:
    volume_id = request.match_info["volume_id"]
    snapshot_id = (await _form(request)).get("snapshot_id", "")
    try:
        done = await restore_volume(_acting(request), RestoreVolume(volume_id, snapshot_id, wait=QUICK_ANSWER))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = "restored" if done.finished else "restoring (the volume shows RESTORING until it is done)"
    return _done(
        request, "/volumes", f"volume {volume_id} from snapshot {snapshot_id}: {notice}", finished=done.finished
    )


async def canary_action(request: web.Request) -> web.StreamResponse:
    """A canary's promote or abort (``/env/{env_id}/deployments/{deployment_id}/promote|abort``, issue 41)."""
    env_id, deployment_id, verb = (request.match_info[k] for k in ("env_id", "deployment_id", "verb"))
    action = {"promote": promote_canary, "abort": abort_canary}.get(verb)
    if action is None:
        raise web.HTTPNotFound(text=f"no canary action {verb!r}")
    try:
        done = await action(_acting(request), CanaryDecision(deployment_id))
    except ActionRefused as exc:
        return _refused(request, exc)
    notice = f"deployment {done.deployment_id}: {done.requested} requested at canary step {done.step + 1}"
    return _done(request, f"/env/{env_id}", notice, deployment_id=done.deployment_id, requested=done.requested)
