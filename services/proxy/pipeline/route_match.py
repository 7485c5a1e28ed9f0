"""Route match: the route of the request's host and path in the current route table, or 404."""

from __future__ import annotations

from collections.abc import Callable

from services.proxy.pipeline.flow import ENV_KEY, Flow, StepResult, error_response
from services.proxy.routing import RouteTable


class RouteMatch:
    def __init__(self, table: Callable[[], RouteTable]) -> None:
        self.table = table
        """The current table (replaced on every accepted snapshot)."""

    def __call__(self, flow: Flow) -> StepResult:
        entry = self.table().match(flow.host, flow.path)
        if entry is None:
            return error_response(404, "no route for host")
        flow.entry = entry
        flow.request[ENV_KEY] = entry.env_id
        return None
