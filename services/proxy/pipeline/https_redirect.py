"""HTTPS redirect: a route whose middleware asks for it answers a plain-HTTP request 308 to its HTTPS URL,
unless ``X-Forwarded-Proto: https`` says a TLS terminator in front already did TLS, or the request is an
ACME challenge (an app answering its own: CAs ask over HTTP)."""

from __future__ import annotations

from aiohttp import hdrs, web

from services.proxy.auth import https_location, is_https
from services.proxy.pipeline.flow import Flow, StepResult
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH


def https_redirect(flow: Flow) -> StepResult:
    assert flow.entry is not None, "after the route match"
    middleware, request = flow.entry.middleware, flow.request
    if (
        middleware is not None
        and middleware.redirect_https
        and not flow.path.startswith(CHALLENGE_PATH)
        and not is_https(request.scheme, request.headers.get("X-Forwarded-Proto", ""))
    ):
        location = https_location(request.headers.get(hdrs.HOST, flow.host), request.path_qs)
        return web.Response(status=308, headers={hdrs.LOCATION: location})
    return None
