"""Basic auth: a route with users lets in only a request carrying one's password (bcrypt:
:mod:`services.proxy.auth`); else 401. The forward step drops the checked ``Authorization`` header."""

from __future__ import annotations

from aiohttp import hdrs, web

from services.proxy.auth import BasicAuth, route_users
from services.proxy.pipeline.flow import Flow, Handler, error_response


class BasicAuthCheck:
    def __init__(self, basic_auth: BasicAuth) -> None:
        self.basic_auth = basic_auth

    async def __call__(self, flow: Flow, following: Handler) -> web.StreamResponse:
        users = route_users(flow.middleware) if flow.middleware is not None else {}
        if users and not await self.basic_auth.admits(users, flow.request.headers.get(hdrs.AUTHORIZATION, "")):
            return error_response(401, "unauthorized", {"WWW-Authenticate": 'Basic realm="zattera"'})
        return await following(flow)
