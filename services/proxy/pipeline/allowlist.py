"""IP allowlist: a route that names the networks it admits answers anyone else 403. The client is the
connection's peer, or the last ``X-Forwarded-For`` value behind an engine in front (HAProxy)."""

from __future__ import annotations

from services.proxy.pipeline.flow import Flow, StepResult, client_ip, error_response


class Allowlist:
    def __init__(self, behind_engine: bool) -> None:
        self.behind_engine = behind_engine

    def __call__(self, flow: Flow) -> StepResult:
        assert flow.entry is not None, "after the route match"
        if flow.entry.allowlist is not None and not flow.entry.admits(client_ip(flow.request, self.behind_engine)):
            return error_response(403, "forbidden")
        return None
