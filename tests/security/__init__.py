"""Security: NATS accounts, per-role permissions, node join, TLS."""
