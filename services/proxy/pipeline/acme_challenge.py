"""The ACME HTTP-01 answers: a challenge path the certificate service has an answer for is answered here,
before any route (a CA asks over HTTP, for hosts whatever their routes say)."""

from __future__ import annotations

from aiohttp import web

from services.proxy.pipeline.flow import Flow, Handler
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH
from shared.acmechallenge import ChallengeAnswers


class AcmeChallenge:
    def __init__(self, challenges: ChallengeAnswers) -> None:
        self.challenges = challenges

    async def __call__(self, flow: Flow, following: Handler) -> web.StreamResponse:
        if flow.path.startswith(CHALLENGE_PATH) and (answer := await self.challenges.lookup(flow.path)) is not None:
            return web.Response(text=answer, content_type="application/octet-stream")
        return await following(flow)
