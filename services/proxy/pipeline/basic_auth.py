"""Basic auth: a route with users lets in only a request carrying one's password (bcrypt:
:mod:`services.proxy.auth`); else 401. The forward step drops the checked ``Authorization`` header."""

from __future__ import annotations

from aiohttp import hdrs, web

from services.proxy.auth import BasicAuth
from services.proxy.pipeline.flow import Flow, StepResult, error_response


class BasicAuthCheck:
    def __init__(self, basic_auth: BasicAuth) -> None:
        self.basic_auth = basic_auth

    def __call__(self, flow: Flow) -> StepResult:
        assert flow.entry is not None, "after the route match"
        users = flow.entry.users
        return self._check(users, flow.request.headers.get(hdrs.AUTHORIZATION, "")) if users else None

    async def _check(self, users: dict[str, str], authorization: str) -> web.StreamResponse | None:
        if await self.basic_auth.admits(users, authorization):
            return None
        return error_response(401, "unauthorized", {"WWW-Authenticate": 'Basic realm="zattera"'})
