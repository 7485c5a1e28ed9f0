"""The Python data plane's request pipeline: one middleware per module, composed as a chain in
:data:`ORDER` (``services/proxy/server.py`` builds it), each one answering or passing the request on to
the next, the last one forwarding it upstream.

route match (404) → IP allowlist (403) → HTTPS redirect (308) → rate limit (429) → basic auth (401) →
body cap (413) → endpoint choice (sticky, then P2C; hold-and-activate when cold or full: 503/504, else 502)
→ forward (502 on an upstream error). An ACME HTTP-01 challenge answer comes before everything.
"""

ORDER = (
    "acme_challenge",
    "route_match",
    "allowlist",
    "https_redirect",
    "rate_limit",
    "basic_auth",
    "body_cap",
    "endpoint_choice",
    "forward",
)
"""The middleware modules of this package, in the order a request meets them; ``haproxy_config.py`` and
``haproxy_rules.py`` order HAProxy's frontend and backend rules by it as well."""
