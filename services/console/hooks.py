"""``POST /hooks/<provider>/<hook id>``: a git host's webhook delivery (docs/git.md, "Webhooks and previews").

No session: the delivery is authenticated by its signature (GitHub, Gitea) or token (GitLab), which only the
secrets service can check (it alone opens the hook's sealed secret). The console passes the body and the
provider's headers on (``zattera.githooks.deliver``) and answers with what the secrets service decided:
202 queued (the deploy happens in the ``githooks`` leader loop, after this answer), 401 unsigned or forged,
409 a replayed delivery, 404 no such hook. Nothing here logs a header's value.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared import githooks as G
from shared.subjects import GITHOOKS_DELIVER_SUBJECT

from .handling import console_of

log = logging.getLogger(__name__)

FORWARD_TIMEOUT = 5.0
HOOK_HEADER = "Zattera-Hook"
PROVIDER_HEADER = "Zattera-Provider"


async def webhook(request: web.Request) -> web.Response:
    provider, hook_id = request.match_info["provider"], request.match_info["hook_id"]
    if provider not in G.PROVIDERS:
        return web.json_response({"error": "no such hook"}, status=404)
    body = await request.content.read(G.MAX_BODY + 1)
    if len(body) > G.MAX_BODY:
        return web.json_response({"error": f"the delivery is larger than {G.MAX_BODY} bytes"}, status=413)
    names = G.HEADERS[provider]
    headers = {HOOK_HEADER: hook_id, PROVIDER_HEADER: provider}
    for name in (names.event, names.delivery, names.signature, "X-Gitlab-Webhook-UUID"):
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    console = console_of(request)
    try:
        reply = await console.conn.nc.request(GITHOOKS_DELIVER_SUBJECT, body, timeout=FORWARD_TIMEOUT, headers=headers)
        answer = json.loads(reply.data)
        status, message = int(answer["status"]), str(answer["message"])
    except (NatsTimeout, NoRespondersError):
        status, message = 503, "the secrets service did not answer; redeliver later"
    if status >= 400:
        log.info("git hook %s/%s: delivery refused (%d)", provider, hook_id, status)
        return web.json_response({"error": message}, status=status)
    return web.json_response({"message": message}, status=status)
