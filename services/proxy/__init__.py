"""The L7 ingress proxy (docs/ingress.md): routes HTTP/1.1 requests by Host and longest path
prefix from the route snapshots held by :class:`shared.routeclient.RouteClient`, balances over
endpoints by power-of-two-choices on in-flight, rate-limits per client, holds requests for
scaled-to-zero or saturated envs while asking the control plane to activate them, and reports
per-env traffic into ``zattera-live`` every 2 s."""
