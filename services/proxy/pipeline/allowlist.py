"""IP allowlist: a route that names the networks it admits answers anyone else 403. The client is the
connection's peer, or the last ``X-Forwarded-For`` value behind an engine in front (HAProxy)."""

from __future__ import annotations

from aiohttp import web

from services.proxy.pipeline.flow import Flow, StepResult, error_response


def client_ip(request: web.BaseRequest, behind_engine: bool) -> str:
    if behind_engine:
        forwarded = request.headers.getall("X-Forwarded-For", ())
        if forwarded:
            return forwarded[-1].rsplit(",", 1)[-1].strip()
    return request.remote or ""


class Allowlist:
    def __init__(self, behind_engine: bool) -> None:
        self.behind_engine = behind_engine

    def __call__(self, flow: Flow) -> StepResult:
        assert flow.entry is not None, "after the route match"
        flow.client_ip = client_ip(flow.request, self.behind_engine)
        if not flow.entry.admits(flow.client_ip):
            return error_response(403, "forbidden")
        return None
