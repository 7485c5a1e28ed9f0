"""The ACME HTTP-01 answers: a challenge path the certificate service has an answer for is answered here,
before any route (a CA asks over HTTP, for hosts whatever their routes say)."""

from __future__ import annotations

from aiohttp import web

from services.proxy.pipeline.flow import Flow, StepResult
from shared.acmechallenge import PATH_PREFIX as CHALLENGE_PATH
from shared.acmechallenge import ChallengeAnswers


class AcmeChallenge:
    def __init__(self, challenges: ChallengeAnswers) -> None:
        self.challenges = challenges

    def __call__(self, flow: Flow) -> StepResult:
        return self._answer(flow.path) if flow.path.startswith(CHALLENGE_PATH) else None

    async def _answer(self, path: str) -> web.StreamResponse | None:
        answer = await self.challenges.lookup(path)
        return web.Response(text=answer, content_type="application/octet-stream") if answer is not None else None
