"""HTTPS redirect: a route whose middleware asks for it answers a plain-HTTP request 308 to its HTTPS URL,
unless ``X-Forwarded-Proto: https`` says a TLS terminator in front already did TLS, or the request is an
ACME challenge (an app answering its own: CAs ask over HTTP)."""

from __future__ import annotations

from aiohttp import hdrs, web

from services.proxy.auth import https_location, is_https
from services.proxy.pipeline.flow import Flow, Handler
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH


async def https_redirect(flow: Flow, following: Handler) -> web.StreamResponse:
    request = flow.request
    if (
        flow.middleware is not None
        and flow.middleware.redirect_https
        and not flow.path.startswith(CHALLENGE_PATH)
        and not is_https(request.scheme, request.headers.get("X-Forwarded-Proto", ""))
    ):
        location = https_location(request.headers.get(hdrs.HOST, flow.host), request.path_qs)
        return web.Response(status=308, headers={hdrs.LOCATION: location})
    return await following(flow)
